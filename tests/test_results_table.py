"""benchmarks/RESULTS.md is rendered from benchmarks/results/, never edited by hand."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location(
        "results_table", ROOT / "benchmarks" / "results_table.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_results_page_is_what_the_records_render() -> None:
    rt = _module()
    assert rt.main(["--check"]) == 0


def test_the_newest_record_of_a_row_wins_and_each_keeps_its_provenance() -> None:
    rt = _module()
    recs = [
        {
            "table": "model_level",
            "row": "a",
            "commit": "1111111",
            "date": "2026-12-01",
            "machine": "H200",
            "figures": {"speedup": "1.10"},
        },
        {
            "table": "model_level",
            "row": "a",
            "commit": "2222222",
            "date": "2026-12-05",
            "machine": "H200",
            "figures": {"speedup": "1.50"},
        },
        {
            "table": "model_level",
            "row": "b",
            "commit": "1111111",
            "date": "2026-12-01",
            "machine": "H200",
            "figures": {"speedup": "0.90"},
        },
    ]
    text = rt.render(recs)
    assert "| a | 2222222 | 2026-12-05 | 1.50 |" in text
    assert "1.10" not in text
    assert "| b | 1111111 | 2026-12-01 | 0.90 |" in text


def test_append_writes_records_atomically_with_commit_and_date(tmp_path, monkeypatch) -> None:
    rt = _module()
    monkeypatch.setattr(rt, "RECORDS", tmp_path)
    path = rt.append("real_decoders", [("qwen2", {"speedup": 1.2})], "test machine")
    (rec,) = json.loads(path.read_text())
    assert rec["row"] == "qwen2" and rec["machine"] == "test machine"
    assert len(rec["commit"]) >= 7 and rec["date"].startswith("20")
    assert not list(tmp_path.glob("*.tmp"))


def _tracked_files() -> list[Path]:
    """The repository's tracked files (what a clean clone holds); every file under ROOT outside
    the usual untracked folders when git cannot say."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout.decode()
        return [ROOT / name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = (".git", ".venv", ".venv-zoo", "build", "__pycache__")
        return [p for p in ROOT.rglob("*") if not any(s in p.parts for s in skip)]


# built from parts, so that this file does not name them itself
NEEDLES = (
    "/".join(["..", "shared"]),
    "/".join(["", "work", "main"]),
    "/".join(["", "work", "shared"]),
)


def test_no_tracked_text_file_names_a_machine_path_or_the_steering_folder() -> None:
    bad = []
    for path in _tracked_files():
        if path.suffix not in {".md", ".py", ".sh", ".toml", ".txt"} or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        for needle in NEEDLES:
            if needle in text:
                bad.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not bad, bad


def test_scaleout_records_each_row_and_a_whole_set_row(tmp_path, monkeypatch) -> None:
    """benchmarks/scaleout.py --record: one record per model and CPU count, and the set's sum."""
    import benchmarks.results_table as rt
    from benchmarks import scaleout

    monkeypatch.setattr(rt, "RECORDS", tmp_path)
    monkeypatch.setenv("MLSO_BENCH_COMMIT", "abc1234")
    rows = [
        {
            "model": "a",
            "cpus": 4,
            "local_s": 10.0,
            "ray_s": 12.0,
            "cluster_start_s": 3.0,
            "same": True,
        },
        {
            "model": "b",
            "cpus": 4,
            "local_s": 5.0,
            "ray_s": 4.0,
            "cluster_start_s": 3.0,
            "same": False,
        },
    ]
    total = scaleout.set_total(rows)
    assert (total["local_s"], total["ray_s"], total["same"]) == (15.0, 16.0, False)
    assert total["model"] == "all 2 models" and total["cpus"] == 4
    for r in [*rows, total]:
        scaleout.record(r, None)
    got = json.loads((tmp_path / "scaleout.json").read_text())
    assert [g["row"] for g in got] == ["a, 4 CPUs", "b, 4 CPUs", "all 2 models, 4 CPUs"]
    assert got[0]["figures"]["Ray / pool"] == 1.2 and got[1]["figures"]["same result"] == "NO"
    assert all(g["commit"] == "abc1234" and g["figures"]["budget"] == "default" for g in got)
    assert "logical CPUs" in got[0]["machine"]
