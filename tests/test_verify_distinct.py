"""The check before writing checks each distinct kernel once (verify/packaged.py,
`_representatives`): distinct up to value names, so that a decoder's layers, the same region
under other tensor names, share one check, while any difference that changes what is computed,
or which μGraph input meets which body input, keeps kernels apart."""

from __future__ import annotations

import json
from types import SimpleNamespace

import onnx
from onnx import TensorProto, helper

from mlso_cli.verify import packaged

UGRAPH = {"input_names": [], "nodes": [{"op": "input"}], "output_names": [], "schema": 1}


def _body(layer: int, to: int = TensorProto.FLOAT, eps: float = 1e-5) -> onnx.FunctionProto:
    """x -> Cast -> Add(eps) -> Mul(w): a norm-like body named after its layer, as an exporter
    names them (value names, node names, doc strings and metadata all carry the layer)."""
    p = f"model.layers.{layer}"
    nodes = [
        helper.make_node(
            "Constant", [], [f"{p}.eps"], value=helper.make_tensor(f"{p}.eps_t", to, [], [eps])
        ),
        helper.make_node("Cast", [f"{p}.x"], [f"{p}.xc"], to=to, name=f"{p}/cast"),
        helper.make_node("Add", [f"{p}.xc", f"{p}.eps"], [f"{p}.s"], name=f"{p}/add"),
        helper.make_node("Mul", [f"{p}.s", f"{p}.weight"], [f"{p}.y"], name=f"{p}/mul"),
    ]
    for n in nodes:
        n.doc_string = f"layer {layer}"
        if hasattr(n, "metadata_props"):
            n.metadata_props.add(key="namespace", value=f"{p}: DecoderLayer")
    fn = helper.make_function(
        "ai.mlso", "MlsoKernel", [f"{p}.x", f"{p}.weight"], [f"{p}.y"], nodes,
        [helper.make_opsetid("", 17)],
    )  # fmt: skip
    fn.overload = f"r{layer}"
    fn.doc_string = f"mlso region r{layer}"
    return fn


def _ugraph(layer: int, order: tuple[int, int] = (0, 1)) -> str:
    names = [f"model.layers.{layer}.x", f"model.layers.{layer}.weight"]
    return json.dumps(
        {
            **UGRAPH,
            "input_names": [names[i] for i in order],
            "output_names": [f"model.layers.{layer}.y"],
        }
    )


def test_layers_that_differ_only_in_names_share_a_key():
    assert packaged._canonical_key(_ugraph(0), _body(0)) == packaged._canonical_key(
        _ugraph(7), _body(7)
    )


def test_what_is_computed_or_how_inputs_pair_keeps_kernels_apart():
    base = packaged._canonical_key(_ugraph(0), _body(0))
    assert packaged._canonical_key(_ugraph(1), _body(1, eps=1e-6)) != base  # another constant
    assert packaged._canonical_key(_ugraph(1), _body(1, to=TensorProto.FLOAT16)) != base
    # the same body, its μGraph reading the inputs the other way round
    assert packaged._canonical_key(_ugraph(1, order=(1, 0)), _body(1)) != base
    assert packaged._canonical_key(_ugraph(1), None) != base


def test_representatives_map_each_layer_to_the_first(monkeypatch):
    bodies = {f"n{i}": _body(5 * (i % 2), eps=1e-5 if i < 4 else 1e-6) for i in range(5)}
    monkeypatch.setattr(
        "mlso_cli.package.unpack.fallback_function", lambda model, node: bodies[node.name]
    )
    kernels = [
        SimpleNamespace(
            node=SimpleNamespace(name=f"n{i}"),
            node_index=10 + i,
            ugraph_json=_ugraph(5 * (i % 2)),
        )
        for i in range(5)
    ]
    reps, of = packaged._representatives(onnx.ModelProto(), kernels)
    # n0..n3 alternate layer 0 and layer 5 names with one body: one check; n4 another constant
    assert [r.node_index for r in reps] == [10, 14]
    assert of == {10: 10, 11: 10, 12: 10, 13: 10, 14: 14}
