"""benchmarks/hopper_table.py (issue 33's table) on the CPU: the floor / target / percentage
arithmetic, the records it writes, the rows it covers, the committed μGraphs it times, and its
GPU path skipping cleanly where there is no GPU. The GPU path itself runs only on the device."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from benchmarks import hopper_table as H
from benchmarks import results_table
from mlso_cli.ir import serialize, spec
from models.build_models import SPECS
from models.realwidth import CLASSES, REALWIDTH

ROOT = Path(__file__).resolve().parent.parent


def test_dram_peak_by_device_name() -> None:
    assert H.dram_peak("NVIDIA H200") == 4.8e12
    assert H.dram_peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert H.dram_peak("NVIDIA H100 PCIe") == 2.0e12
    with pytest.raises(ValueError, match="A100"):
        H.dram_peak("NVIDIA A100-SXM4-80GB")


def test_floor_is_the_largest_of_dram_compute_and_launch() -> None:
    assert H.floor_us(48_000_000, 0, 4.8e12) == pytest.approx(10.0)  # DRAM-bound
    assert H.floor_us(0, 7_900_000_000, 4.8e12) == pytest.approx(10.0)  # 790 TFLOP/s
    assert H.floor_us(4_800, 790, 4.8e12) == H.LAUNCH_FLOOR_US == 2.0  # a tiny launch
    assert H.floor_us(48_000_000, 15_800_000_000, 4.8e12) == pytest.approx(20.0)


def test_target_takes_the_larger_of_peer_and_floor_terms() -> None:
    assert H.target_us(30.0, 9.0) == pytest.approx(20.0)  # best peer / 1.5
    assert H.target_us(12.0, 18.0) == pytest.approx(20.0)  # floor / 0.9
    assert H.target_us(None, 9.0) == pytest.approx(10.0)


def test_percent_of_peak() -> None:
    # 48 MB in 20 µs is 2.4 TB/s: half of the H200's 4.8
    assert H.percent_of_peak(48e6, 20.0, 4.8e12) == pytest.approx(50.0)
    assert H.percent_of_peak(7.9e9, 40.0, H.TENSOR_FLOPS) == pytest.approx(25.0)


def test_peers_under_the_floor_or_disagreeing_are_dropped() -> None:
    kept, notes = H.usable_peers({"eager": 8.9, "sdpa": 9.5, "compile": 30.0}, 10.0, {"compile"})
    assert kept == {"sdpa": 9.5}
    assert len(notes) == 2
    assert "under 90%" in notes[0] and "torch eager" in notes[0]
    assert "disagrees" in notes[1] and "torch.compile" in notes[1]


def _measured(**kw: object) -> dict:
    res = {
        "name": "gated_mlp_bs1",
        "cls": "benchmark",
        "family": "gated_mlp",
        "bytes": 48_000_000,
        "flops": 0,
        "dram_bps": 4.8e12,
        "tensor_flops": H.TENSOR_FLOPS,
        "peers_us": {"eager": 36.0, "sdpa": 5.0},
        "disagree": [],
        "notes": [],
        "mlso_us": 20.0,
        "launches": 2,
    }
    res.update(kw)
    return H.summarise(res)


def test_summarise_and_figures() -> None:
    res = _measured()
    assert res["floor_us"] == pytest.approx(10.0)
    assert res["best_peer"] == "eager"  # SDPA's 5 µs is under the floor: dropped
    assert res["target_us"] == pytest.approx(24.0)
    assert res["vs_target"] == pytest.approx(20.0 / 24.0)
    assert res["pct_dram"] == pytest.approx(50.0)
    figs = H.figures(res)
    assert figs["best peer"] == "torch eager 36.00"
    assert figs["SDPA µs"] == 5.0 and figs["torch.compile µs"] is None
    assert figs["% DRAM"] == 50.0 and figs["target µs"] == 24.0
    assert "SDPA 5.00 µs dropped" in figs["notes"]
    assert figs["class"] == "benchmark row"
    line = H.markdown_row(res)
    assert line.startswith(
        "| gated_mlp_bs1 | benchmark row | 20.0 | 2 | — | — | — | 36.0 | 5.0 | — |"
    )
    assert line.count("|") == len(H.HEAD) + 1
    # both candidates timed: the row shows each and which one mlso's figure is
    both = H.figures(_measured(searched_us=25.0, baseline_us=20.0, mlso_pick="baseline"))
    assert (both["searched µs"], both["library baseline µs"], both["chosen"]) == (
        25.0,
        20.0,
        "baseline",
    )


def test_the_library_baseline_is_the_rows_one_lifted_region() -> None:
    """The baseline candidate is the lifted program of the row's model (one region), with its
    lifted constants; a model that lifts into several regions has none."""
    from mlso_cli.ir import check

    row = next(r for r in H.rows() if r.name == "mla_decode_b1_h128_kv8192")
    kg, consts = H.baseline_program(row.build())
    check(kg)
    model = row.build()
    assert set(kg.output_names) == {o.name for o in model.graph.output}
    graph_inputs = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    assert set(kg.input_names) <= graph_inputs | set(consts)


def test_a_peer_disagreeing_with_mlso_is_dropped_unless_every_peer_does() -> None:
    res = _measured(
        peers_us={"eager": 36.0, "sdpa": 30.0},
        agree={"eager": 1e-3, "sdpa": 0.4},
        disagree=["sdpa"],
    )
    assert res["best_peer"] == "eager"
    assert any("SDPA 30.00 µs dropped: output disagrees" in n for n in res["dropped"])
    assert H.figures(res)["mlso vs eager"] == "1.0e-03"
    # every peer differs from mlso: mlso is the suspect; the peers stay and the row says so
    res = _measured(
        peers_us={"eager": 36.0, "sdpa": 30.0},
        agree={"eager": 0.3, "sdpa": 0.4},
        disagree=["eager", "sdpa"],
    )
    assert res["best_peer"] == "sdpa"
    assert "differs from every peer" in H.figures(res)["notes"]


def test_a_failed_program_keeps_its_peers_and_says_why() -> None:
    res = _measured(mlso_us=None, error="CompileError: nvcc failed")
    figs = H.figures(res)
    assert figs["mlso µs"] is None and figs["% DRAM"] is None
    assert figs["torch eager µs"] == 36.0
    assert figs["notes"].startswith("mlso: CompileError")


def test_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_table, "RECORDS", tmp_path)
    monkeypatch.setenv("MLSO_BENCH_COMMIT", "abc1234")
    path = H.record([_measured(), _measured(name="lora_bs1")], "NVIDIA H200 (test)")
    assert path == tmp_path / "hopper_rows.json"
    recs = json.loads(path.read_text())
    assert [r["row"] for r in recs] == ["gated_mlp_bs1", "lora_bs1"]
    for r in recs:
        assert r["table"] == "hopper_rows" and r["commit"] == "abc1234"
        assert r["machine"] == "NVIDIA H200 (test)"
        assert set(r["figures"]) == set(H.HEAD[1:]) | {"MB", "GFLOP", "mlso vs eager"}
    assert "hopper_rows" in results_table.TABLES
    text = results_table.render(results_table.load_records())
    assert "## " + results_table.TABLES["hopper_rows"][0] in text
    assert "| gated_mlp_bs1 | abc1234 |" in text


def test_record_command_reads_a_saved_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_table, "RECORDS", tmp_path / "rec")
    saved = tmp_path / "run.json"
    res = {k: v for k, v in _measured().items() if k not in ("floor_us", "target_us")}
    saved.write_text(json.dumps({"device": "NVIDIA H200", "results": [res]}))
    assert H.main(["record", str(saved), "--machine", "m"]) == 0
    recs = json.loads((tmp_path / "rec" / "hopper_rows.json").read_text())
    assert recs[0]["figures"]["target µs"] == 24.0


def test_rows_cover_every_benchmark_row_and_every_class() -> None:
    names = [r.name for r in H.rows()]
    assert len(names) == len(set(names))
    want = {f"{n}_bs{bs}" for n, s in SPECS.items() for bs in s.batch_sizes}
    assert want <= set(names)
    assert {f"{n}_bs1" for n in SPECS} <= set(names)
    assert {r.cls for r in H.rows() if r.cls != "benchmark"} == set(CLASSES)
    assert set(REALWIDTH) <= set(names)
    # batch-1 rows first, then the real-width ones: a deadline cuts batch 8 / 16 first
    first_big = min(
        i for i, r in enumerate(H.rows()) if r.cls == "benchmark" and "_bs1" not in r.name
    )
    assert all(r.cls == "benchmark" and r.name.endswith("_bs1") for r in H.rows()[: len(SPECS)])
    assert all(r.cls != "benchmark" for r in H.rows()[len(SPECS) : first_big])


def test_select_rows_by_glob() -> None:
    got = [r.name for r in H.select(H.rows(), "gqa_bs*, mla_decode*")]
    assert got == ["gqa_bs1", "mla_decode_b1_h128_kv8192", "gqa_bs8", "gqa_bs16"]


def _fake_torch() -> types.SimpleNamespace:
    fn = types.SimpleNamespace(
        **{
            n: None
            for n in (
                "scaled_dot_product_attention",
                "silu",
                "gelu",
                "layer_norm",
                "group_norm",
                "batch_norm",
                "linear",
            )
        }
    )
    return types.SimpleNamespace(nn=types.SimpleNamespace(functional=fn), softmax=None)


def test_every_row_has_peers() -> None:
    for row in H.rows():
        peers = H.peer_family(_fake_torch(), row.family)
        assert "eager" in peers, row.name
        attention = row.family in ("gqa", "qknorm_gqa", "qknorm_real", "mla", "gqa_decode")
        assert ("sdpa" in peers) == attention, row.name
    with pytest.raises(KeyError):
        H.peer_family(_fake_torch(), "nonesuch")


def _programs() -> list[Path]:
    folder = ROOT / "benchmarks" / "searched_programs"
    return sorted(folder.glob("*.json")) + sorted((folder / "realwidth").glob("*.json"))


@pytest.mark.parametrize("path", _programs(), ids=lambda p: p.stem)
def test_committed_programs_load_and_pass_the_spec_checker(path: Path) -> None:
    kg = serialize.loads(path.read_text())
    assert spec.problems(kg) == []
    assert kg.input_names and kg.output_names


@pytest.mark.parametrize("row", H.rows(), ids=lambda r: r.name)
def test_each_row_program_fits_its_model(row: H.Row) -> None:
    """The program a row times takes the model's inputs (or initializers) at their shapes and
    writes its outputs: a stale file for a changed model fails here, not on the device."""
    assert row.program.is_file(), f"{row.program} missing: search_bench.py --save"
    kg = serialize.loads(row.program.read_text())
    model = row.build()
    shapes = {
        vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in [*model.graph.input, *model.graph.output]
    }
    shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
    for name, node in zip(kg.input_names, kg.inputs):
        assert name in shapes, name
        assert list(node.shape) == shapes[name], name
    assert set(kg.output_names) == {o.name for o in model.graph.output}
    for name, node in zip(kg.output_names, kg.outputs):
        assert list(node.shape) == shapes[name], name


def test_every_row_program_generates() -> None:
    """Code generation (no nvcc) takes every row's program, and its plan's buffers are the
    program's inputs and outputs in order: what the device compiles and the table feeds."""
    from mlso_cli.codegen import generate

    for row in H.rows():
        kg = serialize.loads(row.program.read_text())
        plan = generate(kg).plan
        assert [t["shape"] for t in plan["inputs"]] == [list(n.shape) for n in kg.inputs]
        assert [t["shape"] for t in plan["outputs"]] == [list(n.shape) for n in kg.outputs]
        assert plan["launches"], row.name


