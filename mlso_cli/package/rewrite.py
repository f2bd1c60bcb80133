"""Replace each optimized region by one `ai.mlso::MlsoKernel` node that still runs anywhere.

Why the shape of the output (docs/architecture.md, pipeline step 7 and "Runtime"):
- Each node carries a model-local function whose body is the original region, so stock ONNX
  Runtime (no mlso library registered) runs the original computation. Regions differ, so each
  gets its own overload of ai.mlso::MlsoKernel (ONNX IR >= 10: FunctionProto.overload and
  NodeProto.overload, "r0", "r1", ...). ONNX Runtime 1.31 resolves overloads; the tests prove it.
- Input 0 is the kernel binary: one uint8 initializer per distinct binary
  (`mlso_bin_<sha256[:16]>`), shared by every node that uses it. The function declares it as an
  input that its body does not read.
- Every MlsoKernel output gets a value_info with the plan's dtype and shape: with the library
  registered, ONNX Runtime cannot infer the dtypes of a heterogeneous variadic output and refuses
  the model ("type inference failed") unless the graph states them.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import TensorProto, helper

from mlso_cli import __version__
from mlso_cli.errors import InputError
from mlso_cli.package.irversion import output_ir_version
from mlso_cli.package.shapes import META_INPUT_SHAPES, input_shapes_json
from mlso_cli.runtime.check import MLSO_DOMAIN, MLSO_OP, check_node, is_mlso_node
from mlso_cli.runtime.plan import DTYPE_OF_ONNX, ONNX_DTYPE, PlanProblem, plan_json, validate_plan

MLSO_OPSET = 1
BINARY_PREFIX = "mlso_bin_"
META_VERSION = "mlso.version"
META_TARGETS = "mlso.targets"
META_SEED = "mlso.seed"
META_BOUND = "mlso.verification_bound"
META_EXECUTABLE = "mlso.executable_code"
META_SERVE = "mlso.serve"
"""How `optimize` was told the model will be served ("cuda-graph" or "plain"): the never-slower
rule decided in that mode, so the model is only known not to be slower in it."""
META_MODEL_CHECK = "mlso.model_check"
"""With `optimize --gpu`: the whole-model check's verdict, one sentence (absent when none ran)."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_BUG_FIX = "This is a bug in mlso's pipeline; please report it with the model"


