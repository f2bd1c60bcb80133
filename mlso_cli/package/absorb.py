"""Give each region its own copies of the constants it reads but its kernel does not take.

A region's fallback body must receive every tensor its nodes read (axes, eps, shape tensors),
while its kernel program takes only the tensors it computes with. Constants in the first group
become Constant nodes inside the region, so the MlsoKernel node's inputs are exactly the
program's inputs. Afterwards, constants nothing reads any more are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper


def absorb_constants(
    model: onnx.ModelProto,
    regions: Sequence[tuple[Sequence[int], Sequence[str]]],
    constants: dict[str, np.ndarray],
) -> tuple[onnx.ModelProto, list[list[int]]]:
    """regions: (node indices, the kernel's input names). Returns the new model and node indices."""
    nodes = list(model.graph.node)
    owner = {i: r for r, (idx, _) in enumerate(regions) for i in idx}
    first = {min(idx): r for r, (idx, _) in enumerate(regions)}
    renames: list[dict[str, str]] = []
    for r, (idx, kernel_inputs) in enumerate(regions):
        produced = {o for i in idx for o in nodes[i].output}
        reads = [x for i in idx for x in nodes[i].input if x and x not in produced]
        extra = [x for x in dict.fromkeys(reads) if x not in set(kernel_inputs)]
        missing = [x for x in extra if x not in constants]
        if missing:
            raise ValueError(
                f"region reads non-constant tensors its kernel does not take: {missing}"
            )
        renames.append({x: f"{x}__mlso_r{r}" for x in extra})
    out_nodes: list[onnx.NodeProto] = []
    new_idx: list[list[int]] = [[] for _ in regions]
    for i, n in enumerate(nodes):
        if i in first:
            r = first[i]
            for old, new in renames[r].items():
                new_idx[r].append(len(out_nodes))
                out_nodes.append(
                    helper.make_node(
                        "Constant",
                        [],
                        [new],
                        value=numpy_helper.from_array(constants[old]),
                        name=f"{new}_const",
                    )
                )
        if i in owner:
            r = owner[i]
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.input[:] = [renames[r].get(x, x) for x in n.input]
            new_idx[r].append(len(out_nodes))
            out_nodes.append(c)
        else:
            out_nodes.append(n)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.node[:]
    m.graph.node.extend(out_nodes)
    return m, new_idx


def prune_unused(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop Constant nodes and initializers that nothing reads (after regions absorbed copies)."""
    g = model.graph
    while True:
        read = {x for n in g.node for x in n.input} | {o.name for o in g.output}
        for f in model.functions:
            read |= {x for n in f.node for x in n.input}
        dead = [
            n
            for n in g.node
            if n.op_type == "Constant"
            and n.domain in ("", "ai.onnx")
            and not (set(n.output) & read)
        ]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    read = {x for n in g.node for x in n.input} | {o.name for o in g.output}
    init_names = {t.name for t in g.initializer}
    keep = [t for t in g.initializer if t.name in read]
    if len(keep) != len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(keep)
        dropped = init_names - {t.name for t in keep}
        inputs = [i for i in g.input if i.name not in dropped]  # user inputs always stay
        del g.input[:]
        g.input.extend(inputs)
    return model
