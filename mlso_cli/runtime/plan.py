"""The launch plan of an `MlsoKernel` node: its canonical JSON text and its validation rules.

Why one module: the packager writes the plan, the C++ op (csrc/mlso_plan.h) and `check.py` read
it, and all three must agree on the rules. A problem is reported as a short phrase naming the
field (e.g. "launches[0].args[1].index must be ..."); callers add which node and what to do.
"""

from __future__ import annotations

import json
import re
from typing import Any

PLAN_VERSION = 1

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
]
_RANK = {k: i for i, k in enumerate(_KEY_ORDER)}
_TARGET = re.compile(r"^(sm|compute)_[0-9]+[a-z]?$")
_GRID_MAX = (2**31 - 1, 65535, 65535)
_BLOCK_MAX = (1024, 1024, 64)


class PlanProblem(ValueError):
    """A plan that breaks a rule; the message names the field."""


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


def _tensors(plan: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = plan.get(key)
    if not isinstance(items, list):
        raise PlanProblem(f"'{key}' must be a list")
    for i, t in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(t, dict):
            raise PlanProblem(f"{where} must be an object")
        if t.get("dtype") not in DTYPE_ITEMSIZE:
            raise PlanProblem(f"{where}.dtype must be one of {', '.join(DTYPE_ITEMSIZE)}")
        shape = t.get("shape")
        if not isinstance(shape, list) or len(shape) > 16:
            raise PlanProblem(f"{where}.shape must be a list of at most 16 integers")
        for k, d in enumerate(shape):
            if not _is_int(d, 0, 2**40):
                raise PlanProblem(f"{where}.shape[{k}] must be an integer >= 0")
    return items


def _buf_ref(ref: Any, where: str, limits: dict[str, int]) -> None:
    kinds = " or ".join(limits)
    if not isinstance(ref, dict) or ref.get("kind") not in limits:
        raise PlanProblem(f"{where}.kind must be {kinds}")
    limit = limits[ref["kind"]]
    if not _is_int(ref.get("index"), 0, max(limit - 1, -1)):
        raise PlanProblem(
            f"{where}.index must be an integer in [0, {limit}) for kind {ref['kind']}"
        )


def _dim3(value: Any, where: str, hi: tuple[int, int, int]) -> None:
    if not isinstance(value, list) or len(value) != 3:
        raise PlanProblem(f"{where} must be a list of 3 integers")
    for k, d in enumerate(value):
        if not _is_int(d, 1, hi[k]):
            raise PlanProblem(f"{where}[{k}] must be an integer in [1, {hi[k]}]")


def validate_plan(plan: Any, n_inputs: int | None = None, n_outputs: int | None = None) -> None:
    """Raise PlanProblem unless `plan` follows the version-1 rules (the same as the C++ op's).

    n_inputs / n_outputs: the node's variadic tensor-input and output counts, when known.
    """
    if not isinstance(plan, dict):
        raise PlanProblem("must be a JSON object")
    if not _is_int(plan.get("version"), PLAN_VERSION, PLAN_VERSION):
        raise PlanProblem(f"'version' must be {PLAN_VERSION}")
    targets = plan.get("targets")
    if (
        not isinstance(targets, list)
        or not targets
        or not all(isinstance(t, str) and _TARGET.match(t) for t in targets)
    ):
        raise PlanProblem("'targets' must be a non-empty list of strings such as \"sm_90a\"")
    if not _is_int(plan.get("smem_max"), 0, 2**31 - 1):
        raise PlanProblem("'smem_max' must be an integer >= 0")
    inputs = _tensors(plan, "inputs")
    outputs = _tensors(plan, "outputs")
    if not inputs or not outputs:
        raise PlanProblem("'inputs' and 'outputs' must each list at least one tensor")
    if n_inputs is not None and len(inputs) != n_inputs:
        raise PlanProblem(f"lists {len(inputs)} inputs but the node has {n_inputs} tensor inputs")
    if n_outputs is not None and len(outputs) != n_outputs:
        raise PlanProblem(f"lists {len(outputs)} outputs but the node has {n_outputs} outputs")
    scratch = plan.get("scratch")
    if not isinstance(scratch, list):
        raise PlanProblem("'scratch' must be a list")
    for i, s in enumerate(scratch):
        if not isinstance(s, dict) or not _is_int(s.get("bytes"), 0, 2**40):
            raise PlanProblem(f"scratch[{i}].bytes must be an integer >= 0")
    zero = plan.get("zero")
    if not isinstance(zero, list):
        raise PlanProblem("'zero' must be a list")
    zero_limits = {"output": len(outputs), "scratch": len(scratch)}
    for i, z in enumerate(zero):
        _buf_ref(z, f"zero[{i}]", zero_limits)
    launches = plan.get("launches")
    if not isinstance(launches, list) or not launches:
        raise PlanProblem("'launches' must be a non-empty list")
    arg_limits = {"input": len(inputs), "output": len(outputs), "scratch": len(scratch)}
    for i, launch in enumerate(launches):
        where = f"launches[{i}]"
        if not isinstance(launch, dict):
            raise PlanProblem(f"{where} must be an object")
        kernel = launch.get("kernel")
        if not isinstance(kernel, str) or not kernel or len(kernel) > 1024:
            raise PlanProblem(f"{where}.kernel must be a non-empty kernel name")
        _dim3(launch.get("grid"), f"{where}.grid", _GRID_MAX)
        _dim3(launch.get("block"), f"{where}.block", _BLOCK_MAX)
        bx, by, bz = launch["block"]
        if bx * by * bz > 1024:
            raise PlanProblem(f"{where}.block has more than 1024 threads")
        if not _is_int(launch.get("smem"), 0, 2**31 - 1):
            raise PlanProblem(f"{where}.smem must be an integer >= 0")
        args = launch.get("args")
        if not isinstance(args, list):
            raise PlanProblem(f"{where}.args must be a list")
        for k, a in enumerate(args):
            _buf_ref(a, f"{where}.args[{k}]", arg_limits)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_plan(text: str, n_inputs: int | None = None, n_outputs: int | None = None) -> dict:
    """JSON text -> validated plan dict; raises PlanProblem."""
    try:
        plan = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise PlanProblem(f"is not valid JSON ({e})") from None
    validate_plan(plan, n_inputs, n_outputs)
    return plan


def smem_needed(plan: dict[str, Any]) -> int:
    """Shared memory per block the plan needs: the larger of smem_max and every launch's smem."""
    return max([int(plan.get("smem_max", 0))] + [int(x.get("smem", 0)) for x in plan["launches"]])
