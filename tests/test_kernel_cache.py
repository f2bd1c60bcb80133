"""The nvcc cache (codegen/nvcc.py) checks each entry against its recorded SHA-256 when read.

Why: the cache key hashes what went into nvcc, not what came out, so a fatbin truncated by a
full disk or edited by hand would otherwise be packaged into a model silently. These tests use a
fake nvcc (a script), so they run without the CUDA Toolkit.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from mlso_cli import knobs as knobs_mod
from mlso_cli.codegen import nvcc as nvcc_mod
from mlso_cli.codegen.errors import CompileError

FAKE_NVCC = """#!{python}
import hashlib, pathlib, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("Cuda compilation tools, release 99.0, fake")
    sys.exit(0)
log = pathlib.Path(__file__).with_name("calls")
log.write_text(log.read_text() + "x" if log.exists() else "x")
if pathlib.Path(__file__).with_name("broken").exists():
    print("error: the fake nvcc is broken", file=sys.stderr)
    sys.exit(1)
out = pathlib.Path(args[args.index("-o") + 1])
source = pathlib.Path(args[-1]).read_bytes()
out.write_bytes(b"\\x50\\xed\\x55\\xba" + hashlib.sha256(source).digest() * 16)
"""

SOURCE = 'extern "C" __global__ void mlso_k0(float* x) { x[0] = 1.0f; }\n'


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch) -> Path:
    tool = tmp_path / "bin" / "nvcc"
    tool.parent.mkdir()
    tool.write_text(FAKE_NVCC.format(python=sys.executable))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("MLSO_NVCC", str(tool))
    monkeypatch.setenv("MLSO_CACHE_DIR", str(tmp_path / "cache"))
    knobs_mod.cache_clear()
    nvcc_mod.nvcc_path.cache_clear()
    yield tool
    knobs_mod.cache_clear()
    nvcc_mod.nvcc_path.cache_clear()


def _calls(tool: Path) -> int:
    log = tool.with_name("calls")
    return len(log.read_text()) if log.exists() else 0


def _entry(tmp_path: Path) -> Path:
    (entry,) = (tmp_path / "cache" / "kernels").glob("*.fatbin")
    return entry


def test_a_good_entry_is_served_from_the_cache(fake_nvcc, tmp_path):
    first = nvcc_mod.compile_source(SOURCE, ("sm_90a",))
    assert nvcc_mod.compile_source(SOURCE, ("sm_90a",)) == first and _calls(fake_nvcc) == 1
    entry = _entry(tmp_path)
    assert (
        entry.with_name(entry.name + ".sha256").read_text().strip()
        == nvcc_mod.hashlib.sha256(first).hexdigest()
    )


def test_a_truncated_entry_is_detected_and_rebuilt(fake_nvcc, tmp_path, capsys):
    first = nvcc_mod.compile_source(SOURCE, ("sm_90a",))
    entry = _entry(tmp_path)
    entry.write_bytes(entry.read_bytes()[:100])
    again = nvcc_mod.compile_source(SOURCE, ("sm_90a",))
    assert again == first and len(again) > 100 and _calls(fake_nvcc) == 2
    err = capsys.readouterr().err
    assert "kernel cache entry" in err and "truncated or changed: 100 bytes" in err
    assert "rebuilding it" in err and len(err.strip().splitlines()) == 1
    assert entry.read_bytes() == first  # the cache holds the good entry again


def test_an_entry_without_a_recorded_hash_is_rebuilt(fake_nvcc, tmp_path, capsys):
    nvcc_mod.compile_source(SOURCE, ("sm_90a",))
    entry = _entry(tmp_path)
    entry.with_name(entry.name + ".sha256").unlink()
    nvcc_mod.compile_source(SOURCE, ("sm_90a",))
    assert _calls(fake_nvcc) == 2 and "has no recorded hash" in capsys.readouterr().err


def test_a_bad_entry_that_cannot_be_rebuilt_is_refused_not_returned(fake_nvcc, tmp_path):
    nvcc_mod.compile_source(SOURCE, ("sm_90a",))
    entry = _entry(tmp_path)
    entry.write_bytes(entry.read_bytes()[:100])
    fake_nvcc.with_name("broken").write_text("")
    with pytest.raises(CompileError, match="nvcc failed"):
        nvcc_mod.compile_source(SOURCE, ("sm_90a",))
    assert not entry.exists()  # the bad entry is gone, never served
