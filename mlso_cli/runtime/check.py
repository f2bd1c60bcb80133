"""Python-side validation of `ai.mlso::MlsoKernel` nodes, before anything is loaded or launched.

Why: an optimized model carries executable GPU code. Before the session helper registers the
library (and before `mlso verify` or `bench` trust a node) every node must have a well-formed
plan that matches its own inputs and outputs, and a binary whose SHA-256 equals the hash
recorded next to its source and μGraph. The C++ op repeats the plan and hash checks at kernel
creation; this module gives the same verdict earlier, on any machine, with the node's name.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, numpy_helper

from mlso_cli.errors import InputError
from mlso_cli.runtime.plan import PlanProblem, parse_plan

MLSO_DOMAIN = "ai.mlso"
MLSO_OP = "MlsoKernel"
ATTRIBUTES = ("plan", "binary_sha256", "ugraph", "source_sha256")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FIX = "Re-run `mlso optimize` on the original model; do not edit MlsoKernel nodes by hand"


@dataclass(frozen=True)
class CheckedNode:
    """One validated MlsoKernel node, with its parsed plan and its binary."""

    node_index: int
    node: onnx.NodeProto
    name: str
    overload: str
    inputs: tuple[str, ...]
    """The variadic tensor inputs (node.input[1:])."""
    outputs: tuple[str, ...]
    binary_name: str
    binary: bytes
    binary_sha256: str
    plan: dict[str, Any]
    plan_text: str
    ugraph_json: str
    source_sha256: str


def is_mlso_node(node: onnx.NodeProto) -> bool:
    return node.domain == MLSO_DOMAIN and node.op_type == MLSO_OP


def _label(node: onnx.NodeProto, index: int) -> str:
    return (
        f"MlsoKernel node '{node.name}' (node {index})" if node.name else f"MlsoKernel node {index}"
    )


def _tampered(label: str, what: str) -> InputError:
    return InputError(
        f"{label}: {what}; the model was changed after mlso wrote it (tampered?)", _FIX
    )


def tensor_bytes(tensor: onnx.TensorProto, base_dir: Path | None) -> bytes:
    """Raw little-endian bytes of a tensor, reading external data relative to base_dir."""
    if tensor.data_location == TensorProto.EXTERNAL:
        if base_dir is None:
            raise InputError(
                f"initializer '{tensor.name}' is stored in an external file, and no folder was given to read it from",
                "Open the model from its path, not from bytes",
            )
        return numpy_helper.to_array(tensor, str(base_dir)).tobytes()
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


def _string_attr(node: onnx.NodeProto, name: str, label: str) -> str:
    for a in node.attribute:
        if a.name == name:
            if a.type != onnx.AttributeProto.STRING:
                raise _tampered(label, f"attribute '{name}' is not a string")
            try:
                return a.s.decode("utf-8")
            except UnicodeDecodeError:
                raise _tampered(label, f"attribute '{name}' is not UTF-8 text") from None
    raise _tampered(label, f"attribute '{name}' is missing")


def check_node(
    model: onnx.ModelProto,
    index: int,
    *,
    base_dir: Path | None = None,
    initializers: dict[str, onnx.TensorProto] | None = None,
) -> CheckedNode:
    """Validate model.graph.node[index]; raise InputError naming the node and the field."""
    node = model.graph.node[index]
    label = _label(node, index)
    if not is_mlso_node(node):
        raise InputError(
            f"{label} is {node.domain or 'ai.onnx'}::{node.op_type}, not {MLSO_DOMAIN}::{MLSO_OP}"
        )
    attrs = {name: _string_attr(node, name, label) for name in ATTRIBUTES}
    if len(node.input) < 2 or any(not name for name in node.input):
        raise _tampered(
            label, "it needs the kernel binary and at least one tensor input, all named"
        )
    if len(node.output) < 1 or any(not name for name in node.output):
        raise _tampered(label, "it needs at least one named output")
    try:
        plan = parse_plan(attrs["plan"], len(node.input) - 1, len(node.output))
    except PlanProblem as e:
        raise _tampered(label, f"attribute 'plan' {e}") from None
    try:
        json.loads(attrs["ugraph"])
    except (json.JSONDecodeError, RecursionError) as e:
        raise _tampered(label, f"attribute 'ugraph' is not valid JSON ({e})") from None
    recorded = attrs["binary_sha256"].lower()
    if not _HEX64.match(recorded):
        raise _tampered(label, "attribute 'binary_sha256' is not 64 hex digits")
    if not _HEX64.match(attrs["source_sha256"].lower()):
        raise _tampered(label, "attribute 'source_sha256' is not 64 hex digits")

    if initializers is None:
        initializers = {t.name: t for t in model.graph.initializer}
    binary_name = node.input[0]
    tensor = initializers.get(binary_name)
    if tensor is None:
        raise _tampered(label, f"input 0 '{binary_name}' (the kernel binary) is not an initializer")
    if tensor.data_type != TensorProto.UINT8 or len(tensor.dims) != 1:
        raise _tampered(label, f"the kernel binary '{binary_name}' is not a 1-D uint8 tensor")
    binary = tensor_bytes(tensor, base_dir)
    if not binary:
        raise _tampered(label, f"the kernel binary '{binary_name}' is empty")
    actual = hashlib.sha256(binary).hexdigest()
    if actual != recorded:
        raise _tampered(
            label,
            f"the kernel binary '{binary_name}' does not match attribute binary_sha256 "
            f"(recorded {recorded[:16]}…, binary hashes to {actual[:16]}…)",
        )
    return CheckedNode(
        node_index=index,
        node=node,
        name=node.name,
        overload=node.overload,
        inputs=tuple(node.input[1:]),
        outputs=tuple(node.output),
        binary_name=binary_name,
        binary=binary,
        binary_sha256=actual,
        plan=plan,
        plan_text=attrs["plan"],
        ugraph_json=attrs["ugraph"],
        source_sha256=attrs["source_sha256"].lower(),
    )


def check_model(model: onnx.ModelProto, *, base_dir: Path | None = None) -> list[CheckedNode]:
    """Validate every MlsoKernel node of the main graph, in node order."""
    initializers = {t.name: t for t in model.graph.initializer}
    return [
        check_node(model, i, base_dir=base_dir, initializers=initializers)
        for i, node in enumerate(model.graph.node)
        if is_mlso_node(node)
    ]
