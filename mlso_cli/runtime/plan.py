"""The launch plan of an `MlsoKernel` node: its canonical JSON text and its validation rules.

Why one module: the packager writes the plan, the C++ op (csrc/mlso_plan.h) and `check.py` read
it, and all three must agree on the rules. A problem is reported as a short phrase naming the
field (e.g. "launches[0].args[1].index must be ..."); callers add which node and what to do.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from typing import Any

PLAN_VERSION = 4
"""The newest plan version. Version 1 plans (generated kernels only) stay valid; version 2 adds
library GEMM launches ({"kind": "gemm", ...}, codegen/program.py), which a version 1 plan may not
hold, so a runtime that predates them refuses such a plan by its version. Version 3 adds a GEMM's
bias epilogue ("bias": a vector added to every row of C inside the call), which a version 2
runtime could not run, so only a plan holding one is version 3. Version 4 adds a GEMM's residual
epilogue ("residual": a matrix added to C inside the call, cuBLASLt's C with beta), likewise only
in a plan holding one."""
VERSIONS = (1, 2, 3, 4)
GEMM_TYPES = ("float16", "bfloat16", "float32")
"""Operand dtypes of a library GEMM; C is the operands' dtype or float32."""
GEMM_DIM_MAX = 2**31 - 1
"""m, n, k and batch of a library GEMM: cuBLASLt takes them as 32-bit (batch) or 64-bit values;
one limit for all keeps the C++ bounds arithmetic simple."""

DTYPE_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
"""Plan dtypes (the C++ side accepts the same names). Kernels use the first three; the others are
for index and mask tensors."""

ONNX_DTYPE: dict[str, int] = {
    "float16": 10,
    "bfloat16": 16,
    "float32": 1,
    "float64": 11,
    "int8": 3,
    "uint8": 2,
    "int32": 6,
    "int64": 7,
    "bool": 9,
}
"""Plan dtype name -> onnx.TensorProto element type."""

DTYPE_OF_ONNX: dict[int, str] = {v: k for k, v in ONNX_DTYPE.items()}

_KEY_ORDER = [
    "version",
    "targets",
    "smem_max",
    "inputs",
    "outputs",
    "scratch",
    "zero",
    "launches",
    "dtype",
    "shape",
    "bytes",
    "kind",
    "index",
    "kernel",
    "grid",
    "block",
    "smem",
    "args",
    "m",
    "n",
    "k",
    "batch",
    "a",
    "b",
    "c",
    "buf",
    "offset",
    "ld",
    "stride",
    "trans",
    "dtype_ab",
    "dtype_c",
    "alpha",
    "beta",
    "bias",
    "residual",
]
_RANK = {k: i for i, k in enumerate(_KEY_ORDER)}
# \Z, not $: $ also matches before a final newline, so "sm_90a\n" would pass here and fail in C++.
_TARGET = re.compile(r"^(sm|compute)_[0-9]+[a-z]?\Z")
_KERNEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,1023}\Z")

GRID_MAX = (2**31 - 1, 65535, 65535)
"""CUDA's grid limits (x, y, z) on every architecture mlso targets."""
BLOCK_MAX = (1024, 1024, 64)
"""CUDA's block dimension limits; a block also has at most BLOCK_THREADS_MAX threads."""
BLOCK_THREADS_MAX = 1024
SMEM_MAX = 232448
"""Dynamic shared memory per block, bytes: the largest opt-in limit of any GPU (227 KB, sm_90)."""
DIM_MAX = 2**40
TENSOR_BYTES_MAX = 2**40
"""One input, output or scratch tensor's byte size (1 TiB): far above any GPU's memory, low
enough that every size fits in 64 bits with room to spare."""
SCRATCH_TOTAL_MAX = 16 * 2**30
"""All scratch buffers of one node together (16 GiB). Generated scratch is split-K/split-KV
partials, a few MB; a plan that asks for more is refused rather than allowed to exhaust the GPU."""
RANK_MAX = 16

