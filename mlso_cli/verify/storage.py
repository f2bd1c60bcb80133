"""Storage rounding: what a value looks like after it is written to memory as fp16, bf16 or fp32.

Why here and not in numpy: numpy has no bfloat16. bf16 is defined as fp32 rounded to nearest-even
on its top 16 bits (what GPUs and torch do), so rounding goes through fp32 first. The results stay
in a wide numpy dtype (the caller's compute dtype) with exactly representable values.
"""

from __future__ import annotations

import numpy as np

from mlso_cli.ir.ops import DType


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest-even on the top 16 bits of fp32); returns fp32 values."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(
        0xFFFF0000
    )
    out = rounded.view(np.float32)
    nan = np.isnan(f)
    if nan.any():
        out = np.where(nan, f, out)
    return out


def _round_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(np.float16).astype(np.float32)


def _round_f32(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(np.float32)


ROUND = {DType.F16: _round_f16, DType.BF16: round_bf16, DType.F32: _round_f32}
"""Storage dtype -> rounding function (returns fp32 arrays holding representable values)."""


def round_to(x: np.ndarray, dtype: DType, compute: type = np.float64) -> np.ndarray:
    """x rounded to storage `dtype`, held in the `compute` dtype."""
    return ROUND[dtype](x).astype(compute, copy=False)
