"""A region of a packaged model as a standalone ONNX model: its fallback body, or its MlsoKernel node.

Why here, beside the fallback-body reader (unpack.py): verify's field and lifting checks, the
bench harness and optimize's checks before writing all cut regions out of a packaged model the
same way. It is model surgery on the packager's own layout, so it belongs to package/, and
verify/ and bench/ both import it from here (never verify from bench).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from mlso_cli.frontend.fold import SMALL_CONSTANT_ELEMENTS
from mlso_cli.frontend.inference import copy_except
from mlso_cli.package.unpack import fallback_function


def initializers_as_inputs(
    model: onnx.ModelProto,
    moved: Callable[[onnx.TensorProto], bool],
    elem_type: int | None = None,
) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """A copy of `model` in which each main-graph initializer that `moved` picks is a graph input
    of its shape (and of `elem_type`, else its own type) instead, and those initializers (the
    caller's own, not copies). Why: the checks at real widths need the graph without its weights
    (shape inference serializes what it is given; the fp64 reference feeds them as arrays), and
    copying the model first copied every weight (900 MB at Mistral width) only to drop it."""
    g = model.graph
    picked = [t for t in g.initializer if moved(t)]
    gone = {t.name for t in picked}
    light = onnx.ModelProto()
    copy_except(model, light, "graph")
    copy_except(g, light.graph, "initializer")
    light.graph.initializer.extend(t for t in g.initializer if t.name not in gone)
    declared = {i.name for i in g.input}
    light.graph.input.extend(
        helper.make_tensor_value_info(
            t.name, t.data_type if elem_type is None else elem_type, list(t.dims)
        )
        for t in picked
        if t.name not in declared
    )
    return light, picked


def value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Every typed tensor of `model` (inputs, inferred intermediates, outputs), by name."""
    # the weights as typed inputs: no inferred shape depends on their values (a 2-layer
    # Llama-1B-width export spent 17 s of its checks serializing them for shape inference)
    light, _ = initializers_as_inputs(
        model, lambda t: int(np.prod(t.dims)) > SMALL_CONSTANT_ELEMENTS
    )
    inferred = onnx.shape_inference.infer_shapes(light)
    return {
        vi.name: vi
        for vi in list(inferred.graph.input)
        + list(inferred.graph.value_info)
        + list(inferred.graph.output)
    }


def standalone(
    model: onnx.ModelProto,
    node: onnx.NodeProto,
    body: list[onnx.NodeProto],
    name: str,
    infos: dict[str, onnx.ValueInfoProto] | None,
    **extra,
) -> onnx.ModelProto:
    """A model of `body` with `node`'s inputs (those the body reads: graph inputs, or the
    initializers they are in `model`) and `node`'s outputs."""
    infos = infos if infos is not None else value_infos(model)
    inits = {t.name: t for t in model.graph.initializer}
    used = {x for n in body for x in n.input}
    graph_inputs, graph_inits = [], []
    for x in node.input:
        if x not in used:
            continue
        if x in inits:
            graph_inits.append(inits[x])
        elif x in infos:
            graph_inputs.append(infos[x])
    outputs = [infos[o] for o in node.output if o in infos]
    g = helper.make_graph(body, name, graph_inputs, outputs, graph_inits)
    m = helper.make_model(g, **extra)
    m.ir_version = model.ir_version
    return m


def region_model(
    model: onnx.ModelProto,
    node: onnx.NodeProto,
    infos: dict[str, onnx.ValueInfoProto] | None = None,
) -> onnx.ModelProto:
    """A standalone model computing one MlsoKernel node's fallback body (the original region).
    `infos`: `model`'s value infos, when the caller has them (shape inference is per model)."""
    fn = fallback_function(model, node)
    if fn is None:
        raise ValueError(f"no function body for node {node.name}")
    rename = dict(zip(fn.input, node.input))
    rename.update(zip(fn.output, node.output))
    # every other tensor the body defines gets a name of its own: an internal tensor named like
    # one of the node's actual inputs would otherwise be read in their place once the formals
    # are renamed (and verify's field check would compare the μGraph with the wrong body)
    formals = set(fn.input) | set(fn.output)
    for n in fn.node:
        for x in n.output:
            if x and x not in formals:
                rename[x] = f"{node.name}__body__{x}"
    body = []
    for n in fn.node:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.input[:] = [rename.get(x, x) for x in n.input]
        c.output[:] = [rename.get(x, x) for x in n.output]
        body.append(c)
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return standalone(model, node, body, f"region_{node.name}", infos, opset_imports=opsets)


def kernel_model(
    model: onnx.ModelProto,
    node: onnx.NodeProto,
    infos: dict[str, onnx.ValueInfoProto] | None = None,
) -> onnx.ModelProto:
    """A standalone model of one MlsoKernel node as packaged (attributes, binary, and the
    function its fallback names): what the region costs when ONNX Runtime runs mlso's op."""
    c = onnx.NodeProto()
    c.CopyFrom(node)
    return standalone(
        model,
        node,
        [c],
        f"kernel_{node.name}",
        infos,
        opset_imports=list(model.opset_import),
        functions=list(model.functions),
    )