_TOP_KEYS = frozenset(
    ("version", "targets", "smem_max", "inputs", "outputs", "scratch", "zero", "launches")
)
_TENSOR_KEYS = frozenset(("dtype", "shape"))
_SCRATCH_KEYS = frozenset(("bytes", "dtype", "shape"))
_REF_KEYS = frozenset(("kind", "index"))
_LAUNCH_KEYS = frozenset(("kind", "kernel", "grid", "block", "smem", "args"))
_GEMM_KEYS = frozenset(
    (
        "kind",
        "m",
        "n",
        "k",
        "batch",
        "a",
        "b",
        "c",
        "dtype_ab",
        "dtype_c",
        "alpha",
        "beta",
        "bias",
        "residual",
    )
)
_OPERAND_KEYS = frozenset(("buf", "offset", "ld", "stride", "trans"))
_BIAS_KEYS = frozenset(("buf", "offset"))
_RESIDUAL_KEYS = frozenset(("buf", "offset", "ld", "stride"))


class PlanProblem(ValueError):
    """A plan that breaks a rule; the message names the field, `code` is the rule's short key
    (the same key the C++ validator reports, see tests/data/plan_cases.json)."""

    def __init__(self, message: str, code: str = "plan") -> None:
        super().__init__(message)
        self.code = code


DeclaredType = tuple[str | None, list[int | None] | None]
"""A node's declared tensor type: (plan dtype name or None if unknown, dims or None if the rank is
unknown; a None dim is unknown)."""


def _ordered(value: Any) -> Any:
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: (_RANK.get(k, len(_RANK)), k))
        return {k: _ordered(value[k]) for k in keys}
    if isinstance(value, (list, tuple)):
        return [_ordered(v) for v in value]
    return value


