"""The CLI as a user runs it: a subprocess, exit codes, stdout JSON only with --json."""

from __future__ import annotations

import json

from tests.helpers import SMALL, TRANSFORMER, TRANSFORMER_SHAPE, attention_model, run_cli, save


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and "mlso" in r.stdout.decode()


def test_inspect_json_one_object_per_region():
    path = next(p for p in SMALL if p.stem == "gqa")
    r = run_cli("inspect", str(path), "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    regions = [x for x in rows if x["type"] == "region"]  # left_out rows name its Constants
    assert len(regions) == 1
    obj = regions[0]
    assert obj["label"] == "attention" and obj["ops"] == {"MatMul": 2, "Softmax": 1}
    assert obj["dram_bytes_fused_min"] < obj["dram_bytes_unfused"] and obj["flops"] > 0


def test_inspect_without_json_keeps_stdout_empty():
    r = run_cli("inspect", str(TRANSFORMER), *TRANSFORMER_SHAPE)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b""
    r = run_cli("-v", "inspect", str(TRANSFORMER), *TRANSFORMER_SHAPE)
    assert r.stdout == b"" and b"fusable region" in r.stderr and b"left out" in r.stderr


def test_inspect_transformer_json():
    r = run_cli("inspect", str(TRANSFORMER), *TRANSFORMER_SHAPE, "--json")
    assert r.returncode == 0
    objs = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert len([o for o in objs if o["type"] == "region"]) >= 4
    assert {o["type"] for o in objs} == {"region", "split", "left_out"}


def test_stdin_model():
    r = run_cli("inspect", "-", "--json", stdin=attention_model().SerializeToString())
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert [x["type"] for x in rows].count("region") == 1


def test_exit_codes_for_bad_input(tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(bytes(range(256)) * 20)
    for path in (empty, junk, tmp_path / "missing.onnx"):
        r = run_cli("inspect", str(path))
        assert r.returncode == 1
        err = r.stderr.decode().strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mlso: error:")
        assert r.stdout == b""


def test_exit_code_for_open_dimension(tmp_path):
    path = save(attention_model(dynamic=True), tmp_path / "dyn.onnx")
    r = run_cli("inspect", str(path))
    assert r.returncode == 2
    assert b"--input-shape" in r.stderr and b"'Q'" in r.stderr
    r = run_cli(
        "inspect",
        str(path),
        "--input-shape",
        "Q=2,16,8",
        "--input-shape",
        "K=2,8,32",
        "--input-shape",
        "V=2,32,8",
        "--json",
    )
    assert r.returncode == 0


def test_usage_error_exit_code():
    assert run_cli("inspect").returncode == 2
    assert run_cli("no-such-command").returncode == 2


def test_optimize_flag_errors_are_usage_errors(tmp_path):
    src = str(SMALL[0])
    out = str(tmp_path / "o.onnx")
    cases = [
        [src],  # no -o and no --dry-run
        [src, "-o", out, "--budget", "0"],
        [src, "-o", out, "--max-states", "0"],
        [src, "-o", out, "--jobs", "0"],
        [src, "-o", out, "--min-speedup", "-1"],
    ]
    for args in cases:
        r = run_cli("optimize", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.decode().strip().splitlines()) == 1 and r.stdout == b""
    assert not list(tmp_path.iterdir())


def test_unknown_op_reported(tmp_path):
    path = save(attention_model(extra_unknown=True), tmp_path / "u.onnx")
    r = run_cli("-v", "inspect", str(path))
    assert r.returncode == 0
    assert b"FancyOp" in r.stderr and b"com.example" in r.stderr


def _perturbed(path, tmp_path, factor=1.01):
    import onnx
    from onnx import helper

    m = onnx.load(str(path))
    out = m.graph.output[0].name
    m.graph.node[-1].output[0] = out + "_raw"
    m.graph.node.append(helper.make_node("Mul", [out + "_raw", "mlso_test_k"], [out]))
    m.graph.initializer.append(
        helper.make_tensor("mlso_test_k", onnx.TensorProto.FLOAT, [], [factor])
    )
    p = tmp_path / "b.onnx"
    onnx.save(m, str(p))
    return p


def test_verify_passes_identical_and_fails_perturbed(tmp_path):
    import json

    a = next(p for p in SMALL if p.stem == "gqa")
    r = run_cli("verify", str(a), str(a), "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert rows[-1]["type"] == "summary" and rows[-1]["pass"] is True
    assert all(x["rel_err_b"] <= 1e-5 for x in rows[:-1])
    b = _perturbed(a, tmp_path)
    r = run_cli("verify", str(a), str(b), "--json")
    assert r.returncode == 3
    assert b"relative error" in r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert rows[-1]["pass"] is False and any(0.005 < x["rel_err_b"] < 0.02 for x in rows[:-1])


def test_verify_elementwise_tolerances(tmp_path):
    a = next(p for p in SMALL if p.stem == "rmsnorm_linear")
    b = _perturbed(a, tmp_path, factor=1.000001)
    # B is another function (a weight scaled by 1 + 1e-6): the algebraic check refuses it, so
    # the tolerances are tested with --numeric, which accepts numerical equivalence
    assert run_cli("verify", str(a), str(b), "--scales", "1").returncode == 3
    assert run_cli("verify", str(a), str(b), "--scales", "1", "--numeric").returncode == 0
    r = run_cli(
        "verify", str(a), str(b), "--scales", "1", "--numeric", "--atol", "0", "--rtol", "O=1e-9"
    )
    assert r.returncode == 3 and b"algebraic" not in r.stderr.split(b"error:")[-1]
    assert run_cli("verify", str(a), str(b), "--rtol", "abc").returncode == 2


def test_verify_shrinks_inputs_whose_outputs_overflow_float16(tmp_path):
    """Weights fed as graph inputs at N(0, 1) overflow a float16 output at every default scale
    ((X W1)^2 W2 with 1024-wide contractions: about 2e5 at scale 1). No output was comparable,
    and verify used to exit 3 (verification failed) on a model checked against itself. It now
    shrinks the inputs until the outputs are representable, and says which scale it used; with
    nothing comparable at all it is an error (exit 1), not a failed verification."""
    from onnx import TensorProto, helper

    h = 1024
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["a"]),
        helper.make_node("Mul", ["a", "a"], ["s"]),
        helper.make_node("MatMul", ["s", "W2"], ["O"]),
    ]
    ins = [
        helper.make_tensor_value_info("X", TensorProto.FLOAT16, [2, h]),
        helper.make_tensor_value_info("W1", TensorProto.FLOAT16, [h, h]),
        helper.make_tensor_value_info("W2", TensorProto.FLOAT16, [h, h]),
    ]
    out = [helper.make_tensor_value_info("O", TensorProto.FLOAT16, [2, h])]
    m = helper.make_model(
        helper.make_graph(nodes, "overflow", ins, out), opset_imports=[helper.make_opsetid("", 17)]
    )
    m.ir_version = 8  # what ONNX Runtime loads
    path = save(m, tmp_path / "overflow.onnx")
    r = run_cli("verify", str(path), str(path), "--json", "--seed", "1")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    compared = [x for x in rows if x["type"] == "output"]
    assert compared and all(x["scale"] < 1 and x["pass"] for x in compared)
    # an output no scale can make finite (log of zero): nothing to compare is an error
    nodes = [
        helper.make_node("Sub", ["X", "X"], ["z"]),
        helper.make_node("Log", ["z"], ["O"]),
    ]
    ins = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 4])]
    out = [helper.make_tensor_value_info("O", TensorProto.FLOAT, [2, 4])]
    m = helper.make_model(
        helper.make_graph(nodes, "log0", ins, out), opset_imports=[helper.make_opsetid("", 17)]
    )
    m.ir_version = 8
    path = save(m, tmp_path / "log0.onnx")
    r = run_cli("verify", str(path), str(path), "--seed", "1")
    assert r.returncode == 1 and b"could not compare A and B" in r.stderr, r.stderr


