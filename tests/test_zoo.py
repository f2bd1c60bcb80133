"""The model zoo (models/zoo.py) on the CPU: real transformers exports, partitioned and searched.

Why: mlso's own test graphs are hand-written; these are what ``torch.onnx.export`` writes for
Llama, GPT-2, Gemma 3, a DeepSeek MLA layer and the rest, with their shape arithmetic, mask
construction and dtype casts. Each tiny model must load, ``mlso inspect --json`` must put every
node either in a region or in a ``left_out`` record (exactly once), and ``mlso optimize
--dry-run`` must finish. The committed files (models/zoo_small/) always run; the others run
when ``make zoo`` has built them into models/zoo/ and skip otherwise. Nothing here imports
torch: the manifest says what to expect.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest

ROOT = Path(__file__).resolve().parent.parent
MANIFEST_PATH = ROOT / "models" / "zoo_manifest.json"
MANIFEST: dict[str, Any] = json.loads(MANIFEST_PATH.read_text())
ENTRIES: dict[str, dict[str, Any]] = MANIFEST["entries"]
COMMITTED: list[str] = MANIFEST["committed"]
SMALL_DIR = ROOT / "models" / "zoo_small"
BUILT_DIR = ROOT / "models" / "zoo"
SHAPE = MANIFEST["check_input_shape"]["input_ids"]
SHAPE_ARGS = ["--input-shape", f"input_ids={SHAPE[0]},{SHAPE[1]}"]
MAX_COMMITTED_BYTES = 5_000_000
NOT_BUILT = "not committed and not built (run `make zoo`)"

OK = sorted(name for name, e in ENTRIES.items() if e["status"] == "ok")
TINY = [n for n in OK if ENTRIES[n]["size"] == "tiny"]
REAL = [n for n in OK if ENTRIES[n]["size"] == "real"]
# GPT-2's attention region alone searches for 2-3 minutes at --max-states 2000.
FAST_OPTIMIZE: set[str] = set()
"""Zoo models whose optimize test runs in `make test`: none (each takes 20-150 s on 2 cores, and
`make test` must stay under 10 minutes); CI runs them all in `make test-slow`."""


def zoo_path(name: str) -> Path:
    """The committed copy if there is one, else the built one; skip when neither exists."""
    for path in (SMALL_DIR / name, BUILT_DIR / name):
        if path.exists():
            return path
    pytest.skip(NOT_BUILT)


def mlso(*args: str, cache: Path, timeout: float) -> subprocess.CompletedProcess:
    """The CLI in a subprocess with its own result cache, so a search really runs."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "MLSO_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "mlso_cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def records(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def tail(proc: subprocess.CompletedProcess) -> str:
    return "\n".join(proc.stderr.strip().splitlines()[-15:])


# ---------------------------------------------------------------------------------------------
# The manifest and the committed files


def test_committed_files_match_the_manifest():
    """Each committed file is the exported one (sha256), under 5 MB, and all of them together
    stay under the ~20 MB the repository allows for the zoo."""
    assert COMMITTED, "the manifest names no committed file"
    total = 0
    for name in COMMITTED:
        path = SMALL_DIR / name
        entry = ENTRIES[name]
        assert path.exists(), f"{name} is listed as committed but missing from models/zoo_small/"
        data = path.read_bytes()
        assert len(data) == entry["bytes"] <= MAX_COMMITTED_BYTES
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        total += len(data)
    assert total <= 20_000_000
    on_disk = {p.name for p in SMALL_DIR.glob("*.onnx")}
    assert on_disk == set(COMMITTED), "models/zoo_small/ holds files the manifest does not list"


