"""List the MlsoKernel regions of a packaged model, for `verify`, `bench` and `inspect`.

Why a separate reader: those commands need each region's plan, binary, μGraph and fallback body
without knowing how the packager laid them out. With verify=True (the default) every node is
validated first (runtime/check.py), so a tampered model is refused with the node and the field;
`inspect` passes verify=False to describe a model even when it would be refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from mlso_cli.errors import InputError
from mlso_cli.runtime.check import check_node, is_mlso_node, tensor_bytes


@dataclass(frozen=True)
class RegionView:
    node_index: int
    node_name: str
    overload: str
    inputs: tuple[str, ...]
    """The variadic tensor inputs, in plan order."""
    outputs: tuple[str, ...]
    binary_name: str
    binary: bytes | None
    binary_sha256: str
    """As recorded in the node's attribute."""
    plan: dict[str, Any] | None
    """None only with verify=False when the plan does not parse."""
    ugraph_json: str
    source_sha256: str
    function: onnx.FunctionProto | None
    """The fallback body (the original region), or None when the model lacks it."""


def _attr(node: onnx.NodeProto, name: str) -> str:
    for a in node.attribute:
        if a.name == name and a.type == onnx.AttributeProto.STRING:
            return a.s.decode("utf-8", errors="replace")
    return ""


def fallback_function(model: onnx.ModelProto, node: onnx.NodeProto) -> onnx.FunctionProto | None:
    """The model-local function (matched by domain, name and overload) that is the node's body."""
    return next(
        (
            f
            for f in model.functions
            if f.domain == node.domain and f.name == node.op_type and f.overload == node.overload
        ),
        None,
    )


def regions_in(
    model: onnx.ModelProto, *, base_dir: Path | None = None, verify: bool = True
) -> list[RegionView]:
    """Every MlsoKernel node of the main graph, in node order."""
    initializers = {t.name: t for t in model.graph.initializer}
    views: list[RegionView] = []
    for i, node in enumerate(model.graph.node):
        if not is_mlso_node(node):
            continue
        function = fallback_function(model, node)
        if verify:
            c = check_node(model, i, base_dir=base_dir, initializers=initializers)
            views.append(
                RegionView(
                    node_index=i,
                    node_name=c.name,
                    overload=c.overload,
                    inputs=c.inputs,
                    outputs=c.outputs,
                    binary_name=c.binary_name,
                    binary=c.binary,
                    binary_sha256=c.binary_sha256,
                    plan=c.plan,
                    ugraph_json=c.ugraph_json,
                    source_sha256=c.source_sha256,
                    function=function,
                )
            )
            continue
        try:
            plan = json.loads(_attr(node, "plan"))
        # ValueError, not only JSONDecodeError: an integer of more than 4300 digits raises a
        # plain ValueError (int_max_str_digits); unparsable plans are described as None here
        except (ValueError, RecursionError):
            plan = None
        binary = None
        binary_name = node.input[0] if node.input else ""
        tensor = initializers.get(binary_name)
        if tensor is not None:
            try:
                binary = tensor_bytes(tensor, base_dir)
            except (InputError, OSError, ValueError):
                binary = None
        views.append(
            RegionView(
                node_index=i,
                node_name=node.name,
                overload=node.overload,
                inputs=tuple(node.input[1:]),
                outputs=tuple(node.output),
                binary_name=binary_name,
                binary=binary,
                binary_sha256=_attr(node, "binary_sha256"),
                plan=plan if isinstance(plan, dict) else None,
                ugraph_json=_attr(node, "ugraph"),
                source_sha256=_attr(node, "source_sha256"),
                function=function,
            )
        )
    return views
