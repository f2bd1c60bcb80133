"""The PyCUDA launcher: importable without a GPU; on a GPU (marker `gpu`) it loads, runs and times.

GPU tests compile small graphs from test_codegen_graphs and one benchmark fixture whose kernel
needs more than 48 KB of shared memory (the limit must be raised before launching).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from mlso_cli.errors import EnvironmentProblem, ExitCode
from mlso_cli.runtime import launcher
from tests import test_codegen_graphs as T


def test_imports_without_pycuda_and_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    with pytest.raises(EnvironmentProblem) as err:
        launcher.Program(b"", {"launches": [], "inputs": [], "outputs": [], "scratch": []})
    assert err.value.exit_code == ExitCode.ENVIRONMENT
    assert "pycuda" in err.value.one_line().lower()


def test_dtypes_and_timing_result():
    assert launcher.numpy_dtype("bfloat16").itemsize == 2
    assert launcher.numpy_dtype("float16") == np.float16
    t = launcher.TimingResult(1.5, (1.4, 1.5, 1.6), "cuda-graph", 200, 4)
    assert t.median_us == 1.5 and t.method == "cuda-graph"


# ---- on a GPU ---------------------------------------------------------------------------------------


def _program(name: str):
    from mlso_cli.codegen import compile_program

    kg = T.GRAPHS[name]()
    cp = compile_program(kg)
    return kg, launcher.Program(cp.fatbin, cp.plan)


@pytest.mark.gpu
def test_run_is_deterministic_and_writes_everything():
    kg, prog = _program("split_kv_f16")
    with prog:
        ins = T.make_inputs(kg, "split_kv_f16")
        a = prog.run(ins, poison_outputs=True)
        b = prog.run(ins, poison_outputs=True)
        assert not np.isnan(a[0].astype(np.float64)).any()
        np.testing.assert_array_equal(a[0], b[0])
        assert T.rel_error(a[0], T.reference(kg, ins)[0]) <= 2e-3


@pytest.mark.gpu
def test_run_device_uses_given_pointers():
    kg, prog = _program("elementwise_f32")
    with prog:
        ins = T.make_inputs(kg, "elementwise_f32")
        want = prog.run(ins)
        outs = prog.run_device(prog.inputs, prog.outputs)
        prog.stream.synchronize()
        assert outs == prog.outputs
        again = prog.run(prog.inputs)  # device pointers as inputs: no copies
        for w, g in zip(want, again):
            np.testing.assert_array_equal(w, g)


@pytest.mark.gpu
def test_time_uses_cuda_graph_replay_and_rotates_small_inputs():
    _, prog = _program("gated_mlp_f16")
    with prog:
        t = prog.time(warmup=5, repeats=3, iters=50)
        assert t.method == "cuda-graph", t.note
        assert t.median_us > 0 and len(t.samples_us) == 3 and t.iters == 50
        assert t.rotated_sets >= 2
        plain = prog.time(warmup=1, repeats=2, iters=10, rotate_buffers=False)
        assert plain.rotated_sets == 1


@pytest.mark.gpu
def test_wrong_shape_is_refused_before_launch():
    _, prog = _program("split_kv_f32")
    with prog, pytest.raises(ValueError, match="shape"):
        prog.run([np.zeros((1, 2, 3), np.float32)] * 3)


@pytest.mark.gpu
def test_large_shared_memory_kernel_runs():
    from mlso_cli.codegen import compile_program

    try:
        from tests.fixtures.ugraphs import FIXTURES
    except ImportError:
        pytest.skip("tests/fixtures/ugraphs.py is not there yet")
    # mla_bs8's plan takes ~100 KB of shared memory (two-stage pipelines keep gqa under 48 KB)
    kg = FIXTURES["mla_bs8"]()
    cp = compile_program(kg)
    assert max(x["smem"] for x in cp.plan["launches"]) > 48 * 1024
    with launcher.Program(cp.fatbin, cp.plan) as prog:
        rng = np.random.default_rng(0)
        ins = [rng.standard_normal(n.shape).astype(np.float16) for n in kg.inputs]
        (out,) = prog.run(ins, poison_outputs=True)
        assert T.rel_error(out, T.reference(kg, ins)[0]) <= 2e-3


@pytest.mark.gpu
def test_close_is_idempotent():
    _, prog = _program("reductions_f16")
    prog.close()
    prog.close()
    with pytest.raises(RuntimeError):
        prog.run(T.make_inputs(T.GRAPHS["reductions_f16"](), "reductions_f16"))
