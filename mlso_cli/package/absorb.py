"""Give each region its own copies of the constants it reads but its kernel does not take.

A region's fallback body must receive every tensor its nodes read (axes, eps, shape tensors),
while its kernel program takes only the tensors it computes with. Constants in the first group
become Constant nodes inside the region, so the MlsoKernel node's inputs are exactly the
program's inputs. Afterwards, constants nothing reads any more are dropped.

Sibling projections (frontend/siblings.py) are the exception to copying: the kernel takes their
weights concatenated along N, so the body reads each merged MatMul's weight as a Slice of that
concatenation (its columns, exactly the original weight) rather than a copy of the original.
Why: a copy would keep every projection weight twice in the file, once concatenated for the
kernel and once separate for the body; read as slices, the originals are no longer read by the
region and `prune_unused` drops them unless something outside it still reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mlso_cli.frontend.load import onnx_opset
from mlso_cli.package.rewrite import unique_name

SLICE_OPSET = 10
"""The first default-domain opset whose Slice takes starts, ends and axes as inputs; below it a
body keeps copies of the original weights (the form verify's checks know)."""


def _all_names(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    names = {t.name for t in g.initializer} | {v.name for v in [*g.input, *g.output, *g.value_info]}
    for n in g.node:
        names.update(x for x in [*n.input, *n.output] if x)
    return names


def _column_slices(
    node: onnx.NodeProto, r: int, cat: str, start: int, end: int, taken: set[str]
) -> tuple[str, list[onnx.NodeProto]]:
    """Nodes computing columns start:end of `cat` (the weight of MatMul `node` of region r):
    three int64 Constants (starts, ends, axes = 1) and the Slice; returns its output's name."""
    y = node.output[0]
    made, names = [], []
    for what, value in (("starts", start), ("ends", end), ("axes", 1)):
        name = unique_name(f"{y}__mlso_{what}_r{r}", taken)
        names.append(name)
        made.append(
            helper.make_node(
                "Constant",
                [],
                [name],
                value=numpy_helper.from_array(np.array([value], np.int64)),
                name=f"{name}_const",
            )
        )
    out = unique_name(f"{y}__mlso_weight_r{r}", taken)
    made.append(helper.make_node("Slice", [cat, *names], [out], name=f"{out}_slice"))
    return out, made


def absorb_constants(
    model: onnx.ModelProto,
    regions: Sequence[tuple[Sequence[int], Sequence[str]]],
    constants: Mapping[str, np.ndarray],
    columns: Sequence[Mapping[str, tuple[str, int, int]]] | None = None,
    *,
    in_place: bool = False,
) -> tuple[onnx.ModelProto, list[list[int]]]:
    """regions: (node indices, the kernel's input names). Returns the new model and node indices.
    `in_place`: change `model` itself and return it (for a caller that owns it: a copy of a
    model's weights is a copy of every weight byte).

    columns: per region, LiftedRegion.columns (a merged sibling MatMul's output -> its
    concatenated weight, first and end column); each such MatMul whose concatenation the kernel
    takes reads its weight as that Slice of it (module docstring)."""
    nodes = list(model.graph.node)
    owner = {i: r for r, (idx, _) in enumerate(regions) for i in idx}
    first = {min(idx): r for r, (idx, _) in enumerate(regions)}
    slicing = onnx_opset(model) >= SLICE_OPSET
    taken = _all_names(model)
    weight_of: dict[int, str] = {}  # node index -> the Slice output it reads as its weight
    made: list[list[onnx.NodeProto]] = [[] for _ in regions]
    renames: list[dict[str, str]] = []
    for r, (idx, kernel_inputs) in enumerate(regions):
        cols = columns[r] if columns is not None and slicing else {}
        for i in idx:
            n = nodes[i]
            col = cols.get(n.output[0]) if n.output else None
            if (
                col is None
                or n.op_type != "MatMul"
                or n.domain not in ("", "ai.onnx")
                or len(n.input) != 2
                or col[0] not in kernel_inputs
            ):
                continue
            weight_of[i], new = _column_slices(n, r, *col, taken)
            made[r].extend(new)
        produced = {o for i in idx for o in nodes[i].output}
        reads = [
            x
            for i in idx
            for k, x in enumerate(nodes[i].input)
            if x and x not in produced and not (k == 1 and i in weight_of)
        ]
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
            for c in made[r]:
                new_idx[r].append(len(out_nodes))
                out_nodes.append(c)
        if i in owner:
            r = owner[i]
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.input[:] = [renames[r].get(x, x) for x in n.input]
            if i in weight_of:
                c.input[1] = weight_of[i]
            new_idx[r].append(len(out_nodes))
            out_nodes.append(c)
        else:
            out_nodes.append(n)
    m = model
    if not in_place:
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
    dead_at = [i for i, t in enumerate(g.initializer) if t.name not in read]
    if dead_at:
        # deleted one by one, from the end: clearing the list and adding back the tensors kept
        # would copy every kept weight twice (out of the list, then into it)
        dropped = {g.initializer[i].name for i in dead_at}
        for i in reversed(dead_at):
            del g.initializer[i]
        inputs = [i for i in g.input if i.name not in dropped]  # user inputs always stay
        del g.input[:]
        g.input.extend(inputs)
    return model
