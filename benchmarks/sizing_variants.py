"""Sizing variants of the structures the search finds for a model, for timing on the GPU.

Why: the search keeps one sizing (grid, loop) per structure, the one the cost model ranks first.
Timing the runners-up shows whether the model ranks sizings as the GPU does (the data of the cost
model's `chain_exposed` fit, benchmarks/RESULTS.md, 2026-12-02 third session).

    .venv/bin/python -m benchmarks.sizing_variants MODEL.onnx OUTDIR [--structures 1] [--keep 10]
    # on the GPU machine: python3 benchmarks/fixture_kernels.py --graphs OUTDIR

Explores every signature of the model's first region as `optimize` does (one process), then
writes the `--keep` cheapest sizings of each of the `--structures` best structures as μGraph
JSON (`<model>_r<i>_v<j>.json`) and `<model>_manifest.json` with each one's grid, loop, estimate
and launches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlso_cli.ir import serialize  # noqa: E402
from mlso_cli.pipeline.frontend import lift  # noqa: E402
from mlso_cli.search import run as search_run  # noqa: E402
from mlso_cli.search.api import SearchOptions  # noqa: E402
from mlso_cli.search.select import choose_dims  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--structures", type=int, default=1, help="best structures to size")
    ap.add_argument("--keep", type=int, default=10, help="sizings per structure")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    opts = SearchOptions()
    target = lift(str(args.model)).regions[0].graph
    _, dcf, sigs = search_run.explorable(target)
    _, share = search_run.state_budget(None, len(sigs))
    text = serialize.dumps(target)
    found = []
    for i, sig in enumerate(sigs):
        task = search_run.Task(text, sig, share, i, opts.arch, opts.block_ops, None, True)
        found.extend(search_run.explore(task).found)
    found.sort(key=lambda f: (f.estimate_us, repr(f.recipe)))
    stem, manifest, seen = args.model.stem, [], set()
    for f in found:
        if f.recipe in seen:
            continue
        r = len(seen)
        if r >= args.structures:
            break
        seen.add(f.recipe)
        slots = search_run.save_slots(f.recipe)
        for j, sized in enumerate(choose_dims(target, dcf, f.recipe, slots, keep=args.keep)):
            name = f"{stem}_r{r}_v{j}"
            (args.out / f"{name}.json").write_text(serialize.dumps(sized.graph))
            manifest.append(
                {
                    "name": name,
                    "grid": list(sized.dims.grid),
                    "loop": sized.dims.loop,
                    "estimate_us": sized.cost.us,
                    "launches": sized.cost.launches,
                }
            )
            print(name, sized.dims.grid, sized.dims.loop, f"{sized.cost.us:.2f} µs", flush=True)
    (args.out / f"{stem}_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
