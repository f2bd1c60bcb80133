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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, numpy_helper

from mlso_cli.errors import InputError
from mlso_cli.runtime.plan import DTYPE_OF_ONNX, DeclaredType, PlanProblem, parse_plan

MLSO_DOMAIN = "ai.mlso"
MLSO_OP = "MlsoKernel"
ATTRIBUTES = ("plan", "binary_sha256", "ugraph", "source_sha256")
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")  # \Z: $ would also take a final newline
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
    graph_path: str = ""
    """Where the node is: "" for the main graph, else e.g. "If 'cond' then_branch" (subgraphs)."""


def is_mlso_node(node: onnx.NodeProto) -> bool:
    return node.domain == MLSO_DOMAIN and node.op_type == MLSO_OP


def _label(node: onnx.NodeProto, index: int, graph_path: str = "") -> str:
    where = f"node {index}" + (f" of {graph_path}" if graph_path else "")
    return f"MlsoKernel node '{node.name}' ({where})" if node.name else f"MlsoKernel {where}"


def _declared(value_type: onnx.TypeProto) -> DeclaredType:
    """An ONNX type as the plan validator compares it. A non-tensor or a dtype plans never use
    gets a name no plan dtype equals, so the comparison fails."""
    if value_type.WhichOneof("value") != "tensor_type":
        return ("not-a-tensor", None)
    tt = value_type.tensor_type
    dtype = DTYPE_OF_ONNX.get(tt.elem_type, f"onnx-dtype-{tt.elem_type}") if tt.elem_type else None
    if not tt.HasField("shape"):
        return (dtype, None)
    return (dtype, [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim])


def graph_types(
    graph: onnx.GraphProto, outer: dict[str, DeclaredType] | None = None
) -> dict[str, DeclaredType]:
    """Declared types of every value a graph names (inputs, outputs, value_info, initializers),
    over those of the enclosing graphs."""
    types = dict(outer or {})
    for t in graph.initializer:
        dtype = DTYPE_OF_ONNX.get(t.data_type, f"onnx-dtype-{t.data_type}")
        types[t.name] = (dtype, list(t.dims))
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.WhichOneof("value") is not None:
            types[vi.name] = _declared(vi.type)
    return types


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
    types: dict[str, DeclaredType] | None = None,
) -> CheckedNode:
    """Validate model.graph.node[index]; raise InputError naming the node and the field."""
    if initializers is None:
        initializers = {t.name: t for t in model.graph.initializer}
    if types is None:
        types = graph_types(model.graph)
    return check_one(model.graph.node[index], index, "", initializers, types, base_dir)


def check_one(
    node: onnx.NodeProto,
    index: int,
    graph_path: str,
    initializers: dict[str, onnx.TensorProto],
    types: dict[str, DeclaredType],
    base_dir: Path | None,
) -> CheckedNode:
    """Validate one MlsoKernel node of any graph, given what that graph can see (the values of
    iter_mlso_nodes); raise InputError naming the node and the field."""
    label = _label(node, index, graph_path)
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
    missing = [name for name in node.output if name not in types]
    if missing:
        raise _tampered(label, f"output '{missing[0]}' has no declared type (value_info)")
    try:
        plan = parse_plan(
            attrs["plan"],
            len(node.input) - 1,
            len(node.output),
            declared_inputs=[types.get(name) for name in node.input[1:]],
            declared_outputs=[types[name] for name in node.output],
        )
    except PlanProblem as e:
        raise _tampered(label, f"attribute 'plan' {e}") from None
    try:
        ugraph = json.loads(attrs["ugraph"])
    # ValueError, not only JSONDecodeError: an integer of more than 4300 digits raises a plain
    # ValueError (int_max_str_digits), which would escape as a traceback, not a refusal.
    except (ValueError, RecursionError) as e:
        raise _tampered(label, f"attribute 'ugraph' is not valid JSON ({e})") from None
    # the μGraph names the tensors it reads and writes; they must be the node's, in order, or
    # every check that aligns the μGraph with the fallback body by name checks the wrong thing
    # (a μGraph without the keys is not one serialize.loads reads: verify refuses it there)
    named = ugraph if isinstance(ugraph, dict) else {}
    if "input_names" in named and named["input_names"] != list(node.input[1:]):
        raise _tampered(
            label,
            f"its μGraph reads {named['input_names']!r} but the node gives it "
            f"{list(node.input[1:])!r}",
        )
    if "output_names" in named and named["output_names"] != list(node.output):
        raise _tampered(
            label,
            f"its μGraph writes {named['output_names']!r} but the node's outputs are "
            f"{list(node.output)!r}",
        )
    recorded = attrs["binary_sha256"].lower()
    if not _HEX64.match(recorded):
        raise _tampered(label, "attribute 'binary_sha256' is not 64 hex digits")
    if not _HEX64.match(attrs["source_sha256"].lower()):
        raise _tampered(label, "attribute 'source_sha256' is not 64 hex digits")

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
        graph_path=graph_path,
    )


def _subgraphs(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.name, a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            for k, g in enumerate(a.graphs):
                yield f"{a.name}[{k}]", g


def iter_mlso_nodes(
    model: onnx.ModelProto,
) -> Iterator[
    tuple[str, int, onnx.NodeProto, dict[str, onnx.TensorProto], dict[str, DeclaredType]]
]:
    """Every MlsoKernel node, in the main graph and in subgraphs (If/Loop/Scan bodies), as
    (graph path, index in its graph, node, visible initializers, visible declared types).

    Why subgraphs: the packager never writes kernels there, but ONNX Runtime runs a hostile
    model's If branch as readily as its main graph, so checks must see them too."""
    stack: list[tuple[str, onnx.GraphProto, dict, dict]] = [("", model.graph, {}, {})]
    while stack:
        path, graph, outer_init, outer_types = stack.pop(0)
        inits = {**outer_init, **{t.name: t for t in graph.initializer}}
        types = graph_types(graph, outer_types)
        for i, node in enumerate(graph.node):
            if is_mlso_node(node):
                yield path, i, node, inits, types
            for attr, sub in _subgraphs(node):
                where = f"{node.op_type} '{node.name or i}' {attr}"
                stack.append((f"{path} > {where}" if path else where, sub, inits, types))


def check_model(
    model: onnx.ModelProto, *, base_dir: Path | None = None, subgraphs: bool = False
) -> list[CheckedNode]:
    """Validate every MlsoKernel node of the main graph (and of every subgraph with
    subgraphs=True), in order; raise InputError on the first bad one."""
    return [
        check_one(node, i, path, inits, types, base_dir)
        for path, i, node, inits, types in iter_mlso_nodes(model)
        if subgraphs or not path
    ]
