"""GPU timing as tasks (pipeline/timing.py): on this GPU, or one Ray task per trial model.

Why: with `--executor ray`, `optimize --gpu` times its trial models as tasks that each ask for
one GPU. What must hold: results come back in trial order whatever finishes first; a worker
that dies mid-timing is rerun with the same result; a trial that never comes back (its node
gone after the retries, or a cluster with no GPU) is decided by the cost model and the region's
report says so; an error the measurement itself raises is still an error. The pipeline tests run
without Ray; the cluster tests are slow and give Ray's scheduler a GPU resource on a CPU-only
machine (`num_gpus=1`), which is all that scheduling reads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from mlso_cli.pipeline import timing
from mlso_cli.pipeline.timing import Lost, run_trials


def _trial(i: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"], name=f"t{i}")], "g", [x], [y])
    return helper.make_model(g)


def _name(model: onnx.ModelProto, gpu: int) -> list:
    return [(model.graph.node[0].name, gpu)]


def test_locally_each_trial_is_measured_in_order_on_the_given_gpu():
    trials = [_trial(i) for i in range(3)]
    assert run_trials(trials, _name, 2) == [[("t0", 2)], [("t1", 2)], [("t2", 2)]]
    assert run_trials([], _name, 0, "ray") == []  # nothing to time: no cluster is joined


def test_a_lost_trial_is_decided_by_the_cost_model_and_the_report_says_so(tmp_path, monkeypatch):
    """Trial 0 (each region's best estimate) is lost, trial 1 comes back: the region is decided
    by trial 1's figures, and its `why` names the loss."""
    import mlso_cli.pipeline.gpu as gpu
    from mlso_cli.bench.harness import RegionTiming
    from mlso_cli.pipeline import optimize
    from tests.test_pipeline import SRC, FakeSearch, _opts

    monkeypatch.setattr(gpu, "require_gpu", lambda index: None)
    why = "GPU timing lost: its GPU node or worker was lost after 3 retries; decided by the cost model"

    def fake_measure(model, index):
        (node,) = [n for n in model.graph.node if n.domain == "ai.mlso"]
        return [RegionTiming(node.name, node.overload, 50.0, 20.0)]

    def lose_first(trials, measure, gpu_index, executor="local"):
        return [Lost(why)] + [measure(t, gpu_index) for t in trials[1:]]

    monkeypatch.setattr(timing, "run_trials", lose_first)
    out = optimize(
        str(SRC), None, _opts(tmp_path, gpu=0, top_k=2), search=FakeSearch(), measure=fake_measure
    )
    (rep,) = out.regions
    assert rep.choice.measured and rep.choice.after_us == 20.0
    assert rep.choice.why.endswith(f"({why})")

    # every trial lost: the estimate decides, and the report still says why
    monkeypatch.setattr(timing, "run_trials", lambda trials, *a, **k: [Lost(why)] * len(trials))
    out = optimize(
        str(SRC), None, _opts(tmp_path, gpu=0, top_k=2), search=FakeSearch(), measure=fake_measure
    )
    (rep,) = out.regions
    assert not rep.choice.measured and rep.choice.why.startswith("estimated")
    assert why in rep.choice.why


# ---- on a local Ray cluster (slow) ------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_cluster():
    """A head node with one CPU and one (scheduling-only) GPU, and this process as its driver."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'mlso[ray]')")
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "num_gpus": 1,
            "object_store_memory": 100 * 1024**2,
            "include_dashboard": False,
        },
    )
    try:
        c.wait_for_nodes()
        from mlso_cli.search.executor import connect_ray

        connect_ray(c.address, 1)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        yield f"ray={c.address}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


class DieOnce:
    """A measurement whose first call kills its worker process (a lost node, as Ray sees it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __call__(self, model, gpu):
        if not os.path.exists(self.marker):
            Path(self.marker).write_text("died once")
            os._exit(1)
        return _name(model, gpu)


def _always_die(model, gpu):
    os._exit(1)


def _raise(model, gpu):
    raise ValueError("the measurement itself failed")


@pytest.mark.slow
def test_ray_tasks_return_each_trial_in_order(gpu_cluster):
    trials = [_trial(i) for i in range(3)]
    # a task sees its one GPU as device 0, whatever --gpu the driver was given
    assert run_trials(trials, _name, 5, gpu_cluster) == [[("t0", 0)], [("t1", 0)], [("t2", 0)]]


@pytest.mark.slow
def test_a_worker_lost_mid_timing_is_rerun_with_the_same_result(gpu_cluster, tmp_path):
    trials = [_trial(0), _trial(1)]
    got = run_trials(trials, DieOnce(tmp_path / "marker"), 0, gpu_cluster)
    assert got == [[("t0", 0)], [("t1", 0)]]
    assert (tmp_path / "marker").exists()


@pytest.mark.slow
def test_a_trial_lost_after_the_retries_is_lost_not_an_error(gpu_cluster):
    (got,) = run_trials([_trial(0)], _always_die, 0, gpu_cluster)
    assert isinstance(got, Lost)
    assert got.reason.startswith("GPU timing lost: its GPU node or worker was lost after 3")
    assert got.reason.endswith("decided by the cost model")


@pytest.mark.slow
def test_an_error_of_the_measurement_is_raised(gpu_cluster):
    with pytest.raises(ValueError, match="the measurement itself failed"):
        run_trials([_trial(0)], _raise, 0, gpu_cluster)


@pytest.mark.slow
def test_a_cluster_without_a_gpu_loses_every_trial_at_once(gpu_cluster, monkeypatch):
    monkeypatch.setattr(timing, "_cluster_gpus", lambda ray: 0.0)
    got = run_trials([_trial(0), _trial(1)], _name, 0, gpu_cluster)
    assert got == [Lost("the Ray cluster has no GPU; decided by the cost model")] * 2


@pytest.mark.slow
def test_a_trial_no_gpu_node_takes_is_lost_after_the_wait(gpu_cluster):
    """Two trials, one GPU, and a wait shorter than one timing: the second is still queued."""
    import time

    def slow(model, gpu):
        time.sleep(3)
        return _name(model, gpu)

    got = run_trials([_trial(0), _trial(1)], slow, 0, gpu_cluster, wait_s=2.0)
    assert all(isinstance(g, Lost) for g in got)
    assert "no GPU node returned it within 2 s" in got[1].reason
