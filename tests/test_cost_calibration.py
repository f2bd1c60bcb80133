"""The cost model's library GEMM price against the GEMM times measured on the H200.

Why: the search picks between library GEMMs and generated kernels by `library_gemm_s`, whose
constants (search/cost.py, Hardware.library_*) were estimates. This holds them to the last
measurement in benchmarks/results/library_gemm.json (benchmarks/library_gemm.py on the H200,
CUDA-graph replay, operands rotated out of L2): a re-measurement or a constant that drifts
beyond the band fails here, and the constants get re-fitted."""

from __future__ import annotations

import json
import re

import pytest

from mlso_cli.ir import DType, Op
from mlso_cli.search.cost import H200, library_gemm_s
from tests import test_libgemm as L
from tests.helpers import ROOT

RECORDS = ROOT / "benchmarks" / "results" / "library_gemm.json"
BAND = (0.6, 1.6)
"""Predicted / measured. The model is max(FLOPs, bytes) plus a fixed call cost; measured GEMMs
with a long K (4864 or 8192 deep) run slower than that (split-K reductions), small ones faster."""


def _measured() -> list[tuple[str, int, int, int, float]]:
    out = []
    for rec in json.loads(RECORDS.read_text()):
        shape = re.search(r"(\d+)x(\d+)x(\d+)$", rec["row"])
        if rec["machine"] != "NVIDIA H200" or "+" in rec["row"] or not shape:
            continue  # the model is the H200's; a fused row is not one GEMM
        m, k, n = map(int, shape.groups())
        out.append((rec["row"], m, k, n, float(rec["figures"]["library µs"])))
    return out


def test_there_are_h200_measurements_to_hold_the_model_to():
    assert len(_measured()) >= 4


@pytest.mark.parametrize("row,m,k,n,us", _measured(), ids=lambda v: str(v))
def test_library_gemm_price_is_within_the_band_of_the_measured_time(row, m, k, n, us):
    kg = L.plain(DType.F16, 1, m, k, n)
    (mm,) = [x for x in kg.nodes() if x.op is Op.MATMUL]
    predicted = library_gemm_s(mm, H200) * 1e6
    ratio = predicted / us
    assert BAND[0] <= ratio <= BAND[1], f"{row}: predicted {predicted:.1f} µs, measured {us} µs"