@dataclass(frozen=True)
class PackagedRegion:
    """One optimized region, as the pipeline hands it to the packager."""

    node_indices: Sequence[int]
    """Indices into model.graph.node of the region's nodes, topologically sorted."""
    inputs: Sequence[str]
    """Tensors the region reads, in order: the node's variadic inputs and the plan's inputs."""
    outputs: Sequence[str]
    """Tensors it produces for the rest of the graph, in order."""
    binary: bytes
    plan: dict[str, Any]
    ugraph_json: str
    source_sha256: str
    region_id: int | None = None
    """The pipeline's region id: the node is then named mlso_region_<id> (overload r<id>), so
    optimize's table, the model and verify's report name a region alike. None: numbered in
    order, skipping names and overloads the model already holds."""

    def __post_init__(self) -> None:
        for name in ("node_indices", "inputs", "outputs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


def standard_metadata(
    *,
    targets: Iterable[str],
    seed: int | str,
    verification_bound: float | str,
    version: str = __version__,
) -> dict[str, str]:
    """The metadata_props every mlso model carries (the packager adds mlso.executable_code)."""
    return {
        META_VERSION: str(version),
        META_TARGETS: ",".join(targets),
        META_SEED: str(seed),
        META_BOUND: str(verification_bound),
    }


# ---- graph facts ------------------------------------------------------------------------------


def _subgraph_refs(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from its enclosing scopes."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    refs: set[str] = set()
    for node in graph.node:
        refs |= {n for n in _reads(node) if n not in defined}
        defined |= {o for o in node.output if o}
    refs |= {o.name for o in graph.output if o.name not in defined}
    return refs


def _reads(node: onnx.NodeProto) -> list[str]:
    """Every tensor a node reads, including those its subgraphs take from the outer scope."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            names.extend(sorted(_subgraph_refs(attr.g)))
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for g in attr.graphs:
                names.extend(sorted(_subgraph_refs(g)))
    return names


def _known_types(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | None] | None]]:
    """name -> (elem_type, dims or None) from graph inputs, outputs, value_info, initializers."""
    out: dict[str, tuple[int, list[int | None] | None]] = {}
    g = model.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        dims = None
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        out[vi.name] = (tt.elem_type, dims)
    for t in g.initializer:
        out[t.name] = (t.data_type, list(t.dims))
    return out


def _compatible(known: tuple[int, list[int | None] | None], spec: dict[str, Any]) -> str | None:
    elem, dims = known
    want = ONNX_DTYPE[spec["dtype"]]
    if elem and elem != want:
        return f"dtype {DTYPE_OF_ONNX.get(elem, f'onnx type {elem}')} in the model, {spec['dtype']} in the plan"
    if dims is not None:
        shape = spec["shape"]
        if len(dims) != len(shape) or any(
            d is not None and d != s for d, s in zip(dims, shape, strict=False)
        ):
            shown = ["?" if d is None else d for d in dims]
            return f"shape {shown} in the model, {shape} in the plan"
    return None


def unique_name(base: str, taken: set[str]) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first name not in `taken`, which it joins."""
    name, k = base, 1
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name


def _toposort(nodes: list[onnx.NodeProto], what: str) -> list[onnx.NodeProto]:
    """Kahn's algorithm, preferring the given order, so unchanged parts keep their order."""
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = i
    deps = [
        {producer[r] for r in _reads(n) if r in producer and producer[r] != i}
        for i, n in enumerate(nodes)
    ]
    users: list[list[int]] = [[] for _ in nodes]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    waiting = [len(ds) for ds in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        stuck = [nodes[i].name or nodes[i].op_type for i in range(len(nodes)) if waiting[i] > 0][:4]
        raise InputError(
            f"{what}: the rewritten graph has a cycle through {', '.join(stuck)}; a region is not "
            "convex (a node outside it both reads one of its outputs and feeds one of its inputs)",
            _BUG_FIX,
        )
    return [nodes[i] for i in order]


# ---- one region -------------------------------------------------------------------------------


@dataclass
class _Built:
    node: onnx.NodeProto
    function: onnx.FunctionProto
    position: int
    internal: set[str]


def _check_region(
    model: onnx.ModelProto, k: int, region: PackagedRegion, claimed: dict[int, int]
) -> set[str]:
    """Validate a region against the graph; return its internal tensor names."""
    nodes = model.graph.node
    label = f"region r{k}"
    if not region.node_indices:
        raise InputError(f"{label} has no nodes", _BUG_FIX)
    if not region.inputs or not region.outputs:
        raise InputError(f"{label} needs at least one input and one output", _BUG_FIX)
    for names, what in ((region.inputs, "inputs"), (region.outputs, "outputs")):
        if len(set(names)) != len(names) or any(not n for n in names):
            raise InputError(f"{label}: its {what} must be distinct non-empty names", _BUG_FIX)
    for i in region.node_indices:
        if not 0 <= i < len(nodes):
            raise InputError(
                f"{label}: node index {i} is out of range (the graph has {len(nodes)} nodes)",
                _BUG_FIX,
            )
        if i in claimed:
            raise InputError(f"{label}: node {i} is also in region r{claimed[i]}", _BUG_FIX)
        if is_mlso_node(nodes[i]):
            raise InputError(f"{label}: node {i} is already an MlsoKernel", _BUG_FIX)
        claimed[i] = k
    if not region.binary:
        raise InputError(f"{label}: the kernel binary is empty", _BUG_FIX)
    if not _HEX64.match(region.source_sha256):
        raise InputError(f"{label}: source_sha256 is not 64 lower-case hex digits", _BUG_FIX)
    try:
        json.loads(region.ugraph_json)
    except (json.JSONDecodeError, RecursionError, TypeError) as e:
        raise InputError(f"{label}: ugraph_json is not valid JSON ({e})", _BUG_FIX) from None
    try:
        validate_plan(region.plan, len(region.inputs), len(region.outputs))
    except PlanProblem as e:
        raise InputError(f"{label}: its plan {e}", _BUG_FIX) from None

    available = set(region.inputs)
    produced: set[str] = set()
    made_inside = {o for j in region.node_indices for o in nodes[j].output if o}
    for i in region.node_indices:
        node = nodes[i]
        for name in _reads(node):
            if name not in available:
                where = (
                    "before it is produced (node_indices are not topologically sorted)"
                    if name in made_inside
                    else "which is not one of the region's inputs"
                )
                raise InputError(
                    f"{label}: node {i} ({node.op_type}) reads '{name}' {where}", _BUG_FIX
                )
        for o in node.output:
            if o:
                available.add(o)
                produced.add(o)
    missing = [o for o in region.outputs if o not in produced]
    if missing:
        raise InputError(f"{label}: outputs {missing} are not produced by its nodes", _BUG_FIX)
    internal = produced - set(region.outputs)
    members = set(region.node_indices)
    used_outside = {n for j, node in enumerate(nodes) if j not in members for n in _reads(node)}
    used_outside |= {o.name for o in model.graph.output}
    escaping = sorted(internal & used_outside)
    if escaping:
        raise InputError(
            f"{label}: tensors {escaping} are used outside the region but are not among its outputs",
            _BUG_FIX,
        )
    return internal


def _function_opsets(
    model: onnx.ModelProto, body: Iterable[onnx.NodeProto]
) -> list[onnx.OperatorSetIdProto]:
    versions = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    wanted = {"": versions.get("", 0)} if "" in versions else {}
    for node in body:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain in versions:
            wanted[domain] = versions[domain]
    wanted[MLSO_DOMAIN] = MLSO_OPSET
    return [helper.make_opsetid(d, v) for d, v in sorted(wanted.items())]


def _build(
    model: onnx.ModelProto,
    k: int,
    region: PackagedRegion,
    internal: set[str],
    overload: str,
    node_name: str,
    binary_name: str,
    binary_sha: str,
) -> _Built:
    nodes = model.graph.node
    body = [nodes[i] for i in region.node_indices]
    body_names = set(region.inputs) | {o for n in body for o in n.output}
    formal_binary = unique_name("mlso_binary", set(body_names))
    function = helper.make_function(
        MLSO_DOMAIN,
        MLSO_OP,
        [formal_binary, *region.inputs],
        list(region.outputs),
        body,
        _function_opsets(model, body),
        attributes=["plan", "binary_sha256", "ugraph", "source_sha256"],
        doc_string=(
            f"mlso region r{k}: the original computation. ONNX Runtime runs this body when the "
            "mlso runtime library is not registered; the first input (the kernel binary) is unused."
        ),
    )
    function.overload = overload
    function.value_info.extend(vi for vi in model.graph.value_info if vi.name in internal)
    node = helper.make_node(
        MLSO_OP,
        [binary_name, *region.inputs],
        list(region.outputs),
        name=node_name,
        domain=MLSO_DOMAIN,
        plan=plan_json(region.plan),
        binary_sha256=binary_sha,
        ugraph=region.ugraph_json,
        source_sha256=region.source_sha256,
    )
    node.overload = overload
    return _Built(
        node=node, function=function, position=min(region.node_indices), internal=internal
    )


def _output_value_info(model: onnx.ModelProto, built: list[tuple[PackagedRegion, _Built]]) -> None:
    """Check region tensors against the model's types; state every output's dtype and shape."""
    known = _known_types(model)
    graph_outputs = {o.name for o in model.graph.output}
    existing = {vi.name for vi in model.graph.value_info}
    for k, (region, _) in enumerate(built):
        for names, specs, what in (
            (region.inputs, region.plan["inputs"], "input"),
            (region.outputs, region.plan["outputs"], "output"),
        ):
            for name, spec in zip(names, specs, strict=True):
                if name in known:
                    problem = _compatible(known[name], spec)
                    if problem:
                        raise InputError(f"region r{k}: {what} '{name}' has {problem}", _BUG_FIX)
        for name, spec in zip(region.outputs, region.plan["outputs"], strict=True):
            if name in graph_outputs or name in existing:
                continue
            model.graph.value_info.append(
                helper.make_tensor_value_info(name, ONNX_DTYPE[spec["dtype"]], spec["shape"])
            )
            existing.add(name)


def package_model(
    model: onnx.ModelProto,
    regions: list[PackagedRegion],
    metadata: dict[str, str],
    *,
    in_place: bool = False,
) -> onnx.ModelProto:
    """A copy of `model` in which each region is one ai.mlso::MlsoKernel node (see module doc).
    `in_place`: `model` itself is changed and returned (for a caller that owns it, so that its
    weights are not copied once more); on an error it is left half-changed."""
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str, got {key!r}: {value!r}")
    out = model
    if not in_place:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    graph = out.graph

    claimed: dict[int, int] = {}
    internals = [_check_region(out, k, r, claimed) for k, r in enumerate(regions)]

    taken_overloads = {
        f.overload for f in out.functions if f.domain == MLSO_DOMAIN and f.name == MLSO_OP
    }
    node_names = {n.name for n in graph.node if n.name}
    initializers = {t.name: t for t in graph.initializer}
    new_binaries: dict[str, onnx.TensorProto] = {}
    built: list[tuple[PackagedRegion, _Built]] = []
    counter = 0
    for k, region in enumerate(regions):
        sha = hashlib.sha256(region.binary).hexdigest()
        binary_name = BINARY_PREFIX + sha[:16]
        existing = initializers.get(binary_name)
        if existing is not None and binary_name not in new_binaries:
            if (
                existing.data_type != TensorProto.UINT8
                or hashlib.sha256(existing.raw_data).hexdigest() != sha
            ):
                raise InputError(
                    f"the model already has an initializer '{binary_name}' that is not this region's binary",
                    "Rename that initializer; names starting with mlso_bin_ are reserved for mlso",
                )
        elif binary_name not in new_binaries:
            tensor = TensorProto(
                name=binary_name, data_type=TensorProto.UINT8, dims=[len(region.binary)]
            )
            tensor.raw_data = region.binary
            new_binaries[binary_name] = tensor
        if region.region_id is not None and f"r{region.region_id}" not in taken_overloads:
            number = region.region_id
        else:
            while f"r{counter}" in taken_overloads:
                counter += 1
            number = counter
        overload = f"r{number}"
        taken_overloads.add(overload)
        name = unique_name(f"mlso_region_{number}", node_names)
        built.append(
            (region, _build(out, k, region, internals[k], overload, name, binary_name, sha))
        )

    _output_value_info(out, built)

    # Rebuild the node list: unclaimed nodes keep their place, each fused node takes its region's
    # first place, then a stable topological sort fixes any order the fusion disturbed.
    entries: list[tuple[int, int, onnx.NodeProto]] = [
        (i, 1, n) for i, n in enumerate(graph.node) if i not in claimed
    ]
    entries += [(b.position, 0, b.node) for _, b in built]
    entries.sort(key=lambda e: (e[0], e[1]))
    ordered = _toposort([e[2] for e in entries], "packaging")
    all_internal = set().union(*internals) if internals else set()
    kept_value_info = [vi for vi in graph.value_info if vi.name not in all_internal]

    del graph.node[:]
    graph.node.extend(ordered)
    del graph.value_info[:]
    graph.value_info.extend(kept_value_info)
    graph.initializer.extend(new_binaries.values())
    out.functions.extend(b.function for _, b in built)
    if not any(o.domain == MLSO_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MLSO_DOMAIN, MLSO_OPSET))

    props = {p.key: p.value for p in out.metadata_props}
    props.setdefault(META_VERSION, __version__)
    props.update(metadata)
    props[META_EXECUTABLE] = "true"
    # The shapes the kernels and the folded graph are specialised to (package/shapes.py says why).
    props[META_INPUT_SHAPES] = input_shapes_json(out)
    del out.metadata_props[:]
    for key in sorted(props):
        out.metadata_props.add(key=key, value=props[key])

    out.ir_version = output_ir_version(model.ir_version)

    initializer_map = {t.name: t for t in graph.initializer}
    for i, node in enumerate(graph.node):
        if is_mlso_node(node) and node.name in {b.node.name for _, b in built}:
            check_node(out, i, initializers=initializer_map)
    return out
