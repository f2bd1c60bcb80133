"""The cost model must never package a region that the GPU measured slower (never-slower rule).

MEASURED holds `mlso optimize --gpu 0` on the H200 (benchmarks/RESULTS.md, 2026-11-29): the
measured speedup of each benchmark region's lifted program over ONNX Runtime. Without a GPU the
cost model decides alone; it may be conservative (keep a region that would win), never the
reverse. Those lifted programs ran codegen's own kernel-level matmuls; since library GEMMs
(codegen/libgemm.py) the lifted program's matmuls are cuBLASLt calls, which these numbers do not
describe, so the rule is checked here with the library off (MLSO_LIBRARY_GEMM=0), as measured.
"""

from __future__ import annotations

import onnx
import pytest

from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.load import load_model
from mlso_cli.search.cost import onnx_region_cost, program_cost

MEASURED = {
    ("gqa", 1): 0.053,
    ("gqa", 8): 0.063,
    ("gqa", 16): 0.094,
    ("qknorm_gqa", 1): 0.038,
    ("qknorm_gqa", 8): 0.059,
    ("qknorm_gqa", 16): 0.077,
    ("rmsnorm_linear", 1): 0.279,
    ("rmsnorm_linear", 8): 0.183,
    ("rmsnorm_linear", 16): 0.136,
    ("lora", 1): 2.588,
    ("gated_mlp", 1): 0.372,
    ("ntrans", 1): 10.66,
    ("ntrans", 8): 10.825,
    ("ntrans", 16): 8.71,
}


@pytest.mark.parametrize("name,bs", sorted(MEASURED))
def test_estimate_never_packages_a_measured_loss(tmp_path, monkeypatch, request, name, bs):
    from mlso_cli import knobs
    from models.build_models import SPECS

    monkeypatch.setenv("MLSO_LIBRARY_GEMM", "0")  # the measured programs' lowering
    knobs.cache_clear()
    request.addfinalizer(knobs.cache_clear)  # runs before monkeypatch restores the variable

    path = tmp_path / "m.onnx"
    onnx.save(SPECS[name].build(bs, "float16", small=False), str(path))
    loaded = load_model(str(path))
    (lr,) = analyse(loaded).lifted
    estimate = onnx_region_cost(loaded, lr.region).us / program_cost(lr.graph).us
    measured = MEASURED[(name, bs)]
    if measured < 1.0:
        assert estimate <= 1.0, f"cost model would package a region measured {measured}x"
    if measured > 5.0:
        assert estimate > 1.0, "a region measured far faster should be packaged"
