"""Float check: a candidate's error against an fp64 reference, at unit and adversarial scales.

Why: the field check proves the exact semantics equal; it says nothing about rounding, overflow
or a missing softmax stabiliser. The reference is an fp64 evaluation of the original region (never
fp16 ONNX Runtime: it overflows at large scales and CPU and CUDA disagree). The metric is the
norm-wise relative error ||out - ref|| / ||ref||, with the limits of docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.node import Node, toposort
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify.interpreter import run
from mlso_cli.verify.storage import round_to

LIMITS: dict[DType, float] = {DType.F32: 1e-5, DType.F16: 2e-3, DType.BF16: 1e-2}
"""Storage dtype -> largest allowed norm-wise relative error (all with fp32 accumulation)."""

_DTYPE_NAMES = {
    "fp32": DType.F32,
    "float32": DType.F32,
    "fp16": DType.F16,
    "float16": DType.F16,
    "half": DType.F16,
    "bf16": DType.BF16,
    "bfloat16": DType.BF16,
}


@dataclass(frozen=True)
class FloatReport:
    ok: bool
    errors: tuple[float, ...]
    """Norm-wise relative error per output (inf where the candidate is not finite)."""
    limit: float
    dtype: DType
    detail: str


def as_dtype(dtype: DType | str) -> DType:
    return dtype if isinstance(dtype, DType) else _DTYPE_NAMES[str(dtype).lower()]


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| (Frobenius), or the absolute norm when ref is zero."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shape {out.shape} vs reference {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    num = float(np.linalg.norm(out - ref))
    den = float(np.linalg.norm(ref))
    return num / den if den > 0 else num


def stored_inputs(kg: KernelGraph, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The inputs as the graph stores them (rounded to each input's dtype), in float64."""
    return [round_to(np.asarray(x, np.float64), n.dtype) for x, n in zip(inputs, kg.inputs)]


def float_check(
    a_or_ref: KernelGraph | Sequence[np.ndarray],
    b: KernelGraph,
    inputs: Sequence[np.ndarray],
    dtype: DType | str,
    mode: str = "float32",
) -> FloatReport:
    """Run b in `mode` on the stored inputs and compare with the fp64 reference (a graph or arrays)."""
    dt = as_dtype(dtype)
    limit = LIMITS[dt]
    xs = stored_inputs(b, inputs)
    ref = (
        run(a_or_ref, xs, "float64")
        if isinstance(a_or_ref, KernelGraph)
        else [np.asarray(r) for r in a_or_ref]
    )
    if not all(np.all(np.isfinite(r)) for r in ref):
        return FloatReport(False, (), limit, dt, "the fp64 reference is not finite at these inputs")
    out = run(b, xs, mode)
    if len(out) != len(ref):
        return FloatReport(
            False, (), limit, dt, f"{len(out)} outputs vs {len(ref)} reference outputs"
        )
    errs = tuple(relative_error(o, r) for o, r in zip(out, ref))
    worst = max(errs, default=0.0)
    ok = worst <= limit
    detail = ", ".join(f"{name}: {e:.3g}" for name, e in zip(b.output_names, errs))
    return FloatReport(
        ok, errs, limit, dt, f"{'ok' if ok else 'FAIL'} ({dt.value} limit {limit:g}): {detail}"
    )


# ---- inputs ----------------------------------------------------------------------------------


def _unit(kg: KernelGraph, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal(n.shape) for n in kg.inputs]


def _scaled(factor: float) -> Callable[[KernelGraph, np.random.Generator], list[np.ndarray]]:
    return lambda kg, rng: [x * factor for x in _unit(kg, rng)]


def _logits(kg: KernelGraph, rng: np.random.Generator, target: float = 100.0) -> list[np.ndarray]:
    """Scale the inputs that feed the first matmul until its outputs reach about +-target."""
    xs = _unit(kg, rng)
    first = _first_matmul(kg, xs)
    if first is None:
        return xs
    feeds = _input_ancestors(kg, first)
    scale = 1.0
    for _ in range(6):
        peak = _peak(kg, [x * scale if i in feeds else x for i, x in enumerate(xs)], first)
        if peak == 0 or abs(peak / target - 1) < 0.05:
            break
        scale *= float(np.sqrt(target / peak))
    return [x * scale if i in feeds else x for i, x in enumerate(xs)]


ADVERSARIAL: dict[str, Callable[[KernelGraph, np.random.Generator], list[np.ndarray]]] = {
    "unit": _unit,
    "scale": _scaled(1e3),  # norm inputs x1e3: stresses sums of squares and rsqrt
    "small": _scaled(1e-3),
    "logits": _logits,  # softmax logits of about +-100: the stabiliser must hold
}
"""Input kind -> generator of float64 inputs for a graph."""


def adversarial_inputs(kg: KernelGraph, seed: int, kind: str = "unit") -> list[np.ndarray]:
    """Random float64 inputs for kg of the given kind (see ADVERSARIAL)."""
    if kind not in ADVERSARIAL:
        raise ValueError(f"unknown input kind {kind!r}; use one of {sorted(ADVERSARIAL)}")
    return ADVERSARIAL[kind](kg, np.random.default_rng(seed))


def _first_matmul(kg: KernelGraph, xs: list[np.ndarray]) -> Node | None:
    seen: list[Node] = []

    def observe(n: Node, v: Any) -> None:
        if n.op is Op.MATMUL and not seen:
            seen.append(n)

    run(kg, xs, "float64", observe=observe)
    return seen[0] if seen else None


def _peak(kg: KernelGraph, xs: list[np.ndarray], node: Node) -> float:
    peak = [0.0]

    def observe(n: Node, v: Any) -> None:
        if n == node:
            peak[0] = max(peak[0], float(np.max(np.abs(v))))

    run(kg, xs, "float64", observe=observe)
    return peak[0]


def _input_ancestors(kg: KernelGraph, node: Node) -> set[int]:
    """Indices of the kernel inputs that `node` (kernel- or block-level) depends on."""
    out: set[int] = set()
    for gd in (n for n in kg.nodes() if n.op is Op.GRAPH_DEF):
        body = toposort(list(gd.arg.outputs))
        if node in body:
            for it in (t for t in toposort([node]) if t.op is Op.ITER):
                out |= _input_ancestors(kg, gd.src[it.arg])
            return out
    return {t.arg for t in toposort([node]) if t.op is Op.INPUT}
