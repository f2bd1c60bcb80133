"""Writing packaged models: atomic, never over the input, external data when needed."""

from __future__ import annotations

import errno
import os

import numpy as np
import onnx
import pytest

from mlso_cli.errors import InputError
from mlso_cli.package import package_model, standard_metadata, write_model_atomic
from mlso_cli.package import write as write_mod
from tests.test_package_support import attention_mlp, run_cpu, two_regions

META = standard_metadata(targets=["sm_90a"], seed=0, verification_bound="1e-3")
X = np.random.default_rng(2).standard_normal((2, 8, 16)).astype(np.float32)


def packaged() -> onnx.ModelProto:
    model = attention_mlp()
    return package_model(model, two_regions(model), META)


def save_input(tmp_path, external: bool = False):
    model = attention_mlp(ir_version=13)
    path = tmp_path / "in.onnx"
    if external:  # onnx.save converts the proto it is given, so save a copy
        copy = onnx.ModelProto.FromString(model.SerializeToString())
        onnx.save(
            copy, str(path), save_as_external_data=True, location="in.weights", size_threshold=0
        )
    else:
        onnx.save(model, str(path))
    return model, path


def test_writes_and_round_trips(tmp_path):
    out = write_model_atomic(packaged(), tmp_path / "fast.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast.onnx"]
    loaded = onnx.load(str(out))
    assert loaded.ir_version == 13
    onnx.checker.check_model(str(out), full_check=True)
    assert np.array_equal(run_cpu(loaded, {"x": X})[0], run_cpu(attention_mlp(), {"x": X})[0])


def test_refuses_to_overwrite_the_input(tmp_path):
    _, path = save_input(tmp_path)
    before = path.read_bytes()
    with pytest.raises(InputError, match="would overwrite the input"):
        write_model_atomic(packaged(), path, input_path=path)
    with pytest.raises(InputError, match="would overwrite the input"):
        write_model_atomic(packaged(), tmp_path / "." / "in.onnx", input_path=str(path))
    os.link(path, tmp_path / "hardlink.onnx")  # same inode, other name
    with pytest.raises(InputError, match="would overwrite the input"):
        write_model_atomic(packaged(), tmp_path / "hardlink.onnx", input_path=path)
    (tmp_path / "symlink.onnx").symlink_to(path)
    with pytest.raises(InputError, match="would overwrite the input"):
        write_model_atomic(packaged(), tmp_path / "symlink.onnx", input_path=path)
    assert path.read_bytes() == before


def test_refuses_to_overwrite_the_inputs_external_data(tmp_path):
    _, path = save_input(tmp_path, external=True)
    with pytest.raises(InputError, match="external data"):
        write_model_atomic(packaged(), tmp_path / "in.weights", input_path=path)


@pytest.mark.parametrize("where", ["write", "replace"])
def test_a_full_disk_leaves_no_partial_output(tmp_path, monkeypatch, where):
    out = tmp_path / "fast.onnx"
    out.write_bytes(b"previous good output")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "write":
        monkeypatch.setattr(write_mod, "_fsync_write", no_space)
    else:
        monkeypatch.setattr(write_mod.os, "replace", no_space)
    with pytest.raises(OSError) as info:
        write_model_atomic(packaged(), out)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast.onnx"]  # no temp file left
    assert out.read_bytes() == b"previous good output"


def test_external_data_failure_leaves_nothing(tmp_path, monkeypatch):
    _, path = save_input(tmp_path, external=True)
    before = sorted(p.name for p in tmp_path.iterdir())
    real_replace = os.replace
    calls = []

    def fail_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the data file is in place, the model rename fails
            raise OSError(errno.EIO, "I/O error")
        real_replace(src, dst)

    monkeypatch.setattr(write_mod.os, "replace", fail_second)
    with pytest.raises(InputError, match="cannot write"):
        write_model_atomic(packaged(), tmp_path / "fast.onnx", input_path=path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_input_with_external_data_gets_its_own_data_file(tmp_path):
    model, path = save_input(tmp_path, external=True)
    loaded = onnx.load(str(path), load_external_data=False)  # as the loader keeps it
    out = package_model(loaded, two_regions(loaded), META)
    weights_before = (tmp_path / "in.weights").read_bytes()
    write_model_atomic(out, tmp_path / "fast.onnx", input_path=path)
    assert (tmp_path / "fast.onnx.data").is_file()
    assert (tmp_path / "in.weights").read_bytes() == weights_before
    written = onnx.load(str(tmp_path / "fast.onnx"), load_external_data=False)
    locations = {
        e.value for t in written.graph.initializer for e in t.external_data if e.key == "location"
    }
    assert locations == {"fast.onnx.data"}
    bins = [t for t in written.graph.initializer if t.name.startswith("mlso_bin_")]
    assert bins and all(t.HasField("raw_data") for t in bins)  # binaries stay inline
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "fast.onnx"), providers=["CPUExecutionProvider"])
    assert np.array_equal(sess.run(None, {"x": X})[0], run_cpu(model, {"x": X})[0])


def test_input_loaded_in_full_still_gets_external_data(tmp_path):
    model, path = save_input(tmp_path, external=True)
    full = onnx.load(str(path))  # weights read into memory, as optimize does
    write_model_atomic(
        package_model(full, two_regions(full), META), tmp_path / "fast.onnx", input_path=path
    )
    assert (tmp_path / "fast.onnx.data").is_file()


def test_forced_external_data_and_forbidden_inline(tmp_path):
    write_model_atomic(packaged(), tmp_path / "a.onnx", external_data=True)
    assert (tmp_path / "a.onnx.data").stat().st_size > 0
    loaded = onnx.load(str(tmp_path / "a.onnx"))
    assert np.array_equal(run_cpu(loaded, {"x": X})[0], run_cpu(attention_mlp(), {"x": X})[0])
    _, path = save_input(tmp_path, external=True)
    with_external = onnx.load(str(path), load_external_data=False)
    with pytest.raises(InputError, match="external files"):
        write_model_atomic(with_external, tmp_path / "b.onnx", input_path=path, external_data=False)
    with pytest.raises(InputError, match="no input path"):
        write_model_atomic(with_external, tmp_path / "c.onnx")


def test_missing_folder_and_directory_target(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        write_model_atomic(packaged(), tmp_path / "nope" / "fast.onnx")
    with pytest.raises(InputError, match="is a directory"):
        write_model_atomic(packaged(), tmp_path)