def test_model_cost_counts_bytes_and_matmul_flops() -> None:
    nbytes, flops = H.model_cost(SPECS["rmsnorm_linear"].build(1, "float16"))
    # X(2,4096), gamma(4096), the eps scalar, W(4096,6144) read; O(2,6144) written; fp16
    assert nbytes == 2 * (2 * 4096 + 4096 + 1 + 4096 * 6144 + 2 * 6144) + 8  # + int64 axes
    assert flops == 2 * 2 * 4096 * 6144
    nbytes, flops = H.model_cost(REALWIDTH["gqa_decode_b1_h32_kvh8_d128_kv32768"].build())
    kv = 2 * 8 * 32768 * 128 * 2  # the KV cache once, not the repeated heads
    assert kv < nbytes < kv * 1.01
    assert flops == 2 * (2 * 32 * 32768 * 128)


def test_realwidth_models_are_valid_onnx() -> None:
    for r in REALWIDTH.values():
        model = r.build()
        onnx.checker.check_model(model, full_check=True)
        assert r.cls in CLASSES and r.name in r.build().graph.name


def test_run_skips_without_torch_or_gpu(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert H.main(["run", "--rows", "gqa_bs1"]) == 0
    assert "skipped, no CUDA device" in capsys.readouterr().err


def test_run_script_skips_cleanly_here() -> None:
    """As the device command runs it, on a machine without torch or a GPU."""
    try:
        import torch  # noqa: F401

        pytest.skip("torch is importable here: the in-process test covers the no-GPU path")
    except ImportError:
        pass
    r = subprocess.run(
        [sys.executable, "benchmarks/hopper_table.py", "run", "--rows", "gqa_bs1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0
    assert "skipped, torch is not importable" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


# ---- benchmarks/ncu_rows.py: the driver ncu wraps (what bounds a row) -------------------------


def test_ncu_driver_skips_cleanly_without_a_gpu() -> None:
    r = subprocess.run(
        [sys.executable, "benchmarks/ncu_rows.py", "--rows", "gqa_bs1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "skipped, no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("name", ["rmsnorm_linear_bs1", "swiglu_t8_h4096_f14336"])
def test_ncu_driver_feeds_each_candidate_its_own_inputs(name: str) -> None:
    """The operands ncu_rows.py uploads match the program's inputs one by one (shape and
    dtype): the model's weights as stored, lifted constants as lifted, the rest random."""
    from benchmarks import ncu_rows

    (row,) = H.select(H.rows(), name)
    model = row.build()
    kg_b, consts = H.baseline_program(model)
    for kg, c in ((serialize.loads(row.program.read_text()), None), (kg_b, consts)):
        feeds = ncu_rows._inputs(kg, model, c, np.random.default_rng(0))
        assert len(feeds) == len(kg.inputs)
        for arr, node in zip(feeds, kg.inputs):
            assert arr.shape == tuple(node.shape)
            assert arr.dtype == H._NP[node.dtype.value]
        stored = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
        for arr, n in zip(feeds, kg.input_names):
            if n in stored:
                assert np.array_equal(arr, stored[n].astype(arr.dtype)), n
