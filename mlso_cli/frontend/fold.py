"""Fold shape-only subgraphs into constants once the input shapes are fixed.

Exporters with dynamic axes compute at run time what static input shapes make constant: Reshape
targets (Shape -> Gather -> Concat), the causal mask (Range, comparisons, And, Where) and the
RoPE tables (Range x inv_freq -> Cos/Sin). Folding turns each into a constant that lifting can
use (a static view, a 0/1 mask, a table read as a kernel input).

What may fold is decided by where a value comes from: a node folds when every input is a
constant that depends only on the fixed input shapes and on small constants (an initializer or
Constant node of at most TABLE_ELEMENTS elements, or a boolean one of any size). A value computed
from a larger numeric initializer (a weight) never folds, so a folded result is never a copy or
transform of a large weight.

Why tables up to TABLE_ELEMENTS: exporters precompute what the fixed example shapes make constant
and store it as an initializer. The Phi-3 and Qwen3 exports of torch.onnx's dynamo exporter hold
RoPE's positions x inv_freq product as a 128 x 96 (128 x 128) float initializer; while only
4,096-element constants could fold, Cos, Sin, two Casts and two Unsqueezes of it ran in ONNX
Runtime on every call, beside the regions. Folding from a tensor this small copies at most
1 MiB (less: the source dies when nothing else reads it), and the fold is exact.

Why booleans of any size: no model multiplies by a boolean weight; a large boolean constant is a
mask, which an exporter given static shapes writes out whole (torch.onnx's dynamo exporter stores
a Qwen2 export's causal mask as two 128 x 128 booleans, And-ed and turned into the additive mask
by Where: three ONNX Runtime kernels per run that fold away).

The folded output's size is capped by a byte budget (`knobs().max_fold_bytes`, 16 MiB by
default): a seq x seq mask at a long sequence stays a node. Why each node that could have folded
did not is kept in `FoldResult.notes` for `inspect`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

SMALL_CONSTANT_ELEMENTS = 4096
"""Initializers up to this many elements are small constants (shape vectors, scalars, inv_freq,
norm scales): package/regionmodel.py keeps them inline in a region's model."""
TABLE_ELEMENTS = 262_144
"""Initializers and Constant nodes up to this many elements (1 MiB in fp32) may be read by folding:
small constants and precomputed tables (a RoPE position x frequency product up to 2,048 positions
x 128); larger ones are weights, and nothing computed from them folds."""


def _small_constant(elements: int, boolean: bool) -> bool:
    """A constant that folding may read (module docstring): a small constant or table, or a
    boolean mask."""
    return elements <= TABLE_ELEMENTS or boolean


_NEVER_FOLD = {
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
}


def constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a Constant node, whichever value_* attribute holds it (None if none does)."""
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
    return None


def _evaluate(node: onnx.NodeProto, values: list[np.ndarray], opsets) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" for i in range(len(values))]
    renamed = helper.make_node(
        node.op_type,
        [names[i] if node.input[i] else "" for i in range(len(node.input))],
        [f"out{i}" for i in range(len(node.output))],
        domain=node.domain,
    )
    renamed.attribute.extend(node.attribute)
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for n, v in zip(names, values)
    ]
    outputs = [helper.make_tensor_value_info(f"out{i}", 0, None) for i in range(len(node.output))]
    graph = helper.make_graph([renamed], "fold", inputs, outputs)
    m = helper.make_model(graph, opset_imports=list(opsets))
    try:
        res = ReferenceEvaluator(m).run(None, dict(zip(names, values)))
    except Exception:
        return None
    return [np.asarray(r) for r in res]


@dataclass
class FoldResult:
    model: onnx.ModelProto
    notes: dict[str, str] = field(default_factory=dict)
    """First output name of each node that is computed from constants only and still did not
    fold -> why (read from a weight, over the byte budget, not evaluable); `inspect` adds it to
    the node's reason."""


def fold_constants(
    model: onnx.ModelProto, base_dir: Path | None = None, max_rounds: int = 6
) -> onnx.ModelProto:
    """Replace nodes whose inputs are all shape-derived constants by Constant nodes; drop dead nodes."""
    return fold_with_notes(model, base_dir, max_rounds).model


def fold_with_notes(
    model: onnx.ModelProto, base_dir: Path | None = None, max_rounds: int = 6
) -> FoldResult:
    """`fold_constants`, also saying why each constant-only node that stays did not fold.

    Rounds repeat because shape inference after a fold can make more shapes static (a Shape of a
    tensor whose Reshape target was just folded). `model` is changed in place (its nodes, then
    its shapes: the inference sees it without its weights, frontend/inference.py)."""
    from mlso_cli.frontend.inference import infer_in_place
    from mlso_cli.knobs import knobs

    limit = knobs().max_fold_bytes
    derived: set[str] = set()
    notes: dict[str, str] = {}
    for _ in range(max_rounds):
        notes = {}
        changed = _fold_round(model, derived, notes, limit)
        if not changed:
            break
        model = infer_in_place(model)
    model = _remove_dead(model)
    live = {o for n in model.graph.node for o in n.output}
    return FoldResult(model, {k: v for k, v in notes.items() if k in live})