def test_manifest_lists_every_family_size_and_dtype():
    """The committed manifest was generated from the current family table: every
    family x size x dtype has a record, and only families marked optional failed."""
    from models import zoo  # conftest puts the repository root on sys.path

    want = {
        zoo.file_name(f.name, size, dtype)
        for f in zoo.FAMILIES
        for size in zoo.SIZES
        for dtype in zoo.DTYPES
    }
    assert set(ENTRIES) == want
    for name, entry in ENTRIES.items():
        family = zoo.FAMILY_BY_NAME[entry["family"]]
        if entry["status"] != "ok":
            assert family.optional, f"{name} failed: {entry.get('error', '')[:300]}"
        else:
            assert entry["parity"]["max_rel_error"] <= entry["parity"]["limit"]
            assert (
                entry["size"] != "real"
                or entry["config"].get("hidden_size", entry["config"].get("n_embd", 0)) >= 896
            )
    assert set(zoo.COMMITTED) == set(COMMITTED)


def test_zoo_module_imports_without_torch():
    """`python -m models.zoo inspect|check|freeze` run in the torch-free .venv."""
    code = (
        "import sys, models.zoo; sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------
# Each tiny model: load, inspect, optimize


@pytest.mark.parametrize("name", TINY)
def test_loads_with_the_manifest_signature(name):
    path = zoo_path(name)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    entry = ENTRIES[name]
    got = [
        {
            "name": v.name,
            "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower(),
            "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
        }
        for v in model.graph.input
    ]
    assert got == entry["inputs"]
    assert [o.name for o in model.graph.output] == [o["name"] for o in entry["outputs"]]
    if path.parent == SMALL_DIR:
        assert len(model.graph.node) == entry["nodes"]


@pytest.mark.parametrize("name", TINY)
def test_inspect_accounts_for_every_node(name, tmp_path):
    """Every node index is in exactly one region or one left_out record; attention (a Softmax)
    and the projections (a MatMul or Gemm) land in regions."""
    path = zoo_path(name)
    n_nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
    proc = mlso("inspect", str(path), *SHAPE_ARGS, "--json", cache=tmp_path, timeout=300)
    assert proc.returncode == 0, tail(proc)
    recs = records(proc.stdout)
    regions = [r for r in recs if r["type"] == "region"]
    assert regions, "no fusable region in a transformer"
    seen: collections.Counter[int] = collections.Counter()
    for r in regions:
        seen.update(r["node_indices"])
    for r in recs:
        if r["type"] == "left_out":
            seen[r["index"]] += 1
    assert sorted(seen) == list(range(n_nodes)), "a node is neither in a region nor left out"
    assert max(seen.values()) == 1, "a node is counted twice"
    ops = collections.Counter()
    for r in regions:
        ops.update(r["ops"])
    assert ops["Softmax"] >= 1
    assert ops["MatMul"] + ops["Gemm"] >= 1


def _optimize_params() -> list[Any]:
    marks = {n: () if n in FAST_OPTIMIZE else (pytest.mark.slow,) for n in TINY}
    return [pytest.param(n, marks=marks[n]) for n in TINY]


@pytest.mark.parametrize("name", _optimize_params())
def test_optimize_dry_run(name, tmp_path):
    """A bounded search over every region finishes, exits 0 and reports each region once."""
    path = zoo_path(name)
    proc = mlso(
        "optimize",
        str(path),
        *SHAPE_ARGS,
        "--dry-run",
        "--max-states",
        "2000",
        "--json",
        cache=tmp_path / "cache",
        timeout=900,
    )
    assert proc.returncode == 0, tail(proc)
    recs = records(proc.stdout)
    regions = [r for r in recs if r["type"] == "region"]
    (summary,) = [r for r in recs if r["type"] == "summary"]
    assert summary["regions"] == len(regions) >= 1
    assert sorted(r["region"] for r in regions) == list(range(len(regions)))
    assert summary["output"] is None  # --dry-run writes nothing


# ---------------------------------------------------------------------------------------------
# Real layer widths (built by `make zoo` only; hundreds of MB each)


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_inspect_real_width(name, tmp_path):
    path = BUILT_DIR / name
    if not path.exists():
        pytest.skip(NOT_BUILT)
    proc = mlso("inspect", str(path), *SHAPE_ARGS, "--json", cache=tmp_path, timeout=600)
    assert proc.returncode == 0, tail(proc)
    assert any(r["type"] == "region" for r in records(proc.stdout))
