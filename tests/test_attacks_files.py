"""A hostile user and the file system: every attack ends with its documented exit code, one line on
stderr (no traceback), and no partial or stray file.

Attacks on the writer itself run it in a small subprocess (python -c) instead of a whole optimize,
so that races and signals stay fast; the CLI attacks use the smallest models the CLI tests use.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap

import onnx
import pytest

from mlso_cli.errors import InputError
from mlso_cli.package.write import write_model_atomic
from tests.helpers import ROOT, SMALL, attention_model, run_cli

GQA = next(p for p in SMALL if p.stem == "gqa")
FAST = ["--max-states", "2000", "--jobs", "1", "--min-speedup", "0"]


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    err = r.stderr.decode()
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlso: error:"), err
    return lines[0]


def _python(script: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# 1. -o is a regular file or a new path; never a symlink, device, FIFO or directory, even with --force


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_output_that_is_not_a_regular_file_is_refused_even_with_force(tmp_path, kind):
    target = tmp_path / "target.onnx"
    target.write_bytes(b"keep me")
    out = tmp_path / "out.onnx"
    if kind == "symlink":
        out.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(out)
    else:
        out.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run_cli("optimize", str(GQA), "-o", str(out), "--force", *FAST)
    assert r.returncode == 1
    line = _one_line_error(r)
    assert {"symlink": "symbolic link", "fifo": "not a regular file", "directory": "directory"}[
        kind
    ] in line
    assert r.stdout == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert target.read_bytes() == b"keep me"
    mode = os.lstat(out).st_mode
    assert {"symlink": stat.S_ISLNK, "fifo": stat.S_ISFIFO, "directory": stat.S_ISDIR}[kind](mode)


def test_writer_refuses_a_symlink_or_fifo_even_when_replacing(tmp_path):
    """The writer checks again itself, right before placing: a link planted after the CLI's check."""
    target = tmp_path / "target.onnx"
    target.write_bytes(b"keep me")
    (tmp_path / "link.onnx").symlink_to(target)
    os.mkfifo(tmp_path / "fifo.onnx")
    for name in ("link.onnx", "fifo.onnx"):
        with pytest.raises(InputError, match="symbolic link|not a regular file"):
            write_model_atomic(attention_model(), tmp_path / name, replace=True)
    assert target.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.onnx", "link.onnx", "target.onnx"]


# 2. temp files: removed on SIGTERM/SIGHUP, and stale ones of killed runs removed by the next write


def test_stale_temp_files_of_dead_runs_are_removed(tmp_path):
    dead = tmp_path / f".fast.onnx.mlso-tmp.{_dead_pid()}.abc_123"
    dead.write_bytes(b"half a model")
    dead_data = tmp_path / f".fast.onnx.data.mlso-tmp.{_dead_pid()}.x9y8z7"
    dead_data.write_bytes(b"half the weights")
    alive = tmp_path / f".fast.onnx.mlso-tmp.{os.getppid()}.live01"  # a run still writing
    alive.write_bytes(b"in flight")
    other = tmp_path / ".notes.mlso-tmp.1.txt.bak"  # not our pattern: never touched
    other.write_bytes(b"mine")
    write_model_atomic(attention_model(), tmp_path / "fast.onnx", replace=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["fast.onnx", alive.name, other.name]
    )