def test_verify_layernorm_model_against_itself(tmp_path):
    """GPT-2-style exports spell LayerNormalization with stash_type=1; the fp64 reference used to
    rewrite it to DOUBLE, which onnx's evaluator refuses, so verify crashed with a traceback."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    rng = np.random.default_rng(0)
    g = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "g")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    n = helper.make_node(
        "LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5, stash_type=1
    )
    m = helper.make_model(
        helper.make_graph([n], "ln", [x], [y], [g, b]), opset_imports=[helper.make_opsetid("", 17)]
    )
    m.ir_version = 8  # what ONNX Runtime loads
    p = tmp_path / "ln.onnx"
    onnx.save(m, str(p))
    r = run_cli("verify", str(p), str(p), "--json")
    assert r.returncode == 0, r.stderr
    assert b"Traceback" not in r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert rows[-1]["pass"] is True


def test_reference_layernorm_is_float64():
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from mlso_cli.verify.reference64 import reference_outputs

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 16])
    g = numpy_helper.from_array(np.ones(16, np.float32), "g")
    n = helper.make_node(
        "LayerNormalization", ["x", "g"], ["y"], axis=-1, epsilon=1e-5, stash_type=1
    )
    m = helper.make_model(
        helper.make_graph([n], "ln", [x], [y], [g]), opset_imports=[helper.make_opsetid("", 17)]
    )
    xs = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    got = reference_outputs(m, {"x": xs})["y"]
    x64 = xs.astype(np.float64)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    assert got.dtype == np.float64 and np.abs(got - want).max() < 1e-12


def _int_model(path, const: int) -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.INT64, [4])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [4])
    c = helper.make_tensor("c", TensorProto.INT64, [], [const])
    m = helper.make_model(
        helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "ints", [x], [y], [c]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    m.ir_version = 8
    onnx.save(m, str(path))


def test_verify_compares_integer_outputs_exactly(tmp_path):
    """100000 against 100001 is a relative error of 1e-5: within a float limit, but wrong."""
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    _int_model(a, 100000)
    _int_model(b, 100001)
    assert run_cli("verify", str(a), str(a)).returncode == 0
    r = run_cli("verify", str(a), str(b))
    assert r.returncode == 3 and b"Traceback" not in r.stderr


def _embedding_model(path, table) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, table.shape[1]])
    node = helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)
    m = helper.make_model(
        helper.make_graph([node], "emb", [ids], [y], [numpy_helper.from_array(table, "table")]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    m.ir_version = 8
    onnx.save(m, str(path))


def test_verify_draws_indices_over_the_whole_table(tmp_path):
    """Rows 2..999 of an embedding shifted: integer inputs drawn from {0, 1} never saw them."""
    import numpy as np

    table = np.random.default_rng(0).standard_normal((1000, 8)).astype(np.float32)
    shifted = table.copy()
    shifted[2:] += 1.0
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    _embedding_model(a, table)
    _embedding_model(b, shifted)
    assert run_cli("verify", str(a), str(a)).returncode == 0
    assert run_cli("verify", str(a), str(b)).returncode == 3


def test_verify_seed_is_fresh_unless_given(tmp_path):
    """The default seed is drawn from the OS each run and reported, so a μGraph cannot be tuned to
    a public seed; --seed makes a run repeatable."""
    a = tmp_path / "a.onnx"
    _int_model(a, 3)
    seeds = []
    for extra in ([], [], ["--seed", "7"]):
        r = run_cli("verify", str(a), str(a), "--json", *extra)
        assert r.returncode == 0, r.stderr
        seeds.append(json.loads(r.stdout.decode().splitlines()[-1])["seed"])
    assert seeds[0] != seeds[1] and seeds[2] == 7


def test_optimize_help_states_the_search_budget_in_force():
    """--help names the per-signature budget the search uses, so the two cannot drift apart."""
    from mlso_cli.search.api import DEFAULT_STATES_CAP, STATES_PER_SIGNATURE

    r = run_cli("optimize", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.decode().split())
    assert f"[default: {STATES_PER_SIGNATURE:,} per tiling of the region" in text
    assert f"up to {DEFAULT_STATES_CAP:,} in all" in text