def _static_types(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...], int]]:
    """Static shape and element type of every tensor shape inference resolved."""
    g = model.graph
    out = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            out[vi.name] = (tuple(d.dim_value for d in tt.shape.dim), tt.elem_type)
    return out


def _nbytes(shape: tuple[int, ...], elem_type: int) -> int:
    try:
        item = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    except Exception:  # an element type numpy has no dtype for: count 8 bytes, the widest
        item = 8
    n = 1
    for d in shape:
        n *= int(d)
    return n * item


def _describe(name: str, dims) -> str:
    return f"'{name}' ({'x'.join(str(int(d)) for d in dims) or 'scalar'})"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _fold_round(
    model: onnx.ModelProto, derived: set[str], notes: dict[str, str], limit: int
) -> bool:
    """One pass in graph order. `derived` names the Constant nodes earlier rounds folded (they
    depend only on shapes and small constants, whatever their size)."""
    g = model.graph
    known: dict[str, np.ndarray] = {}
    weights: dict[str, str] = {}
    """Constant-only tensors that depend on a weight -> that weight, described."""
    for t in g.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            weights[t.name] = _describe(t.name, t.dims)
        elif _small_constant(
            int(np.prod(t.dims, dtype=np.int64)), t.data_type == onnx.TensorProto.BOOL
        ):
            known[t.name] = numpy_helper.to_array(t)
        else:
            weights[t.name] = _describe(t.name, t.dims)
    types = _static_types(model)
    changed = False
    new_nodes = []
    for node in g.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            v = constant_node_value(node)
            if v is not None:
                if _small_constant(v.size, v.dtype == bool) or node.output[0] in derived:
                    known[node.output[0]] = v
                else:
                    weights[node.output[0]] = _describe(node.output[0], v.shape)
            new_nodes.append(node)
            continue
        folded = None
        if node.domain in ("", "ai.onnx") and node.op_type not in _NEVER_FOLD:
            folded = _fold_node(node, model, known, weights, types, notes, limit)
        if folded is not None:
            for name, v in zip(node.output, folded):
                known[name] = v
                derived.add(name)
                new_nodes.append(
                    helper.make_node(
                        "Constant",
                        [],
                        [name],
                        value=numpy_helper.from_array(v),
                        name=(node.name or name) + "_folded",
                    )
                )
            changed = True
        else:
            new_nodes.append(node)
    if changed:
        del g.node[:]
        g.node.extend(new_nodes)
    return changed


def _fold_node(
    node: onnx.NodeProto,
    model: onnx.ModelProto,
    known: dict[str, np.ndarray],
    weights: dict[str, str],
    types: dict[str, tuple[tuple[int, ...], int]],
    notes: dict[str, str],
    limit: int,
) -> list[np.ndarray] | None:
    """The node's folded outputs, or None (with a note when every input was a constant)."""
    op = node.op_type
    if op == "Shape" and node.input[0] in types:
        shp = np.array(types[node.input[0]][0], dtype=np.int64)
        start = next((a.i for a in node.attribute if a.name == "start"), 0)
        end = next((a.i for a in node.attribute if a.name == "end"), None)
        return [shp[start:end]]
    if op == "Size" and node.input[0] in types:
        return [np.array(int(np.prod(types[node.input[0]][0])), dtype=np.int64)]
    ins = list(node.input)
    if not ins or not all(i and (i in known or i in weights) for i in ins):
        return None
    first = node.output[0] if node.output else ""
    heavy = next((weights[i] for i in ins if i in weights), None)
    if heavy is not None:
        for o in node.output:
            weights[o] = heavy
        notes[first] = (
            f"not folded at load: computed from constants, but from the weight {heavy}; "
            "folding would copy or transform a weight"
        )
        return None
    expected = [types.get(o) for o in node.output]
    if all(t is not None for t in expected):
        size = sum(_nbytes(*t) for t in expected if t is not None)
        if size > limit:
            notes[first] = _over_budget(size, limit)
            return None
    folded = _evaluate(node, [known[i] for i in ins], model.opset_import)
    if folded is None:
        notes[first] = "not folded at load: onnx's reference evaluator could not compute it"
        return None
    size = sum(v.nbytes for v in folded)
    if size > limit:
        notes[first] = _over_budget(size, limit)
        return None
    return folded


def _over_budget(size: int, limit: int) -> str:
    return (
        f"not folded at load: its value depends only on shapes and small constants but takes "
        f"{_mib(size)}, over the fold budget of {_mib(limit)} (raise MLSO_MAX_FOLD_BYTES to fold it)"
    )


def _remove_dead(model: onnx.ModelProto) -> onnx.ModelProto:
    g = model.graph
    live = {o.name for o in g.output}
    keep = []
    for node in reversed(list(g.node)):
        if any(o in live for o in node.output) or not node.output:
            keep.append(node)
            live.update(i for i in node.input if i)
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(reversed(keep))
    return model