def _stalled_optimize(out, disposition: str):
    """optimize through the CLI in a child whose serializer stalls half-way, after setting the
    child's handling of a signal (`disposition`, a line of Python); returns once it is writing."""
    proc = _python(f"""
        import signal, sys, time
        {disposition}
        from mlso_cli.package import write as w
        def stalled(path, chunks):
            with open(path, "wb") as f:
                f.write(b"half")
                f.flush()
            print("writing", flush=True)
            time.sleep(60)
        w._fsync_write = stalled
        from mlso_cli.cli import main
        main(["optimize", {str(GQA)!r}, "-o", {str(out)!r}, *{FAST!r}])
    """)
    line = proc.stdout.readline()
    assert line == b"writing\n", proc.stderr.read()
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_stop_signal_during_a_write_leaves_no_temp_file(tmp_path, signum):
    """optimize through the CLI, with a serializer that stalls half-way; the signal arrives then.
    A signal the test process inherited as ignored (a run under nohup ignores SIGHUP) stays
    ignored by design, so the child resets the one it is sent."""
    proc = _stalled_optimize(tmp_path / "fast.onnx", f"signal.signal({signum}, signal.SIG_DFL)")
    assert [p.name for p in tmp_path.iterdir() if ".mlso-tmp." in p.name]  # the temp is there now
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=90)  # generous: the suite runs on two busy workers
    assert proc.returncode == 1
    errors = [line for line in err.decode().splitlines() if line.startswith("mlso: error:")]
    assert (
        b"Traceback" not in err and len(errors) == 1
    )  # (warnings, e.g. a cache rebuild, may precede it)
    assert signal.Signals(signum).name in errors[0]
    assert list(tmp_path.iterdir()) == []


def test_a_hangup_ignored_by_the_parent_stays_ignored_during_a_write(tmp_path):
    """Under nohup SIGHUP arrives ignored: the write keeps it so (the run goes on), and a
    SIGTERM still stops it cleanly, temp file removed."""
    proc = _stalled_optimize(tmp_path / "fast.onnx", "signal.signal(signal.SIGHUP, signal.SIG_IGN)")
    proc.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=2)  # ignored: still writing
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and b"SIGTERM" in err
    assert list(tmp_path.iterdir()) == []


# 3. without --force, OUT is created, never replaced: of four runs racing for it, one wins


def test_four_parallel_writers_of_one_output_exactly_one_wins(tmp_path):
    out = tmp_path / "fast.onnx"
    go = tmp_path / "go"
    script = f"""
        import os, sys, time
        from mlso_cli.errors import MlsoError
        from mlso_cli.package import write as w
        from tests.helpers import attention_model
        real = w._fsync_write
        def slow(path, chunks):  # every writer is past the early check before any places OUT
            real(path, chunks)
            time.sleep(0.5)
        w._fsync_write = slow
        model = attention_model()
        model.doc_string = str(os.getpid())
        print("ready", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        try:
            w.write_model_atomic(model, {str(out)!r}, replace=False)
        except MlsoError as exc:
            print("mlso: error: " + exc.one_line(), file=sys.stderr)
            sys.exit(int(exc.exit_code))
    """
    procs = [_python(script) for _ in range(4)]
    for p in procs:
        assert p.stdout.readline() == b"ready\n"
    go.write_bytes(b"")
    results = [(p, *p.communicate(timeout=60)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 1, 1, 1], [e for _, _, e in results]
    for p, _, err in results:
        if p.returncode == 1:
            line = _one_line_error(subprocess.CompletedProcess([], 1, b"", err))
            assert "already exists" in line and "--force" in line
    winner = next(p for p, _, _ in results if p.returncode == 0)
    assert onnx.load(str(out)).doc_string == str(winner.pid)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast.onnx", "go"]


# 4. output modes follow the umask (mkstemp alone would leave 0600)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_output_mode_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_model_atomic(attention_model(), tmp_path / "a.onnx")
        write_model_atomic(attention_model(), tmp_path / "b.onnx", external_data=True)
    finally:
        os.umask(old)
    for name in ("a.onnx", "b.onnx", "b.onnx.data"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == mode, name


# 5. determinism: names lifting gives constants depend on their content, not on hash()'s salt


def _masked_softmax(path) -> None:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    mask = np.tril(np.ones((4, 8), dtype=bool))
    graph = helper.make_graph(
        [
            helper.make_node("Where", ["mask", "x", "ninf"], ["m"]),
            helper.make_node("Softmax", ["m"], ["y"], axis=-1),
        ],
        "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        [
            numpy_helper.from_array(mask, "mask"),
            numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, str(path))


def test_lifted_mask_names_do_not_depend_on_the_hash_seed(tmp_path):
    path = tmp_path / "masked.onnx"
    _masked_softmax(path)
    script = f"""
        from mlso_cli.frontend.lift import lift_whole_graph
        from mlso_cli.frontend.load import load_model
        lifted = lift_whole_graph(load_model({str(path)!r}))
        print(sorted(lifted.extra_inputs), lifted.graph.input_names)
    """
    outs = []
    for seed in ("1", "2"):
        r = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)],
            cwd=ROOT,
            capture_output=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed},
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] and b"mlso_mask_" in outs[0]


