"""Fuzzing the plan reader in CI: Python's validator against the C++ one, under ASan and UBSan.

Why: the C++ op parses each node's untrusted plan with a hand-written JSON reader
(csrc/mlso_json.h) and validator (csrc/mlso_plan.h), and hashes with a hand-written SHA-256.
tests/fuzz/plan_fuzz.py generates plans with Atheris, judges each with runtime/plan.py (what
runtime/check.py runs) and with a sanitizer build of the C++ side, and fails on any crash,
hang, sanitizer report or disagreement (verdict, reason key, message, hash). Atheris' coverage
feedback sees the Python side only: g++ has no libFuzzer instrumentation, and CI has no clang.

- `make test`: the regression corpus (tests/fuzz/plan_regressions.jsonl: every input that found
  a bug) and a short fixed-seed campaign (SHORT_RUNS inputs; the file takes about 17 s here,
  the sanitizer build included). A seed gives the same inputs on every run.
- `make test-slow`: LONG_RUNS inputs with another seed (3.5 minutes here; it stops at
  LONG_SECONDS on a slower machine).

A failure prints the offending inputs and writes each to a finding-<n>.json whose path is in
the message; `python -m tests.fuzz.plan_fuzz --replay PATH` re-checks one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from mlso_cli.errors import InputError
from mlso_cli.package import package_model, standard_metadata
from mlso_cli.runtime import check_model
from tests.fuzz import plan_fuzz as pf
from tests.test_package_support import ROOT, attention_mlp, two_regions

SHORT_RUNS = 10_000
LONG_RUNS = 200_000
LONG_SECONDS = 240

ATHERIS_PLATFORM = (
    sys.platform == "linux"
    and platform.machine() == "x86_64"
    and (3, 11) <= sys.version_info[:2] < (3, 14)
)
"""Where atheris 3.0.0 has wheels (pyproject.toml installs it there). Elsewhere the campaigns
skip; here a missing atheris is an installation error and fails."""


def _need_atheris() -> None:
    try:
        import atheris  # noqa: F401
    except ImportError:
        if ATHERIS_PLATFORM:
            pytest.fail("atheris is missing; install the dev extra: pip install -e '.[dev]'")
        pytest.skip("atheris has no wheel for this platform or Python")


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    if not shutil.which("g++"):
        pytest.skip("g++ is needed for the C++ fuzz driver")
    return pf.build_driver(tmp_path_factory.mktemp("plan_fuzz_driver"))


def _report(findings: list[pf.Finding], out: Path) -> str:
    paths = pf.write_findings(findings, out)
    shown = [p.read_text()[:3000] for p in paths[:3]]
    return f"{len(findings)} findings, written to {', '.join(map(str, paths))}:\n" + "\n".join(
        shown
    )


def test_regression_corpus(driver, tmp_path):
    cases = pf.load_regressions()
    assert len(cases) >= 15
    assert len({c["name"] for c in cases}) == len(cases)
    findings = pf.check_regressions(driver, cases)
    assert not findings, _report(findings, tmp_path)


def test_a_wide_object_parses_in_linear_time(driver, tmp_path):
    """A 100,000-key object (1.1 MB): the reader's old per-key duplicate scan took 90 s here under
    ASan (2.6 min at -O2 for 200,000 keys), long enough to stall session creation."""
    keys = [f"k{i}" for i in range(100_000)]
    unique = ("{" + ",".join(f'"{k}":0' for k in keys) + "}").encode()
    duplicate = unique[:-1] + b',"k50000":1}'
    items = [pf.Item(t, pf.Context()).judged() for t in (unique, duplicate)]
    start = time.monotonic()
    findings = pf.check_items(driver, items, timeout=60)
    assert not findings, _report(findings, tmp_path)
    assert [it.python[0] for it in items] == ["unknown_field", "json"]
    assert time.monotonic() - start < 20


def test_utf8_in_strings_is_refused_exactly_where_python_refuses_it(driver, tmp_path):
    """Every lead byte with second, third and fourth bytes on each edge of Unicode's table of
    well-formed sequences, complete and cut short, inside a JSON string: the C++ reader must say
    json exactly where Python's strict decoder fails (else not_object, the text being a string)."""
    edges = [0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0]
    seqs = {bytes([a]) for a in range(0x80, 0x100)}
    for a in range(0x80, 0x100):
        for b in edges:
            seqs.add(bytes([a, b]))
            for c in (0x7F, 0x80, 0xBF, 0xC0):
                seqs |= {bytes([a, b, c]), bytes([a, b, c, 0x80]), bytes([a, b, c, 0xC0])}
    items = [pf.Item(b'"x' + q + b'"', pf.Context()).judged() for q in sorted(seqs)]
    assert {it.python[0] for it in items} == {"json", "not_object"}
    findings = pf.check_items(driver, items)
    assert not findings, _report(findings, tmp_path)


