"""Run an ONNX model in ONNX Runtime, and evaluate it exactly in float64 as the reference.

The fp64 reference is the original model with every floating-point tensor promoted to double
(inputs, initializers, Constant values, Cast targets), evaluated by onnx's numpy reference
evaluator. fp16 in ONNX Runtime is not a reference: it overflows at large scales and CPU and CUDA
disagree. Custom-domain nodes with a model-local function body (mlso's fallback) are inlined first.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.frontend.load import onnx_opset

_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}


def _promote_type(tt) -> None:
    if tt.elem_type in _FLOATS:
        tt.elem_type = TensorProto.DOUBLE


def _promote_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    if t.data_type not in _FLOATS:
        return t
    arr = numpy_helper.to_array(t).astype(np.float64)
    return numpy_helper.from_array(arr, t.name)


def _promote_graph(g: onnx.GraphProto) -> None:
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        _promote_type(vi.type.tensor_type)
    new_inits = [_promote_tensor(t) for t in g.initializer]
    del g.initializer[:]
    g.initializer.extend(new_inits)
    for n in g.node:
        if n.op_type == "ConstantOfShape" and not any(a.name == "value" for a in n.attribute):
            # its default value is a float32 zero: promoted like every other float constant
            # (deepseek's export fed it to a MatMul beside float64 values, and the evaluator
            # refused the pair)
            zero = numpy_helper.from_array(np.zeros(1, np.float64))
            n.attribute.append(onnx.helper.make_attribute("value", zero))
        for a in n.attribute:
            if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                a.t.CopyFrom(_promote_tensor(a.t))
            if n.op_type == "Cast" and a.name == "to" and a.i in _FLOATS:
                a.i = TensorProto.DOUBLE
            if a.name == "stash_type":
                # onnx's reference LayerNormalization accepts only stash_type 1 and computes in
                # X's dtype, double here: setting it to DOUBLE crashed every LayerNorm model
                a.i = TensorProto.FLOAT
            if a.type == onnx.AttributeProto.GRAPH:
                _promote_graph(a.g)


_FLATTENING = ("Softmax", "LogSoftmax", "Hardmax")


def _old_softmax_as_flatten(g: onnx.GraphProto, opset: int) -> None:
    """Before opset 13, Softmax/LogSoftmax/Hardmax flatten their input at `axis` (default 1) and
    normalise over all trailing dims. onnx's reference evaluator applies the opset-13 rule to
    every opset (ONNX Runtime does not), so the reference is rewritten as Flatten -> op over the
    last axis -> Reshape back, which means the same in every opset."""
    for a in (a for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH):
        _old_softmax_as_flatten(a.g, opset)
    if opset >= 13:
        return
    nodes = []
    for k, n in enumerate(g.node):
        if n.op_type not in _FLATTENING or n.domain not in ("", "ai.onnx"):
            nodes.append(n)
            continue
        axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
        x, y, tag = n.input[0], n.output[0], f"mlso_ref_{k}_{n.op_type.lower()}"
        nodes += [
            helper.make_node("Shape", [x], [tag + "_shape"]),
            helper.make_node("Flatten", [x], [tag + "_flat"], axis=axis),
            helper.make_node(n.op_type, [tag + "_flat"], [tag + "_out"], axis=1),
            helper.make_node("Reshape", [tag + "_out", tag + "_shape"], [y]),
        ]
    del g.node[:]
    g.node.extend(nodes)


def promote_to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model computing in float64 (functions inlined, value_info dropped)."""
    from onnx import inliner

    m = onnx.ModelProto()
    m.CopyFrom(model)
    if m.functions:
        m = inliner.inline_local_functions(m)
    del m.graph.value_info[:]
    _promote_graph(m.graph)
    _old_softmax_as_flatten(m.graph, onnx_opset(m))
    return m


class Reference:
    """The fp64 reference of one model, promoted once and evaluated for any number of feeds
    (verify runs it for every sample at every input scale).

    Its floating-point weights are fed as float64 arrays, not promoted inside the proto. Why:
    promoting a weight in the proto serializes it again as float64 (a Llama-1B-width layer:
    500 MB of doubles), and the evaluator then parses it back: most of a check's time at real
    widths went there (39 of 41 s for a 2-layer export), once per sample."""

    def __init__(self, model: onnx.ModelProto) -> None:
        from onnx import inliner
        from onnx.reference import ReferenceEvaluator

        from mlso_cli.package.regionmodel import initializers_as_inputs

        m, weights = initializers_as_inputs(
            model, lambda t: t.data_type in _FLOATS, TensorProto.DOUBLE
        )
        self._weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in weights}
        if m.functions:
            m = inliner.inline_local_functions(m)
        m64 = promote_to_float64(m)
        self._names = [o.name for o in m64.graph.output]
        self._ev = ReferenceEvaluator(m64)

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds64 = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
        outs = self._ev.run(None, {**self._weights, **feeds64})
        return {n: np.asarray(o, dtype=np.float64) for n, o in zip(self._names, outs)}


def reference_outputs(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The fp64 reference's outputs for one set of feeds (`Reference` for several)."""
    return Reference(model)(feeds)


def input_specs(model: onnx.ModelProto) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    inits = {t.name for t in model.graph.initializer}
    out = []
    for i in model.graph.input:
        if i.name in inits:
            continue
        tt = i.type.tensor_type
        shape = tuple(d.dim_value for d in tt.shape.dim)
        out.append((i.name, shape, helper.tensor_dtype_to_np_dtype(tt.elem_type)))
    return out
