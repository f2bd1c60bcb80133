"""A cached rerun of optimize at real width in under 5 s (issue 31), with every outcome as before:
onnx's checker on a view whose large weights are one-element stand-ins refuses what it refused
on the bytes, with the same message; the model to write is hashed while its temp file is written
ahead (package/prefile.py), and the file placed holds the model's serialisation; the loaded
model is packaged in place on the first round and read again for a later one; onnxruntime's
version is read without importing it."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from mlso_cli.errors import InputError
from mlso_cli.frontend import load as load_mod
from mlso_cli.frontend.inference import large_weight
from mlso_cli.package import write as write_mod
from mlso_cli.package import write_model_atomic
from mlso_cli.package.chunks import serialize, serialized_chunks
from mlso_cli.package.prefile import Prefile
from mlso_cli.pipeline import optimize
from mlso_cli.pipeline import run as run_mod
from tests.helpers import ROOT, run_cli
from tests.test_cached_rerun import _model as _unchecked_model
from tests.test_pipeline import SRC, FakeSearch, _opts

ZOO = ROOT / "models" / "zoo_small"


def _model() -> onnx.ModelProto:
    """test_cached_rerun's model (a weight W of 64 x 128 over the strip floor, a 1-D bias over
    it), with the output shape onnx's checker wants."""
    m = _unchecked_model()
    out = m.graph.output[0].type.tensor_type
    for d in (1, 8192):
        out.shape.dim.add().dim_value = d
    return m


def _with_weight(folder: Path) -> Path:
    """The pipeline tests' rmsnorm_linear with its weight W (64 x 96) an initializer: a large
    weight (rank 2, over 4096 elements), so every path of a real-width model is taken."""
    m = onnx.load(SRC)
    w = next(i for i in m.graph.input if i.name == "W")
    m.graph.input.remove(w)
    rng = np.random.default_rng(0)
    m.graph.initializer.append(
        numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32), "W")
    )
    path = folder / "rl_w.onnx"
    onnx.save(m, path)
    return path


def _temps(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if ".mlso-tmp." in p.name]


# --- onnx's checker on a view of the weights ----------------------------------------------


def test_the_checker_is_given_a_view_with_a_stand_in_for_each_large_weight(monkeypatch):
    data = _model().SerializeToString()
    seen = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a: seen.append(m) or real(m, *a))
    model = onnx.load_model_from_string(data)
    load_mod._check(model, "m.onnx", "m.onnx", data)
    (view,) = seen
    assert isinstance(view, onnx.ModelProto)
    stand_ins = {t.name: t for t in view.graph.initializer}
    for t in model.graph.initializer:
        if large_weight(t):
            assert list(stand_ins[t.name].dims) == [1] * len(t.dims)
            assert len(stand_ins[t.name].raw_data) == 4
        else:
            assert stand_ins[t.name] == t
    weights = sum(len(t.raw_data) for t in model.graph.initializer if large_weight(t))
    assert weights and len(view.SerializeToString()) < len(data) - weights + 64


def _corrupt(kind: str) -> onnx.ModelProto:
    m = _model()
    w = next(t for t in m.graph.initializer if t.name == "W")
    if kind == "raw_data too short":
        w.raw_data = w.raw_data[:-4]
    elif kind == "raw_data too long":
        w.raw_data = w.raw_data + b"\0" * 4
    elif kind == "a STRING tensor in raw_data":
        w.data_type = TensorProto.STRING
    elif kind == "raw_data and float_data":
        w.float_data.append(1.0)
    elif kind == "UNDEFINED type":
        w.data_type = TensorProto.UNDEFINED
    elif kind == "external, with raw_data":
        w.data_location = TensorProto.EXTERNAL
    elif kind == "negative dims":
        w.dims[:] = [-64, -128]
    elif kind == "a zero dim":
        w.dims[:] = [0, 64, 128]
    elif kind == "a name given twice":
        m.graph.initializer.append(w)
    elif kind == "an int4 weight":
        w.data_type = TensorProto.INT4
    elif kind == "an unnamed weight":
        w.name = ""
    else:
        raise AssertionError(kind)
    return m


