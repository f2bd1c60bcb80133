"""Where the search's independent units run: in this process, a local process pool, or Ray.

    make_executor(spec, jobs, initializer) -> Executor
    executor.map(fn, items)          results in the order of `items`, yielded as they come
    executor.submit(fn, *args)       a handle; executor.gather(handles) -> results in that order
    executor.counts()                tasks queued / running / finished, nodes in use
    executor.shutdown(cancel=True)   cancel what is still queued or running

Why an interface: the search (search/run.py) runs two kinds of units, one signature's
exploration and one half of a full-shape check. Each is a pure function of plain data, and the
driver reads the results in a fixed order, so *where* they run cannot change the result: the
output is byte-identical whether the units run inline, on `--jobs` local processes or as Ray
tasks on a cluster. That is also why the executor is not part of the search cache key, like
`--jobs`.

Executors, by `--executor` spec:
  local          (the default) inline when one job, else a ProcessPoolExecutor of `jobs` workers
  ray            Ray tasks on the cluster named by RAY_ADDRESS, else on one `ray start` left on
                 this machine, else on a local cluster started here with `jobs` CPUs
  ray=ADDRESS    Ray tasks on the running cluster at ADDRESS (`ray start --head` prints it)
Ray is an optional extra (`pip install 'mlso[ray]'`); without it, asking for it is exit 4.

Faults: a Ray task whose worker process or node dies is retried (RAY_RETRIES times) on another
worker; the unit is a pure function, so the retry gives the same result. Ctrl-C on the driver
ends in `shutdown(cancel=True)` (search/run.py's `finally`), which cancels the cluster's tasks
of this run (`ray.cancel(force=True)`), so a cluster is not left computing for a driver that
has gone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from mlso_cli.errors import EnvironmentProblem, UsageError

LOCAL = "local"
RAY = "ray"
RAY_RETRIES = 3
"""How many times Ray reruns a task whose worker or node died (not one that raised)."""
LOCAL_OBJECT_STORE = 256 * 1024**2
"""Object store bytes of a local cluster started by `--executor ray` (Ray's default is 30% of RAM)."""
INSTALL_RAY = "Install it with: pip install 'mlso[ray]'"


@dataclass(frozen=True)
class Spec:
    """A parsed `--executor` value."""

    kind: str
    address: str | None = None

    def __str__(self) -> str:
        return self.kind if self.address is None else f"{self.kind}={self.address}"


def parse_spec(spec: str) -> Spec:
    """`local`, `ray` or `ray=ADDRESS`; anything else is a usage error (exit 2)."""
    kind, sep, address = spec.strip().partition("=")
    kind = kind.strip().lower()
    if kind == LOCAL and not sep:
        return Spec(LOCAL)
    if kind == RAY:
        if sep and not address.strip():
            raise UsageError(
                f"--executor {spec!r} names no address", "Write ray=HOST:PORT, or plain ray"
            )
        return Spec(RAY, address.strip() or None)
    raise UsageError(
        f"--executor {spec!r} is not an executor", "Use local, ray or ray=ADDRESS (HOST:PORT)"
    )


def check_spec(spec: str) -> Spec:
    """Parse `spec` and check that what it needs is installed, before any search starts: `ray`
    without Ray installed is exit 4 with the install command."""
    parsed = parse_spec(spec)
    if parsed.kind == RAY:
        _import_ray()
    return parsed


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise EnvironmentProblem(
            f"--executor ray needs Ray, which is not installed ({exc})", INSTALL_RAY
        ) from exc
    return ray


@dataclass(frozen=True)
class TaskCounts:
    """What a progress display shows of an executor's work. `running` is the unfinished tasks
    the executor's slots (pool workers, the cluster's CPUs) can hold at once; `queued` the rest.
    `nodes`: machines that have returned a result so far (1 for the local executors)."""

    queued: int
    running: int
    finished: int
    nodes: int


class Executor:
    """Runs units of work and hands their results back in a fixed order.

    `in_process` is True when units run in this process (the search then passes graphs as
    objects rather than as JSON text)."""

    in_process = False

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        raise NotImplementedError

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    def gather(self, handles: list[Any]) -> list[Any]:
        raise NotImplementedError

    def counts(self) -> TaskCounts:
        raise NotImplementedError

    def shutdown(self, cancel: bool = False) -> None:
        """Release the workers; with `cancel`, drop the units not yet finished."""


class _Counting(Executor):
    """Counts submitted and finished units against a number of slots."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self.submitted = 0
        self.finished = 0
        self.nodes: set[str] = set()

    def counts(self) -> TaskCounts:
        open_ = self.submitted - self.finished
        running = min(open_, self.slots)
        return TaskCounts(open_ - running, running, self.finished, max(1, len(self.nodes)))


class InlineExecutor(_Counting):
    """Every unit runs here, when its result is asked for: `--jobs 1`."""

    in_process = True

    def __init__(self) -> None:
        super().__init__(1)

    def map(self, fn, items):
        items = list(items)
        self.submitted += len(items)
        for item in items:
            result = fn(item)
            self.finished += 1
            yield result

    def submit(self, fn, *args):
        self.submitted += 1
        return (fn, args)

    def gather(self, handles):
        out = []
        for fn, args in handles:
            out.append(fn(*args))
            self.finished += 1
        return out


class PoolExecutor(_Counting):
    """A local ProcessPoolExecutor of `jobs` workers, each set up by `initializer`."""

    def __init__(self, jobs: int, initializer: Callable[[], None] | None = None) -> None:
        super().__init__(jobs)
        self.pool = ProcessPoolExecutor(jobs, initializer=initializer)
        self.futures: list[Future] = []
        self.mapped = 0
        """Units of `map` whose results were read (those of `submit` are counted as done)."""

    def map(self, fn, items):
        items = list(items)
        self.submitted += len(items)
        for result in self.pool.map(fn, items):
            self.mapped += 1
            yield result

    def submit(self, fn, *args):
        self.submitted += 1
        fu = self.pool.submit(fn, *args)
        self.futures.append(fu)
        return fu

    def counts(self) -> TaskCounts:
        self.finished = self.mapped + sum(fu.done() for fu in self.futures)
        return super().counts()

    def gather(self, handles):
        return [fu.result() for fu in handles]

    def shutdown(self, cancel: bool = False) -> None:
        self.pool.shutdown(cancel_futures=cancel)


_INITIALIZED: set[str] = set()


class CodeMismatch(RuntimeError):
    """A worker's mlso search and code generation sources differ from the driver's."""


def _run_remote(
    initializer: Callable[[], None] | None,
    fn: Callable[..., Any],
    args: tuple,
    digest: str | None = None,
):
    """One unit in a Ray worker: the worker's one-time setup (the pool's `initializer`), then
    the unit; returns (node id, result) so the driver can show the nodes in use.

    `digest` is the driver's `code_digest()`: a node that runs other mlso sources could return
    other results under the same cache key, so such a node refuses the unit."""
    import ray

    if digest is not None:
        from mlso_cli.search.cache import code_digest

        if code_digest() != digest:
            raise CodeMismatch(
                f"node {ray.get_runtime_context().get_node_id()[:12]} runs other mlso sources "
                f"(code digest {code_digest()[:12]}, the driver's {digest[:12]})"
            )

    if initializer is not None:
        name = f"{initializer.__module__}.{initializer.__qualname__}"
        if name not in _INITIALIZED:
            initializer()
            _INITIALIZED.add(name)
    return ray.get_runtime_context().get_node_id(), fn(*args)


_REMOTE: dict[str, Any] = {}


def _remote_fn(ray):
    """`_run_remote` as a Ray remote function (made once per driver process)."""
    if "fn" not in _REMOTE:
        _REMOTE["fn"] = ray.remote(num_cpus=1, max_retries=RAY_RETRIES, retry_exceptions=False)(
            _run_remote
        )
    return _REMOTE["fn"]


def connect_ray(address: str | None, num_cpus: int):
    """Join the Ray cluster at `address` (else RAY_ADDRESS, else one that `ray start` left on
    this machine), or start a local one of `num_cpus` CPUs; once per process (later regions reuse the connection). A failure to connect is exit 4
    with what to check."""
    ray = _import_ray()
    if ray.is_initialized():
        return ray
    import logging

    kw: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    target = address or os.environ.get("RAY_ADDRESS")
    try:
        if target:
            ray.init(address=target, **kw)
        else:
            try:
                # the units' objects are kilobytes of JSON: a small object store spares shared
                # memory
                ray.init(
                    num_cpus=max(1, num_cpus),
                    include_dashboard=False,
                    object_store_memory=LOCAL_OBJECT_STORE,
                    **kw,
                )
            except ValueError as exc:
                # ray.init() joins a cluster started on this machine by `ray start`, and refuses
                # resource arguments for it: join it as it is
                if "existing cluster" not in str(exc):
                    raise
                ray.init(**kw)
    except Exception as exc:  # noqa: BLE001 - ray raises several types for one cause
        where = f"the Ray cluster at {target}" if target else "a local Ray cluster"
        raise EnvironmentProblem(
            f"could not join {where}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            "Start one with `ray start --head` and pass the address it prints as "
            "--executor ray=HOST:PORT",
        ) from exc
    return ray


class RayExecutor(Executor):
    """Units as Ray tasks (`num_cpus=1`, retried RAY_RETRIES times when a worker dies), read back
    in submission order."""

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int = 1,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self.ray = connect_ray(address, num_cpus)
        self.initializer = initializer
        from mlso_cli.search.cache import code_digest

        self.digest = code_digest()
        self.remote = _remote_fn(self.ray)
        self.pending: dict[Any, None] = {}
        self.finished = 0
        self.nodes: set[str] = set()
        try:
            self.slots = max(1, int(self.ray.cluster_resources().get("CPU", 1)))
        except Exception:  # noqa: BLE001 - a display figure only
            self.slots = 1

    def _submit(self, fn, args: tuple):
        ref = self.remote.remote(self.initializer, fn, args, self.digest)
        self.pending[ref] = None
        return ref

    def _get(self, ref):
        try:
            node, result = self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, CodeMismatch):
                raise EnvironmentProblem(
                    f"a Ray worker cannot run this search: {exc.cause}",
                    "Install the same mlso on every node of the cluster as on the driver",
                ) from None
            raise
        self.pending.pop(ref, None)
        self.finished += 1
        self.nodes.add(node)
        return result

    def map(self, fn, items):
        refs = [self._submit(fn, (item,)) for item in items]
        for ref in refs:
            yield self._get(ref)

    def submit(self, fn, *args):
        return self._submit(fn, args)

    def gather(self, handles):
        return [self._get(ref) for ref in handles]

    def counts(self) -> TaskCounts:
        open_ = len(self.pending)
        running = min(open_, self.slots)
        return TaskCounts(open_ - running, running, self.finished, max(1, len(self.nodes)))

    def shutdown(self, cancel: bool = False) -> None:
        """With `cancel`, cancel this executor's unfinished tasks on the cluster (their workers
        are killed: `force=True`). The connection stays for the next region."""
        if cancel:
            for ref in list(self.pending):
                # one already finished, or whose node is gone, raises: nothing left to cancel
                with contextlib.suppress(Exception):
                    self.ray.cancel(ref, force=True)
        self.pending.clear()


def make_executor(
    spec: str,
    jobs: int,
    initializer: Callable[[], None] | None = None,
    cluster_cpus: int | None = None,
) -> Executor:
    """The executor `spec` names (see the module doc): `jobs` sizes the local pool, and
    `cluster_cpus` (default `jobs`) a local Ray cluster started here."""
    parsed = parse_spec(spec)
    if parsed.kind == RAY:
        return RayExecutor(parsed.address, cluster_cpus or jobs, initializer)
    if jobs > 1:
        return PoolExecutor(jobs, initializer)
    return InlineExecutor()