# 6. one-line errors with the documented exit code, never a traceback or a hang


def _external_model(tmp_path):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "ext",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
        [numpy_helper.from_array(np.ones((64, 64), np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    path = tmp_path / "ext.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="ext.data", size_threshold=0)
    data = tmp_path / "ext.data"
    data.write_bytes(data.read_bytes()[:100])
    return path


def _attack_files(tmp_path):
    os.mkfifo(tmp_path / "fifo.onnx")
    (tmp_path / "trunc.onnx").write_bytes(GQA.read_bytes()[:300])
    _external_model(tmp_path)
    onnx.save(attention_model(extra_unknown=True), str(tmp_path / "unknown.onnx"))


_G = str(GQA)
ATTACKS = [  # (args, exit code, a word the one line must hold)
    (["optimize", _G, "--dry-run", "--seed", "-1"], 2, "--seed"),
    (["verify", _G, _G, "--seed", "-1"], 2, "--seed"),
    (["verify", _G, _G, "--samples", "0"], 2, "--samples"),
    (["verify", _G, _G, "--rtol", "-1"], 2, "--rtol"),
    (["verify", _G, _G, "--atol", "nan"], 2, "--atol"),
    (["inspect", "/dev/zero"], 1, "not a regular file"),
    (["inspect", "{tmp}/fifo.onnx"], 1, "not a regular file"),
    (["verify", "{tmp}/fifo.onnx", _G], 1, "not a regular file"),
    (["verify", "{tmp}/trunc.onnx", _G], 1, "truncated"),
    (["verify", "{tmp}/ext.onnx", "{tmp}/ext.onnx"], 1, "truncated"),
    (["inspect", _G, "--input-shape", "Q=4000000000,16,8"], 2, "--input-shape"),
    (["inspect", _G, "--input-shape", "Q=4e9,16,8"], 2, "--input-shape"),
    (["verify", "{tmp}/unknown.onnx", "{tmp}/unknown.onnx"], 1, "FancyOp"),
]


@pytest.mark.parametrize(
    ("args", "code", "word"), ATTACKS, ids=[" ".join(a[0][:1] + a[0][2:]) for a in ATTACKS]
)
def test_bad_flags_and_files_give_one_line_errors(tmp_path, args, code, word):
    _attack_files(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    r = subprocess.run(
        [sys.executable, "-m", "mlso_cli", *(a.format(tmp=tmp_path) for a in args)],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == code, r.stderr
    assert word in _one_line_error(r)
    assert r.stdout == b"" and sorted(p.name for p in tmp_path.iterdir()) == before


def test_closed_stdin_is_an_error_not_a_traceback():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for stdin in ("closed", subprocess.DEVNULL):
        kw = (
            {"stdin": subprocess.DEVNULL}
            if stdin != "closed"
            else {"preexec_fn": lambda: os.close(0)}
        )
        r = subprocess.run(
            [sys.executable, "-m", "mlso_cli", "inspect", "-"],
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            env=env,
            **kw,
        )
        assert r.returncode == 1
        assert "stdin" in _one_line_error(r)


def test_gpu_flag_without_a_gpu_is_exit_4_for_every_command(tmp_path):
    from mlso_cli.runtime import gpu_info

    if gpu_info(0) is not None:
        pytest.skip("this machine has a GPU")
    out = tmp_path / "o.onnx"
    for args in (
        ["optimize", _G, "-o", str(out), "--gpu", "0"],
        ["bench", _G, _G, "--gpu", "0"],
        ["verify", _G, _G, "--gpu", "0"],
    ):
        r = run_cli(*args)
        assert r.returncode == 4, (args, r.stderr)
        assert "GPU" in _one_line_error(r)
    assert list(tmp_path.iterdir()) == []