def test_sha256_matches_hashlib_across_block_edges(driver, tmp_path):
    rng = random.Random(0)
    texts = [bytes(rng.randrange(256) for _ in range(n)) for n in range(0, 260)]
    texts.append(rng.randbytes(1 << 20 | 7))
    findings = pf.check_items(driver, [pf.Item(t, pf.Context()).judged() for t in texts])
    assert not findings, _report(findings, tmp_path)


def test_the_harness_reports_crashes_and_disagreements(tmp_path):
    """The oracle itself: a forged Python verdict is a disagreement, and a driver that dies
    after its first line is a crash on the second input, with the sanitizer's text."""
    item = pf.case_item(next(c for c in pf.load_regressions() if c["reason"] == "kernel"))
    code, sha, msg = "kernel", hashlib.sha256(item.text).hexdigest(), item.python[1]
    assert pf.compare(item, (code, sha, msg)) is None
    assert pf.compare(item, ("ok", sha, "")).kind == "reason"
    assert pf.compare(item, (code, sha, msg + ".")).kind == "message"
    assert pf.compare(item, (code, "0" * 64, "")).kind == "sha256"
    fake = tmp_path / "dies.sh"
    fake.write_text(
        "#!/bin/sh\ncat >/dev/null\nprintf '%s\\t%s\\t%s\\n' " + f"{code} {sha} '{msg}'\n"
        "echo 'ERROR: AddressSanitizer: heap-buffer-overflow' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    findings = pf.check_items(fake, [item, item, item])
    assert [f.kind for f in findings] == ["crash"]
    assert "heap-buffer-overflow" in findings[0].detail
    (path,) = pf.write_findings(findings, tmp_path / "out")
    assert json.loads(path.read_text())["case"]["reason"] == code


def test_check_refuses_a_ugraph_with_a_huge_integer():
    """Found while fuzzing Python's int_max_str_digits: json.loads raises a plain ValueError (not
    JSONDecodeError) for an integer of more than 4300 digits, which check.py let escape as a
    traceback instead of refusing the node."""
    model = attention_mlp()
    model = package_model(
        model,
        two_regions(model),
        standard_metadata(targets=["sm_90a"], seed=0, verification_bound="1e-3"),
    )
    node: onnx.NodeProto = model.graph.node[0]
    next(a for a in node.attribute if a.name == "ugraph").s = b"[" + b"1" * 5000 + b"]"
    with pytest.raises(InputError) as info:
        check_model(model)
    assert "attribute 'ugraph' is not valid JSON" in info.value.one_line()


def _campaign(driver: Path, out: Path, runs: int, seed: int, seconds: float) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "tests.fuzz.plan_fuzz",
        f"--runs={runs}",
        f"--seed={seed}",
        f"--max-seconds={seconds}",
        f"--driver={driver}",
        f"--out={out}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds + 600
    )
    summary = out / "summary.json"
    if proc.returncode != 0 or not summary.is_file():
        lines = [x for x in proc.stdout.splitlines() if x.startswith("plan fuzz")]
        shown = [p.read_text()[:3000] for p in sorted(out.glob("finding-*.json"))[:3]]
        pytest.fail(
            f"plan fuzz campaign (seed {seed}) failed with exit status {proc.returncode}; "
            f"findings under {out}\n" + "\n".join(lines + shown) + "\n" + proc.stderr[-3000:]
        )
    return json.loads(summary.read_text())


def _diverse(summary: dict) -> None:
    """The campaign reached the validators' rules, not only the JSON reader's errors."""
    verdicts = summary["verdicts"]
    assert verdicts.get("ok", 0) > 0, verdicts
    assert len(verdicts) >= 15, verdicts
    assert verdicts.get("json", 0) < 0.7 * summary["inputs"], verdicts


def test_fuzz_short(driver, tmp_path):
    _need_atheris()
    summary = _campaign(driver, tmp_path / "fuzz", SHORT_RUNS, seed=1, seconds=600)
    assert summary["inputs"] == SHORT_RUNS and not summary["findings"]
    _diverse(summary)


@pytest.mark.slow
def test_fuzz_long(driver, tmp_path):
    _need_atheris()
    summary = _campaign(driver, tmp_path / "fuzz", LONG_RUNS, seed=2, seconds=LONG_SECONDS)
    # Stops at LONG_SECONDS on a slow machine; even then it must have done a real campaign.
    assert summary["inputs"] >= min(LONG_RUNS, 50_000) and not summary["findings"]
    _diverse(summary)
