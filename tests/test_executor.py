"""The search's executor interface without Ray (search/executor.py).

Why: the executor decides where the search's units run, never what they return. These tests hold
the local executors to the contract the Ray one shares (results in a fixed order, counts that
add up, no effect on the cache key) and the CLI to its error rules for `--executor`. The Ray
executor itself is tested on a real local cluster in test_ray_executor.py (slow).
"""

from __future__ import annotations

import sys
import time

import pytest
from click.testing import CliRunner

from mlso_cli.cli import main
from mlso_cli.errors import UsageError
from mlso_cli.ir import DType, Op, check
from mlso_cli.ir import build as b
from mlso_cli.ir.serialize import dumps
from mlso_cli.search.api import SearchOptions
from mlso_cli.search.cache import make_key
from mlso_cli.search.executor import (
    InlineExecutor,
    PoolExecutor,
    Spec,
    make_executor,
    parse_spec,
)
from mlso_cli.search.run import search
from tests.helpers import MODELS

LORA = MODELS / "small" / "lora.onnx"


def _slow_square(x: int) -> int:
    """Later items finish first, so an executor that returned results as they finish would
    return them out of order."""
    time.sleep(0.05 * (4 - x))
    return x * x


def _power(x: int, p: int) -> int:
    time.sleep(0.05 * (4 - x))
    return x**p


@pytest.mark.parametrize(
    "spec, want",
    [
        ("local", Spec("local")),
        ("ray", Spec("ray")),
        ("RAY", Spec("ray")),
        ("ray=10.0.0.1:6379", Spec("ray", "10.0.0.1:6379")),
        ("ray=ray://head:10001", Spec("ray", "ray://head:10001")),
    ],
)
def test_executor_specs_parse(spec, want):
    got = parse_spec(spec)
    assert got == want
    assert parse_spec(str(got)) == got  # the spec optimize passes on round-trips


@pytest.mark.parametrize("spec", ["", "pool", "local=x", "ray=", "ray= "])
def test_bad_executor_specs_are_usage_errors(spec):
    with pytest.raises(UsageError):
        parse_spec(spec)


@pytest.mark.parametrize("jobs", [1, 2])
def test_local_executors_keep_the_order_of_the_items(jobs):
    ex = make_executor("local", jobs)
    assert isinstance(ex, InlineExecutor if jobs == 1 else PoolExecutor)
    try:
        items = [0, 1, 2, 3]
        assert list(ex.map(_slow_square, items)) == [x * x for x in items]
        handles = [ex.submit(_power, x, 3) for x in items]
        assert ex.gather(handles) == [x**3 for x in items]
        c = ex.counts()
        assert (c.queued, c.running, c.finished, c.nodes) == (0, 0, 8, 1)
    finally:
        ex.shutdown(cancel=True)


def test_pool_counts_what_is_still_open():
    ex = PoolExecutor(1)
    try:
        handles = [ex.submit(_power, 0, 1) for _ in range(3)]  # 0.2 s each on one worker
        c = ex.counts()
        assert c.finished < 3 and c.queued + c.running + c.finished == 3 and c.running <= 1
        assert ex.gather(handles) == [0, 0, 0]
        assert ex.counts().finished == 3
    finally:
        ex.shutdown()


def test_the_executor_is_not_part_of_the_cache_key():
    keys = {
        make_key("h", SearchOptions(executor=e, jobs=j).cache_fields(), ("sm_90",), search)
        for e in ("local", "ray", "ray=h:1")
        for j in (1, 4)
    }
    assert len(keys) == 1


def test_the_search_reports_its_tasks_in_progress():
    x = b.input_(0, (8, 32), DType.F32)
    w = b.input_(1, (32, 16), DType.F32)
    target = check(b.kernel_graph([x, w], [b.matmul(b.unary(Op.RELU, x), w)]))
    seen = []
    res = search(target, SearchOptions(max_states=2_000, seed=1, jobs=1), seen.append)
    assert seen and all(p.finished is not None and p.nodes == 1 for p in seen)
    last = seen[-1]
    # every signature's exploration and both halves of each full check ran, none is open
    assert last.queued == 0 and last.running == 0 and last.finished >= res.verified * 2 + 1
    assert [p.finished for p in seen] == sorted(p.finished for p in seen)
    again = search(target, SearchOptions(max_states=2_000, seed=1, jobs=2))
    assert [dumps(c.graph) for c in again.candidates] == [dumps(c.graph) for c in res.candidates]


def test_executor_ray_without_ray_is_exit_4_with_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    out = tmp_path / "o.onnx"
    r = CliRunner().invoke(main, ["optimize", str(LORA), "-o", str(out), "--executor", "ray"])
    assert r.exit_code == 4, r.output
    assert "pip install 'mlso[ray]'" in r.output
    assert not out.exists()


def test_a_bad_executor_is_exit_2(tmp_path):
    r = CliRunner().invoke(main, ["optimize", str(LORA), "--dry-run", "--executor", "dask"])
    assert r.exit_code == 2 and "--executor" in r.output