def plan_json(plan: dict[str, Any]) -> str:
    """The canonical text of a plan: fixed key order, no spaces, so equal plans hash equal."""
    return json.dumps(_ordered(plan), separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _known_keys(obj: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise PlanProblem(f"{where} has an unknown field '{key}'", "unknown_field")


def _shape_bytes(t: dict[str, Any], where: str) -> int:
    """Validate dtype and shape of a tensor object; return its byte size."""
    if not isinstance(t.get("dtype"), str) or t["dtype"] not in DTYPE_ITEMSIZE:
        raise PlanProblem(f"{where}.dtype must be one of {', '.join(DTYPE_ITEMSIZE)}", "dtype")
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > RANK_MAX:
        raise PlanProblem(f"{where}.shape must be a list of at most {RANK_MAX} integers", "shape")
    elems = 1
    for k, d in enumerate(shape):
        if not _is_int(d, 0, DIM_MAX):
            raise PlanProblem(f"{where}.shape[{k}] must be an integer in [0, 2^40]", "shape")
        elems *= d
    size = elems * DTYPE_ITEMSIZE[t["dtype"]]
    if size > TENSOR_BYTES_MAX:
        raise PlanProblem(f"{where} is larger than 2^40 bytes", "too_large")
    return size


def _tensors(plan: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = plan.get(key)
    if not isinstance(items, list):
        raise PlanProblem(f"'{key}' must be a list", "tensors")
    for i, t in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(t, dict):
            raise PlanProblem(f"{where} must be an object", "tensors")
        _known_keys(t, _TENSOR_KEYS, where)
        _shape_bytes(t, where)
    return items


def _buf_ref(ref: Any, where: str, limits: dict[str, int]) -> None:
    kinds = " or ".join(limits)
    if not isinstance(ref, dict):
        raise PlanProblem(f"{where} must be an object", "ref")
    _known_keys(ref, _REF_KEYS, where)
    if not isinstance(ref.get("kind"), str) or ref["kind"] not in limits:
        raise PlanProblem(f"{where}.kind must be {kinds}", "ref")
    limit = limits[ref["kind"]]
    if not _is_int(ref.get("index"), 0, max(limit - 1, -1)):
        raise PlanProblem(
            f"{where}.index must be an integer in [0, {limit}) for kind {ref['kind']}", "ref"
        )


def _dim3(value: Any, where: str, hi: tuple[int, int, int], code: str) -> None:
    if not isinstance(value, list) or len(value) != 3:
        raise PlanProblem(f"{where} must be a list of 3 integers", code)
    for k, d in enumerate(value):
        if not _is_int(d, 1, hi[k]):
            raise PlanProblem(f"{where}[{k}] must be an integer in [1, {hi[k]}]", code)


def _shape_text(shape: list[Any] | None) -> str:
    if shape is None:
        return "[?]"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def _check_declared(
    specs: list[dict[str, Any]], declared: list[DeclaredType | None], key: str
) -> None:
    if len(declared) != len(specs):
        raise PlanProblem(
            f"lists {len(specs)} {key} but the node declares {len(declared)}", "count"
        )
    for i, (spec, decl) in enumerate(zip(specs, declared, strict=True)):
        if decl is None:
            continue
        dtype, dims = decl
        same = dtype is None or dtype == spec["dtype"]
        if dims is not None:
            same = same and len(dims) == len(spec["shape"])
            same = same and all(
                d is None or d == p for d, p in zip(dims, spec["shape"], strict=False)
            )
        if not same:
            raise PlanProblem(
                f"{key}[{i}] is {spec['dtype']} {_shape_text(spec['shape'])} in the plan, but the "
                f"node declares {dtype or '?'} {_shape_text(dims)}",
                "declared",
            )


def validate_plan(
    plan: Any,
    n_inputs: int | None = None,
    n_outputs: int | None = None,
    *,
    declared_inputs: list[DeclaredType | None] | None = None,
    declared_outputs: list[DeclaredType | None] | None = None,
    kernels: Collection[str] | None = None,
) -> None:
    """Raise PlanProblem unless `plan` follows the version-1 rules (the same as the C++ op's).

    n_inputs / n_outputs: the node's variadic tensor-input and output counts, when known.
    declared_inputs / declared_outputs: the node's declared tensor types, when known; the plan's
    must equal them, or the op would hand ONNX Runtime buffers of another size than it expects.
    kernels: the kernel names the binary holds, when known (the C++ op asks the driver).
    The checks run in the same order as csrc/mlso_plan.h, so both report the same rule first.
    """
    if not isinstance(plan, dict):
        raise PlanProblem("must be a JSON object", "not_object")
    _known_keys(plan, _TOP_KEYS, "the plan")
    if not _is_int(plan.get("version"), VERSIONS[0], VERSIONS[-1]):
        raise PlanProblem("'version' must be 1, 2, 3 or 4", "version")
    targets = plan.get("targets")
    if (
        not isinstance(targets, list)
        or not targets
        or not all(isinstance(t, str) and _TARGET.match(t) for t in targets)
    ):
        raise PlanProblem(
            "'targets' must be a non-empty list of strings such as \"sm_90a\"", "targets"
        )
    if not _is_int(plan.get("smem_max"), 0, SMEM_MAX):
        raise PlanProblem(f"'smem_max' must be an integer in [0, {SMEM_MAX}]", "smem")
    inputs = _tensors(plan, "inputs")
    outputs = _tensors(plan, "outputs")
    if not inputs or not outputs:
        raise PlanProblem("'inputs' and 'outputs' must each list at least one tensor", "empty")
    if n_inputs is not None and len(inputs) != n_inputs:
        raise PlanProblem(
            f"lists {len(inputs)} inputs but the node has {n_inputs} tensor inputs", "count"
        )
    if n_outputs is not None and len(outputs) != n_outputs:
        raise PlanProblem(
            f"lists {len(outputs)} outputs but the node has {n_outputs} outputs", "count"
        )
    scratch = plan.get("scratch")
    if not isinstance(scratch, list):
        raise PlanProblem("'scratch' must be a list", "scratch")
    total = 0
    for i, s in enumerate(scratch):
        where = f"scratch[{i}]"
        if not isinstance(s, dict):
            raise PlanProblem(f"{where} must be an object", "scratch")
        _known_keys(s, _SCRATCH_KEYS, where)
        if not _is_int(s.get("bytes"), 0, TENSOR_BYTES_MAX):
            raise PlanProblem(f"{where}.bytes must be an integer in [0, 2^40]", "scratch")
        if "dtype" in s or "shape" in s:
            need = _shape_bytes(s, where)
            if s["bytes"] != max(need, 4):
                raise PlanProblem(
                    f"{where}.bytes is {s['bytes']}, but its dtype and shape need {max(need, 4)}",
                    "scratch",
                )
        total += s["bytes"]
        if total > SCRATCH_TOTAL_MAX:
            raise PlanProblem("scratch buffers total more than 16 GiB", "scratch_total")
    zero = plan.get("zero")
    if not isinstance(zero, list):
        raise PlanProblem("'zero' must be a list", "ref")
    zero_limits = {"output": len(outputs), "scratch": len(scratch)}
    for i, z in enumerate(zero):
        _buf_ref(z, f"zero[{i}]", zero_limits)
    launches = plan.get("launches")
    if not isinstance(launches, list) or not launches:
        raise PlanProblem("'launches' must be a non-empty list", "launches")
    arg_limits = {"input": len(inputs), "output": len(outputs), "scratch": len(scratch)}
    for i, launch in enumerate(launches):
        where = f"launches[{i}]"
        if not isinstance(launch, dict):
            raise PlanProblem(f"{where} must be an object", "launches")
        kind = launch.get("kind", "kernel")
        if kind not in ("kernel", "gemm"):
            raise PlanProblem(f'{where}.kind must be "kernel" or "gemm"', "launch_kind")
        if kind == "gemm":
            _gemm(launch, where, plan, inputs, outputs, scratch)
            continue
        _known_keys(launch, _LAUNCH_KEYS, where)
        kernel = launch.get("kernel")
        if not isinstance(kernel, str) or not _KERNEL.match(kernel):
            raise PlanProblem(
                f"{where}.kernel must be a kernel name (a C identifier of 1 to 1024 characters)",
                "kernel",
            )
        _dim3(launch.get("grid"), f"{where}.grid", GRID_MAX, "grid")
        _dim3(launch.get("block"), f"{where}.block", BLOCK_MAX, "block")
        bx, by, bz = launch["block"]
        if bx * by * bz > BLOCK_THREADS_MAX:
            raise PlanProblem(f"{where}.block has more than {BLOCK_THREADS_MAX} threads", "block")
        if not _is_int(launch.get("smem"), 0, SMEM_MAX):
            raise PlanProblem(f"{where}.smem must be an integer in [0, {SMEM_MAX}]", "smem")
        args = launch.get("args")
        if not isinstance(args, list):
            raise PlanProblem(f"{where}.args must be a list", "ref")
        for k, a in enumerate(args):
            _buf_ref(a, f"{where}.args[{k}]", arg_limits)
    if declared_inputs is not None:
        _check_declared(inputs, declared_inputs, "inputs")
    if declared_outputs is not None:
        _check_declared(outputs, declared_outputs, "outputs")
    if kernels is not None:
        for i, launch in enumerate(launches):
            if launch.get("kind") == "gemm":
                continue  # a library call: nothing to find in the binary
            if launch["kernel"] not in kernels:
                raise PlanProblem(
                    f"launches[{i}].kernel '{launch['kernel']}' is not in the kernel binary",
                    "kernel_missing",
                )


def _gemm(
    launch: dict[str, Any],
    where: str,
    plan: dict[str, Any],
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    scratch: list[dict[str, Any]],
) -> None:
    """A library GEMM launch: shapes, dtypes, operand layouts, and that every element the call
    touches lies inside its buffer (cuBLASLt trusts its arguments; a bad plan would make it read
    or write out of bounds). Same checks, same order, as csrc/mlso_plan.h's gemm()."""
    if plan["version"] < 2:
        raise PlanProblem(f"{where} is a library GEMM, which needs 'version' 2", "version")
    _known_keys(launch, _GEMM_KEYS, where)
    dims = {}
    for key in ("m", "n", "k", "batch"):
        if not _is_int(launch.get(key), 1, GEMM_DIM_MAX):
            raise PlanProblem(f"{where}.{key} must be an integer in [1, 2^31-1]", "gemm")
        dims[key] = launch[key]
    dab, dc = launch.get("dtype_ab"), launch.get("dtype_c")
    if not isinstance(dab, str) or dab not in GEMM_TYPES:
        raise PlanProblem(f"{where}.dtype_ab must be one of {', '.join(GEMM_TYPES)}", "gemm")
    if not isinstance(dc, str) or dc not in (dab, "float32"):
        raise PlanProblem(f"{where}.dtype_c must be {dab} or float32", "gemm")
    for key in ("alpha", "beta"):
        v = launch.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise PlanProblem(f"{where}.{key} must be a finite number", "gemm")
    m, n, k, batch = dims["m"], dims["n"], dims["k"], dims["batch"]
    tensors = {"input": inputs, "output": outputs}
    refs = {}
    for role, rows, cols, dtype in (("a", m, k, dab), ("b", k, n, dab), ("c", m, n, dc)):
        w = f"{where}.{role}"
        op = launch.get(role)
        if not isinstance(op, dict):
            raise PlanProblem(f"{w} must be an object", "gemm")
        _known_keys(op, _OPERAND_KEYS, w)
        limits = {"output": len(outputs), "scratch": len(scratch)}
        if role != "c":
            limits = {"input": len(inputs), **limits}
        _buf_ref(op.get("buf"), f"{w}.buf", limits)
        for key, lo in (("offset", 0), ("ld", 1), ("stride", 0)):
            if not _is_int(op.get(key), lo, DIM_MAX):
                raise PlanProblem(f"{w}.{key} must be an integer in [{lo}, 2^40]", "gemm")
        if not isinstance(op.get("trans"), bool) or (role == "c" and op["trans"]):
            raise PlanProblem(
                f"{w}.trans must be {'false' if role == 'c' else 'true or false'}", "gemm"
            )
        ref = op["buf"]
        have, nbytes = _buffer_dtype_bytes(ref, tensors, scratch)
        if have != dtype:
            raise PlanProblem(f"{w}.buf is {have}, the GEMM reads it as {dtype}", "gemm")
        trans, ld, stride = op["trans"], op["ld"], op["stride"]
        if ld < (rows if trans else cols):
            raise PlanProblem(
                f"{w}.ld is {ld}, less than its {'rows' if trans else 'columns'} "
                f"({rows if trans else cols})",
                "gemm",
            )
        span = (cols - 1) * ld + rows if trans else (rows - 1) * ld + cols
        # C's batch entries are disjoint when packed one after another, or side by side within
        # each row (heads handed on as [s, heads * d]: ld spans them all)
        side = not trans and stride >= cols and (batch - 1) * stride + cols <= ld
        if role == "c" and batch > 1 and stride < span and not side:
            raise PlanProblem(f"{w}.stride is {stride}: batch entries of C overlap", "gemm")
        last = op["offset"] + (batch - 1) * stride + span
        if last * DTYPE_ITEMSIZE[dtype] > nbytes:
            raise PlanProblem(
                f"{w} reaches element {last - 1} of a buffer of {nbytes} bytes", "gemm_bounds"
            )
        refs[role] = (ref["kind"], ref["index"])
    if refs["c"] in (refs["a"], refs["b"]):
        raise PlanProblem(f"{where}.c is the buffer of an operand", "gemm")
    if "bias" in launch:
        _gemm_bias(
            launch["bias"], f"{where}.bias", plan, dims["n"], dc, refs["c"], tensors, scratch
        )
    if "residual" in launch:
        _gemm_residual(launch, f"{where}.residual", plan, dims, dc, refs["c"], tensors, scratch)


def _buffer_dtype_bytes(
    ref: dict[str, Any],
    tensors: dict[str, list[dict[str, Any]]],
    scratch: list[dict[str, Any]],
) -> tuple[str, int]:
    """The dtype and byte size of the buffer a (checked) buffer reference names."""
    if ref["kind"] == "scratch":
        entry = scratch[ref["index"]]
        return entry.get("dtype", "float32"), entry["bytes"]
    entry = tensors[ref["kind"]][ref["index"]]
    return entry["dtype"], _shape_bytes(entry, ref["kind"])


def _gemm_bias(
    bias: Any,
    w: str,
    plan: dict[str, Any],
    n: int,
    dtype: str,
    c_ref: tuple[str, int],
    tensors: dict[str, list[dict[str, Any]]],
    scratch: list[dict[str, Any]],
) -> None:
    """A GEMM's bias epilogue: n elements of C's dtype (cuBLASLt reads the bias in D's type,
    cublasLt.h's CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE), added to every row of every batch entry,
    inside its buffer, and not C's buffer (C is written while the bias is read). Same checks, same
    order, as csrc/mlso_plan.h's gemm_bias()."""
    if plan["version"] < 3:
        raise PlanProblem(f"{w} is a bias epilogue, which needs 'version' 3", "version")
    if not isinstance(bias, dict):
        raise PlanProblem(f"{w} must be an object", "gemm")
    _known_keys(bias, _BIAS_KEYS, w)
    limits = {"input": len(tensors["input"]), "output": len(tensors["output"])}
    limits["scratch"] = len(scratch)
    _buf_ref(bias.get("buf"), f"{w}.buf", limits)
    if not _is_int(bias.get("offset"), 0, DIM_MAX):
        raise PlanProblem(f"{w}.offset must be an integer in [0, 2^40]", "gemm")
    ref = bias["buf"]
    have, nbytes = _buffer_dtype_bytes(ref, tensors, scratch)
    if have != dtype:
        raise PlanProblem(f"{w}.buf is {have}, the bias is read as C's {dtype}", "gemm")
    last = bias["offset"] + n
    if last * DTYPE_ITEMSIZE[dtype] > nbytes:
        raise PlanProblem(
            f"{w} reaches element {last - 1} of a buffer of {nbytes} bytes", "gemm_bounds"
        )
    if (ref["kind"], ref["index"]) == c_ref:
        raise PlanProblem(f"{w} is the buffer of C", "gemm")


def _gemm_residual(
    launch: dict[str, Any],
    w: str,
    plan: dict[str, Any],
    dims: dict[str, int],
    dtype: str,
    c_ref: tuple[str, int],
    tensors: dict[str, list[dict[str, Any]]],
    scratch: list[dict[str, Any]],
) -> None:
    """A GEMM's residual epilogue: an m x n row-major matrix per batch entry (cuBLASLt's C, read
    with beta while the plan's C is its D), of C's dtype (cuBLASLt's C and D types are one here),
    inside its buffer, and not C's buffer: the call writes C while it reads the residual, and
    cuBLASLt does not promise an order between the two, so an overlap could read values already
    overwritten. Never with a bias (one epilogue per GEMM: codegen/libgemm.py says why). Same
    checks, same order, as csrc/mlso_plan.h's gemm()."""
    if plan["version"] < 4:
        raise PlanProblem(f"{w} is a residual epilogue, which needs 'version' 4", "version")
    if "bias" in launch:
        raise PlanProblem(f"{w} comes with a bias: a GEMM has at most one epilogue", "gemm")
    residual = launch["residual"]
    if not isinstance(residual, dict):
        raise PlanProblem(f"{w} must be an object", "gemm")
    _known_keys(residual, _RESIDUAL_KEYS, w)
    limits = {"input": len(tensors["input"]), "output": len(tensors["output"])}
    limits["scratch"] = len(scratch)
    _buf_ref(residual.get("buf"), f"{w}.buf", limits)
    for key, lo in (("offset", 0), ("ld", 1), ("stride", 0)):
        if not _is_int(residual.get(key), lo, DIM_MAX):
            raise PlanProblem(f"{w}.{key} must be an integer in [{lo}, 2^40]", "gemm")
    ref = residual["buf"]
    have, nbytes = _buffer_dtype_bytes(ref, tensors, scratch)
    if have != dtype:
        raise PlanProblem(f"{w}.buf is {have}, the residual is read as C's {dtype}", "gemm")
    m, n, batch = dims["m"], dims["n"], dims["batch"]
    ld, stride = residual["ld"], residual["stride"]
    if ld < n:
        raise PlanProblem(f"{w}.ld is {ld}, less than its columns ({n})", "gemm")
    last = residual["offset"] + (batch - 1) * stride + (m - 1) * ld + n
    if last * DTYPE_ITEMSIZE[dtype] > nbytes:
        raise PlanProblem(
            f"{w} reaches element {last - 1} of a buffer of {nbytes} bytes", "gemm_bounds"
        )
    if (ref["kind"], ref["index"]) == c_ref:
        raise PlanProblem(
            f"{w} is the buffer of C, which the GEMM writes while it reads the residual", "gemm"
        )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


JSON_DEPTH_MAX = 64
"""Nesting limit of the plan text, the same as csrc/mlso_json.h's."""


def _json_problem(value: Any) -> str:
    """What csrc/mlso_json.h refuses that Python's json module accepts: nesting deeper than
    JSON_DEPTH_MAX, and lone UTF-16 surrogates (they have no UTF-8 form)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > JSON_DEPTH_MAX:
            return f"nested deeper than {JSON_DEPTH_MAX}"
        if isinstance(v, dict):
            stack.extend((k, depth + 1) for k in v)
            stack.extend((c, depth + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, depth + 1) for c in v)
        elif isinstance(v, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in v):
            return "a lone surrogate in a string"
    return ""


def _parse_int(lexeme: str) -> int | float:
    """A JSON integer as csrc/mlso_json.h reads it: an int when it fits in int64, else a float
    (which no rule accepts). Why: int() refuses literals of more than 4300 digits (Python's
    int_max_str_digits), which would make a plan invalid JSON here but a plain rule violation
    (e.g. "version") in C++."""
    if len(lexeme) <= 20:
        value = int(lexeme)
        if -(2**63) <= value < 2**63:
            return value
    return float(lexeme)


def parse_plan(
    text: str,
    n_inputs: int | None = None,
    n_outputs: int | None = None,
    **declared: Any,
) -> dict:
    """JSON text -> validated plan dict; raises PlanProblem. Keyword arguments go to
    validate_plan (declared_inputs, declared_outputs, kernels)."""
    try:
        plan = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_int=_parse_int,
        )
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise PlanProblem(f"is not valid JSON ({e})", "json") from None
    problem = _json_problem(plan)
    if problem:
        raise PlanProblem(f"is not valid JSON ({problem})", "json")
    validate_plan(plan, n_inputs, n_outputs, **declared)
    return plan


def smem_needed(plan: dict[str, Any]) -> int:
    """Shared memory per block the plan needs: the larger of smem_max and every launch's smem."""
    return max([int(plan.get("smem_max", 0))] + [int(x.get("smem", 0)) for x in plan["launches"]])