CORRUPTIONS = [
    "raw_data too short",
    "raw_data too long",
    "a STRING tensor in raw_data",
    "raw_data and float_data",
    "UNDEFINED type",
    "external, with raw_data",
    "negative dims",
    "a zero dim",
    "a name given twice",
    "an int4 weight",
    "an unnamed weight",
]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_bad_weight_is_refused_as_the_checker_refuses_the_bytes(kind):
    data = _corrupt(kind).SerializeToString()
    try:
        onnx.checker.check_model(data)
        expected = None
    except onnx.checker.ValidationError as exc:
        first = next(ln for ln in str(exc).splitlines() if ln.strip())
        expected = f"m.onnx is not a valid ONNX model: {first}"
    model = onnx.load_model_from_string(data)
    if expected is None:
        load_mod._check(model, "m.onnx", "m.onnx", data)
        return
    with pytest.raises(InputError) as info:
        load_mod._check(model, "m.onnx", "m.onnx", data)
    assert info.value.what == expected


def test_a_refused_model_is_named_as_before_through_the_cli(tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(_corrupt("raw_data too short").SerializeToString())
    r = run_cli("inspect", str(path))
    assert r.returncode == 1
    assert f"{path} is not a valid ONNX model: TensorProto (tensor name: W) raw_data size" in (
        r.stderr.decode()
    )


def test_the_raw_data_sizes_are_read_from_the_wire():
    for path in sorted(ZOO.glob("*.onnx")):
        data = path.read_bytes()
        m = onnx.load_model_from_string(data)
        sizes = load_mod._raw_data_sizes(data)
        assert sizes == [
            (t.name.encode(), len(t.raw_data) if t.HasField("raw_data") else None)
            for t in m.graph.initializer
        ], path.name
    data = _model().SerializeToString()
    graph = onnx.ModelProto()
    graph.graph.name = "again"
    assert load_mod._raw_data_sizes(data + graph.SerializeToString()) is None  # merged graphs
    assert load_mod._raw_data_sizes(data[:-3]) is None  # cut short


def test_a_model_whose_graph_is_given_twice_is_checked_on_its_bytes(monkeypatch):
    m = _model()
    extra = onnx.ModelProto()
    extra.graph.doc_string = "merged into the graph"
    data = m.SerializeToString() + extra.SerializeToString()
    seen = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda x, *a: seen.append(x) or real(x, *a))
    load_mod._check(onnx.load_model_from_string(data), "m.onnx", "m.onnx", data)
    assert seen == [data]


# --- the model hashed, its pieces kept for the write ---------------------------------------


def test_the_sha256_and_the_pieces_are_the_serialisation():
    m = _model()
    s = serialize(m)
    whole = m.SerializeToString()
    assert s.sha256 == hashlib.sha256(whole).hexdigest()
    assert b"".join(s.pieces_for(m)) == whole
    m.metadata_props.add(key="mlso.verification_bound", value="0.5")  # set after the check
    assert b"".join(s.pieces_for(m)) == m.SerializeToString()
    other = onnx.ModelProto()
    other.CopyFrom(m)
    assert s.pieces_for(other) is None
    w = next(t for t in m.graph.initializer if t.name == "W")
    w.name = "W2"  # a weight's other fields changed: its bytes are taken again
    assert b"".join(s.pieces_for(m)) == m.SerializeToString()


def test_a_weight_of_another_size_than_its_dims_is_serialised_whole():
    m = _model()
    w = next(t for t in m.graph.initializer if t.name == "W")
    w.raw_data = w.raw_data + b"\0" * 8
    s = serialize(m)
    assert s.sha256 == hashlib.sha256(m.SerializeToString()).hexdigest()
    assert b"".join(serialized_chunks(m)) == m.SerializeToString()
    assert b"".join(s.pieces_for(m)) == m.SerializeToString()


