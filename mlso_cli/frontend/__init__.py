"""Frontend: load a model, fix and infer its shapes, partition it, lift regions to μGraphs."""
