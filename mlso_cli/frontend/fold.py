"""Fold shape arithmetic into constants once the input shapes are fixed.

Exporters with dynamic axes compute Reshape targets at run time (Shape -> Gather -> Concat).
With static input shapes those chains are constant; folding them turns each Reshape into a
static view that lifting can use. Only small tensors are folded, so weights are never copied.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

MAX_FOLD_ELEMENTS = 4096
"""Outputs larger than this stay as nodes: folding is for shape arithmetic, not weights."""

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


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    g = model.graph
    out = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            out[vi.name] = tuple(d.dim_value for d in tt.shape.dim)
    return out


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


def fold_constants(
    model: onnx.ModelProto, base_dir: Path | None = None, max_rounds: int = 6
) -> onnx.ModelProto:
    """Replace nodes whose inputs are all known constants by Constant nodes; drop dead nodes."""
    for _ in range(max_rounds):
        changed = _fold_round(model)
        if not changed:
            break
        model = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    return _remove_dead(model)


def _fold_round(model: onnx.ModelProto) -> bool:
    g = model.graph
    known: dict[str, np.ndarray] = {}
    for t in g.initializer:
        if (
            t.data_location != onnx.TensorProto.EXTERNAL
            and np.prod(t.dims, dtype=np.int64) <= MAX_FOLD_ELEMENTS
        ):
            known[t.name] = numpy_helper.to_array(t)
    shapes = _static_shapes(model)
    changed = False
    new_nodes = []
    for node in g.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            v = constant_node_value(node)
            if v is not None:
                known[node.output[0]] = v
            new_nodes.append(node)
            continue
        folded = None
        if node.domain in ("", "ai.onnx") and node.op_type not in _NEVER_FOLD:
            if node.op_type == "Shape" and node.input[0] in shapes:
                shp = np.array(shapes[node.input[0]], dtype=np.int64)
                start = next((a.i for a in node.attribute if a.name == "start"), 0)
                end = next((a.i for a in node.attribute if a.name == "end"), None)
                folded = [shp[start:end]]
            elif node.op_type == "Size" and node.input[0] in shapes:
                folded = [np.array(int(np.prod(shapes[node.input[0]])), dtype=np.int64)]
            elif node.input and all((not i) or i in known for i in node.input):
                vals = [known[i] for i in node.input if i]
                if len(vals) == len([i for i in node.input]):
                    folded = _evaluate(node, vals, model.opset_import)
        if folded is not None and all(v.size <= MAX_FOLD_ELEMENTS for v in folded):
            for name, v in zip(node.output, folded):
                known[name] = v
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