def test_two_weights_alike_but_for_their_bytes_keep_their_own_bytes():
    m = _model()
    w = next(t for t in m.graph.initializer if t.name == "W")
    twin = m.graph.initializer.add()
    twin.CopyFrom(w)
    twin.raw_data = bytes(len(w.raw_data))
    s = serialize(m)
    assert b"".join(s.pieces_for(m)) == m.SerializeToString()


# --- the temp file written ahead ---------------------------------------------------------------


def _pieces() -> list[bytes]:
    return [b"head", os.urandom(3 << 20), b"middle", os.urandom(1 << 20), b"tail"]


def test_a_file_written_ahead_is_finished_with_what_differs(tmp_path):
    out = tmp_path / "m.onnx"
    pieces = _pieces()
    with Prefile(out) as pre:
        for p in pieces:
            pre(p)
        payload = [*pieces[:-1], b"another tail, longer"]
        tmp = pre.finish(payload)
        assert tmp is not None and Path(tmp).read_bytes() == b"".join(payload)
        mode = os.stat(tmp).st_mode & 0o777
        assert mode == 0o666 & ~write_mod.current_umask()
        os.unlink(tmp)
    assert not _temps(tmp_path)


def test_a_file_written_ahead_for_other_bytes_is_removed(tmp_path):
    with Prefile(tmp_path / "m.onnx") as pre:
        for p in _pieces():
            pre(p)
        assert len(_temps(tmp_path)) == 1
        assert pre.finish([b"other", b"bytes"]) is None
        assert not _temps(tmp_path)


def test_the_file_written_ahead_is_removed_on_any_way_out(tmp_path):
    with pytest.raises(RuntimeError), Prefile(tmp_path / "m.onnx") as pre:
        pre(b"x" * 1000)
        assert _temps(tmp_path)
        raise RuntimeError("the run failed")
    assert not _temps(tmp_path)


