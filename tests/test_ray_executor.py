"""The search on a real local Ray cluster: a head and one worker node, 2 CPUs in all.

Why on a real cluster: what can differ between executors (where a unit runs, in which worker
process, after how many retries) only shows with separate raylets and worker processes. The
claims: the output model is byte-identical to the local executor's; a worker killed mid-search
is retried with the same result; cancelling on the driver (Ctrl-C) cancels the cluster's
tasks and leaves no output. Slow (a cluster takes seconds to start), and skipped with the reason
when Ray is not installed (`pip install 'mlso[ray]'`; `make test-slow` installs it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'mlso[ray]')")

from mlso_cli.ir.serialize import dumps  # noqa: E402
from mlso_cli.search import executor as executor_mod  # noqa: E402
from mlso_cli.search import run as run_mod  # noqa: E402
from mlso_cli.search.api import SearchOptions  # noqa: E402
from tests.helpers import MODELS, ROOT  # noqa: E402

pytestmark = pytest.mark.slow

LORA = MODELS / "small" / "lora.onnx"
STATES = "2000"


@pytest.fixture(scope="module")
def cluster():
    """A head node and one worker node of one CPU each, small object stores, no dashboard;
    torn down (its processes ended, the driver disconnected) whatever the tests did."""
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 100 * 1024**2}
    c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        c.add_node(**node)
        c.wait_for_nodes()
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.fixture
def connected(cluster):
    """This process joined to the cluster as a driver (what `--executor ray=ADDRESS` does)."""
    executor_mod.connect_ray(cluster.address, 1)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # KillOnce, _sleep
    yield cluster
    ray.shutdown()


def _optimize(out: Path, *extra: str, cache: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "MLSO_CACHE_DIR": str(cache),
    }
    # --seed fixes the check before writing too (its seed is written into the model)
    args = [str(LORA), "-o", str(out), "--max-states", STATES, "--min-speedup", "0", "--no-cache"]
    args += ["--seed", "7"]
    return subprocess.run(
        [sys.executable, "-m", "mlso_cli", "optimize", *args, *extra],
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_ray_output_is_byte_identical_to_the_local_pool(cluster, tmp_path):
    local = _optimize(tmp_path / "local.onnx", "--jobs", "2", cache=tmp_path / "c")
    assert local.returncode == 0, local.stderr.decode()[-2000:]
    remote = _optimize(
        tmp_path / "ray.onnx", "--executor", f"ray={cluster.address}", cache=tmp_path / "c"
    )
    assert remote.returncode == 0, remote.stderr.decode()[-2000:]
    want = (tmp_path / "local.onnx").read_bytes()
    assert want and (tmp_path / "ray.onnx").read_bytes() == want


def _lora_target():
    from mlso_cli.pipeline.run import lift

    return lift(str(LORA), None).regions[0].graph


class KillOnce:
    """`fn`, except that the first call anywhere on the cluster kills its own worker process
    (the marker file, created exclusively, says it happened)."""

    def __init__(self, marker: str, fn) -> None:
        self.marker, self.fn = marker, fn

    def __call__(self, item):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return self.fn(item)
        os._exit(1)  # a crash, not an exception: Ray retries the task on another worker


def test_a_worker_killed_mid_search_is_retried_with_the_same_result(
    connected, tmp_path, monkeypatch
):
    target = _lora_target()
    opts = SearchOptions(max_states=int(STATES), seed=0, jobs=2)
    want = run_mod.search(target, opts)
    opts = SearchOptions(
        max_states=int(STATES), seed=0, jobs=2, executor=f"ray={connected.address}"
    )

    marker = str(tmp_path / "killed")
    made = []

    class Faulty(executor_mod.RayExecutor):
        def map(self, fn, items):
            return super().map(KillOnce(marker, fn), items)

    def faulty(spec, jobs, initializer=None, cluster_cpus=None):
        made.append(Faulty(connected.address, 1, initializer))
        return made[-1]

    monkeypatch.setattr(run_mod, "make_executor", faulty)
    seen = []
    got = run_mod.search(target, opts, seen.append)
    assert os.path.exists(marker)  # a worker did die
    assert made and seen[-1].finished == made[0].counts().finished > 0
    assert [dumps(c.graph) for c in got.candidates] == [dumps(c.graph) for c in want.candidates]
    assert (got.states, got.verified, got.bound) == (want.states, want.verified, want.bound)


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_shutdown_with_cancel_cancels_the_clusters_tasks(connected):
    ex = executor_mod.RayExecutor(connected.address, 1)
    handles = [ex.submit(_sleep, 60.0) for _ in range(3)]
    assert ex.counts().queued + ex.counts().running == 3
    t0 = time.monotonic()
    ex.shutdown(cancel=True)
    for h in handles:
        with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.WorkerCrashedError)):
            ray.get(h, timeout=30)
    assert time.monotonic() - t0 < 30  # cancelled, not waited for
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2  # the cluster's CPUs are free again


def test_ctrl_c_on_a_ray_driver_writes_nothing(cluster, tmp_path):
    out = tmp_path / "out.onnx"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "MLSO_CACHE_DIR": str(tmp_path / "c"),
    }
    model = MODELS / "small" / "qknorm_gqa.onnx"  # a search of many seconds
    p = subprocess.Popen(
        [sys.executable, "-m", "mlso_cli", "optimize", str(model), "-o", str(out), "--no-cache"]
        + ["--executor", f"ray={cluster.address}"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    time.sleep(12)  # joined the cluster and searching
    assert p.poll() is None, p.communicate()[1].decode()[-2000:]
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0, err.decode()[-2000:]
    assert not out.exists() and not list(tmp_path.glob("out.onnx*"))


def test_a_node_with_other_mlso_sources_is_refused(connected):
    from mlso_cli.errors import EnvironmentProblem

    ex = executor_mod.RayExecutor(connected.address, 1)
    assert ex.gather([ex.submit(_sleep, 0.0)]) == [0.0]  # the same sources: accepted
    ex.digest = "0" * 64  # as if the driver ran another version
    with pytest.raises(EnvironmentProblem, match="other mlso sources"):
        ex.gather([ex.submit(_sleep, 0.0)])


def test_drivers_sharing_a_cluster_and_a_cache_search_a_region_once(cluster, tmp_path):
    """The batch pattern of README.md: drivers started side by side on one cluster with one
    MLSO_SEARCH_CACHE; a later model with the same regions (here a copy under another name) is
    served from the cache, and every output is the same."""
    import json
    import shutil

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "MLSO_CACHE_DIR": str(tmp_path / "local"),
        "MLSO_SEARCH_CACHE": f"file://{tmp_path}/shared",
    }
    common = ["--max-states", STATES, "--min-speedup", "0", "--executor", f"ray={cluster.address}"]
    common += ["--seed", "7"]  # the check before writing writes its seed into the model

    def driver(model: Path, out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "mlso_cli", "optimize", str(model), "-o", str(out), "--json"]
            + common,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    outs = [tmp_path / f"out{i}.onnx" for i in range(3)]
    side_by_side = [driver(LORA, outs[0]), driver(LORA, outs[1])]
    for p in side_by_side:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    copy = tmp_path / "another_model.onnx"
    shutil.copy(LORA, copy)
    p = driver(copy, outs[2])
    stdout, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()[-2000:]
    rows = [json.loads(x) for x in stdout.decode().splitlines() if x.startswith("{")]
    searched = [r for r in rows if r["type"] == "region" and (r["searched"] or r["cached"])]
    assert searched and all(r["cached"] for r in searched)  # nothing searched again
    assert outs[0].read_bytes() == outs[1].read_bytes() == outs[2].read_bytes()
    assert not list((tmp_path / "shared").rglob("*.tmp"))


def test_plain_executor_ray_joins_the_cluster_running_on_this_machine(cluster, tmp_path):
    """`--executor ray` with no address and no RAY_ADDRESS joins the cluster started on this
    machine (ray.init refuses resource arguments for it: this once exited 4)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "MLSO_CACHE_DIR": str(tmp_path / "c"),
    }
    env.pop("RAY_ADDRESS", None)
    args = [str(LORA), "--dry-run", "--no-cache", "--max-states", "500", "--jobs", "2"]
    p = subprocess.run(
        [sys.executable, "-m", "mlso_cli", "optimize", *args, "--executor", "ray"],
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr.decode()[-2000:]