def test_sigterm_removes_the_file_written_ahead_then_does_what_it_did(tmp_path):
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))
    try:
        with Prefile(tmp_path / "m.onnx") as pre:
            pre(b"x" * 1000)
            assert signal.getsignal(signal.SIGTERM) == pre._on_signal
            signal.raise_signal(signal.SIGTERM)
            assert calls == [signal.SIGTERM] and not _temps(tmp_path)
            assert signal.getsignal(signal.SIGTERM) != pre._on_signal
            pre(b"after")  # discarded: nothing is written again
            assert not _temps(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_still_ends_the_process_and_leaves_no_temp_file(tmp_path):
    code = (
        "import os, signal, sys, time\n"
        "from mlso_cli.package.prefile import Prefile\n"
        f"pre = Prefile({str(tmp_path / 'm.onnx')!r})\n"
        "pre(b'x' * 1000)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(10)\n"
        "sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
    assert r.returncode == -signal.SIGTERM
    assert not _temps(tmp_path)


# --- optimize and its write, end to end -------------------------------------------------------


def _run_and_write(src: Path, out: Path, tmp_path: Path, monkeypatch) -> tuple[object, int]:
    """optimize as the CLI runs it (the file written ahead, the write), and how many temp
    files were written from scratch."""
    fresh = []
    real = write_mod._fsync_write
    monkeypatch.setattr(write_mod, "_fsync_write", lambda *a: fresh.append(1) or real(*a))
    with Prefile(out) as pre:
        outcome = optimize(str(src), None, _opts(tmp_path), search=FakeSearch(), tee=pre)
        write_model_atomic(
            outcome.model, out, input_path=src, serialized=outcome.serialized, prefile=pre
        )
    return outcome, len(fresh)


def test_a_cached_rerun_places_the_file_written_ahead_with_the_same_bytes(tmp_path, monkeypatch):
    src = _with_weight(tmp_path)
    first, fresh = _run_and_write(src, tmp_path / "a.onnx", tmp_path, monkeypatch)
    assert not first.verdict_cached and first.serialized is None and fresh == 1
    second, fresh = _run_and_write(src, tmp_path / "b.onnx", tmp_path, monkeypatch)
    assert second.verdict_cached and second.serialized is not None and fresh == 0
    a, b = (tmp_path / "a.onnx").read_bytes(), (tmp_path / "b.onnx").read_bytes()
    assert a == b == second.model.SerializeToString()
    assert any(large_weight(t) for t in second.model.graph.initializer)
    assert not _temps(tmp_path)
    third = optimize(str(src), None, _opts(tmp_path, use_cache=False), search=FakeSearch())
    assert third.model.SerializeToString() == a  # the same bytes with the caches off


def test_replacing_a_large_output_writes_the_new_bytes(tmp_path, monkeypatch):
    out = tmp_path / "m.onnx"
    big = _model()
    write_model_atomic(big, out)
    os.link(out, tmp_path / "second name")  # held by another name: not held to be released
    monkeypatch.setattr(write_mod, "_SMALL_MODEL", 1024)  # the held-and-released path here
    write_model_atomic(big, out, replace=True)
    other = _model()
    other.doc_string = "replaced"
    write_model_atomic(other, out, replace=True)
    assert out.read_bytes() == other.SerializeToString()
    assert (tmp_path / "second name").read_bytes() == big.SerializeToString()
    assert not _temps(tmp_path)


def test_the_cli_rerun_writes_the_same_bytes_and_says_the_checks_were_reused(tmp_path):
    src = _with_weight(tmp_path)
    env = {"MLSO_CACHE_DIR": str(tmp_path / "cache")}
    args = ("--max-states", "200", "--seed", "1", "--min-speedup", "0")
    r1 = run_cli("optimize", str(src), "-o", str(tmp_path / "a.onnx"), *args, env=env)
    assert r1.returncode == 0, r1.stderr
    r2 = run_cli("optimize", str(src), "-o", str(tmp_path / "a.onnx"), "--force", *args, env=env)
    assert r2.returncode == 0, r2.stderr
    assert "checks before writing reused" in r2.stderr.decode()
    r3 = run_cli("optimize", str(src), "-o", str(tmp_path / "b.onnx"), *args, env=env)
    assert r3.returncode == 0, r3.stderr
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert not _temps(tmp_path)


# --- the loaded model packaged in place -------------------------------------------------------


def test_the_first_round_packages_the_loaded_model_of_a_file_itself(tmp_path, monkeypatch):
    import mlso_cli.package.assemble as assemble_mod

    copies = []
    real = assemble_mod.assemble
    monkeypatch.setattr(
        assemble_mod, "assemble", lambda *a, copy=True: copies.append(copy) or real(*a, copy=copy)
    )
    src = _with_weight(tmp_path)
    optimize(str(src), None, _opts(tmp_path, use_cache=False), search=FakeSearch())
    assert copies == [False]
    loaded = load_mod.load_model(str(src), digest=True)
    assert not run_mod._rereadable("-", loaded)
    assert run_mod._rereadable(str(src), loaded)
    assert not run_mod._rereadable(str(src), load_mod.load_model(str(src)))  # bytes not hashed


def test_a_later_round_refuses_a_file_changed_meanwhile(tmp_path):
    from mlso_cli.pipeline.frontend import lift

    src = _with_weight(tmp_path)
    lifted = lift(str(src))
    again = run_mod._reload(str(src), None, lifted)
    assert again.model.SerializeToString() == lifted.loaded.model.SerializeToString()
    m = onnx.load(src)
    m.doc_string = "written again while optimize ran"
    onnx.save(m, src)
    with pytest.raises(InputError, match="changed while optimize ran"):
        run_mod._reload(str(src), None, lifted)


# --- onnxruntime's version --------------------------------------------------------------------


def test_onnxruntime_s_version_is_read_without_importing_it():
    code = (
        "import sys\n"
        "from mlso_cli.package.irversion import installed_ort_version\n"
        "v = installed_ort_version()\n"
        "imported = 'onnxruntime' in sys.modules\n"
        "import onnxruntime\n"
        "assert v == onnxruntime.__version__, (v, onnxruntime.__version__)\n"
        "print(imported)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == "False"
