"""Running a stage's independent jobs: inline, on local processes, or on Ray (layer 3).

Why one abstraction: every stage that scales has the same shape - a driver plans from headers, cuts the work into
jobs that need nothing but paths (output parts of a weight-only quantization, FP8 cast parts, shard ranks), and
collects small results in order. `Executor.map(fn, jobs)` runs `fn(job)` for each and yields the results in job
order, whichever implementation runs them:

* inline (`--workers 1`): in this process, one after another;
* threads (`--workers N` on this host, for jobs that run outside the GIL: weight-only quantization): N threads of
  this process;
* local processes (`--workers N`, default the CPU count): a process pool started through forkserver (spawn where
  there is none) - never a plain fork of a driver that has torch's threads running;
* Ray (`--executor ray [--ray-address ADDR]`, `pip install 'dsconv[ray]'`): tasks on a Ray cluster, or on a local
  Ray instance without an address.

Jobs are picklable descriptions (paths on shared storage, names, byte ranges); a task reads its inputs by path and
either returns bytes or writes its part files into the driver's temporary directory. Tasks never see driver memory,
and the driver alone owns the output transaction (temporary directory, manifest, digests, rename). The result of a
run never depends on the executor: the same task function writes the same bytes whoever calls it.
"""
from __future__ import annotations

import itertools
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from dsconv.errors import UserError

EXECUTORS = ("local", "ray")
# Below this much work (bytes a stage's jobs touch) processes cost more to start than they save: run inline.
INLINE_BELOW = 64 * 2**20
# Parallel jobs at most: beyond any host or Ray cluster dsconv runs on; past 2**31 the process pool's queue semaphore
# overflows (an OverflowError, not a message)
MAX_WORKERS = 4096
# Modules the forkserver imports once, so each worker forks ready to run (torch's import is ~1 s).
PRELOAD = ("numpy", "torch", "dsconv.executor")


@dataclass(frozen=True)
class ExecOptions:
    """How to run independent jobs (the CLI's --executor, --workers, --ray-address)."""

    executor: str = "local"
    workers: int | None = None      # None: the CPU count (local), the cluster's CPUs (ray)
    ray_address: str | None = None  # None: a local Ray instance

    def resolved_workers(self) -> int:
        return max(1, self.workers or os.cpu_count() or 1)


def check_options(opts: ExecOptions) -> None:
    if opts.executor not in EXECUTORS:
        raise UserError(f"--executor {opts.executor} is not one of {', '.join(EXECUTORS)}")
    if opts.workers is not None and not 1 <= opts.workers <= MAX_WORKERS:
        raise UserError(f"--workers {opts.workers} is not in 1..{MAX_WORKERS}")
    if opts.ray_address and opts.executor != "ray":
        raise UserError("--ray-address applies to --executor ray", hint="add --executor ray or drop --ray-address")


class Executor:
    """Runs `fn(job)` for every job; results come back in job order. Use as a context manager."""

    name = "inline"
    local = True  # jobs run on this host

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self.used = "inline"  # what actually ran the last map (inline when too little work to fan out)

    def map(self, fn: Callable[[Any], Any], jobs: Sequence[Any], work_bytes: int | None = None,
            threads: bool = False, cpus: int = 1, ahead: int | None = None) -> Iterator[Any]:
        """`fn(job)` for every job, in order; the first `ahead` (default 2 x workers) are submitted at the call, the
        rest one by one as results are taken (inline jobs run only as their results are taken). `work_bytes` (bytes
        the jobs touch) lets a small run stay inline.
        `threads`: the jobs spend their time outside the GIL (numpy, hashing, kernel copies), so on this host they
        run on `workers` threads of this process: a process pool would add its start-up (a forkserver importing
        torch, each worker importing the stage) to jobs of seconds. Ray still runs them as tasks. `cpus`: the CPUs
        each job holds (Ray reserves them; the job sets its own threads: see `cpus_per_job`)."""
        jobs = list(jobs)
        if len(jobs) <= 1 or self.workers <= 1 or (work_bytes is not None and work_bytes < INLINE_BELOW):
            self.used = "inline"
            return (fn(j) for j in jobs)
        if threads and self.local:
            from dsconv.runtime.threads import serial_pool

            self.used = "threads"
            pool = serial_pool(self.workers, "dsconv-job")
            return _closing(_bounded(lambda j: pool.submit(fn, j), lambda f: f.result(), jobs,
                                     ahead or 2 * self.workers), pool)
        self.used = self.name
        return self._map(fn, jobs, cpus, ahead or 2 * self.workers)

    def _map(self, fn: Callable[[Any], Any], jobs: list[Any], cpus: int, ahead: int) -> Iterator[Any]:
        return (fn(j) for j in jobs)

    def warm(self, work_bytes: int | None = None, modules: Sequence[str] = ()) -> None:
        """Start the workers now, in the background, when jobs of `work_bytes` will come: their start-up (a
        forkserver importing torch, each worker importing `modules`) then overlaps the driver's own set-up. Nothing
        to start inline or on threads."""

    def cpus_per_job(self, jobs: int) -> int:
        """How many CPUs each of `jobs` concurrent jobs may use without another job waiting: 1 here - on one host
        the driver's own threads already cover every core, and local workers split them (`_worker_init`)."""
        return 1

    def node_cpus(self) -> int:
        """The CPUs one job can hold at most (its threads share one host's memory): 1 for local workers."""
        return 1

    def summary(self) -> dict[str, Any]:
        return {"executor": self.name, "workers": self.workers, "ran": self.used}

    def close(self) -> None:
        pass

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _bounded(submit: Callable[[Any], Any], wait: Callable[[Any], Any], jobs: Iterable[Any],
             ahead: int) -> Iterator[Any]:
    """Submit the first `ahead` jobs now - they run while the caller goes on with other work before it takes the
    first result (calibration's expert jobs during the driver's searches) -, then one more as each result is taken;
    the results come back in order."""
    it = iter(jobs)
    pending = deque(submit(j) for j in itertools.islice(it, max(1, ahead)))
    return _in_order(pending, it, submit, wait)


def _in_order(pending: deque, it: Iterator[Any], submit: Callable[[Any], Any],
              wait: Callable[[Any], Any]) -> Iterator[Any]:
    while pending:
        head = pending.popleft()
        nxt = next(it, _END)
        if nxt is not _END:
            pending.append(submit(nxt))
        yield wait(head)


_END = object()


def _closing(results: Iterator[Any], pool: Any) -> Iterator[Any]:
    """`results`, then the thread pool shut down (also when the consumer stops early: no job keeps running)."""
    try:
        yield from results
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _worker_init(threads: int) -> None:
    """Each worker's torch gets its share of the cores: N workers x all threads would thrash."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def _import_modules(modules: Sequence[str]) -> int:
    """A worker's first task when warmed: the job modules imported before the first real job arrives."""
    import importlib

    for m in modules:
        importlib.import_module(m)
    return os.getpid()


class ProcessExecutor(Executor):
    """A local process pool (forkserver, else spawn): workers import dsconv afresh and read inputs by path."""

    name = "local"

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self._pool = None
        self._warming: Any = None  # `warm`'s thread, joined before the pool is used or closed

    def warm(self, work_bytes: int | None = None, modules: Sequence[str] = ()) -> None:
        """The pool started on a thread that waits for every worker to import `modules`; the driver goes on (a
        tokenizer's load holds the GIL, the waiting thread does not). A failure to start surfaces at the first map."""
        import threading

        if self.workers <= 1 or self._pool is not None or (work_bytes is not None and work_bytes < INLINE_BELOW):
            return
        self._warming = threading.Thread(target=self._warm_up, args=(tuple(modules),), name="dsconv-pool-start",
                                         daemon=True)
        self._warming.start()

    def _warm_up(self, modules: tuple[str, ...]) -> None:
        try:
            pool = self._start()
            for f in [pool.submit(_import_modules, modules) for _ in range(self.workers)]:
                f.result()
        except Exception:  # noqa: BLE001 - the same failure is raised, with its context, by the first map
            pass

    def _join_warm(self) -> None:
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    def _start(self):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        if self._pool is None:
            methods = mp.get_all_start_methods()
            ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
            if ctx.get_start_method() == "forkserver":
                ctx.set_forkserver_preload(list(PRELOAD))
            share = max(1, (os.cpu_count() or 1) // self.workers)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_worker_init,
                                             initargs=(share,))
        return self._pool

    def _map(self, fn: Callable[[Any], Any], jobs: list[Any], cpus: int, ahead: int) -> Iterator[Any]:
        self._join_warm()
        pool = self._start()
        return _bounded(lambda j: pool.submit(fn, j), lambda f: f.result(), jobs, ahead)

    def close(self) -> None:
        self._join_warm()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class RayExecutor(Executor):
    """Ray tasks (one CPU each, unless `map` is given more). Connects to `address` (e.g. "auto" after `ray start
    --head`), or starts a local instance with `workers` CPUs; a Ray already initialised in this process (a test's)
    is used as it is."""

    name = "ray"
    local = False

    def __init__(self, workers: int | None, address: str | None) -> None:
        ray = import_ray()
        self._own = not ray.is_initialized()
        if self._own:
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            if address:
                kw["address"] = address
            elif workers:
                kw["num_cpus"] = workers
            try:
                ray.init(**kw)
            except ConnectionError as e:
                raise UserError(f"cannot reach the Ray cluster at {address}: {e}",
                                hint="start it with `ray start --head` or fix --ray-address") from None
        cpus = int(ray.cluster_resources().get("CPU", 1))
        super().__init__(workers or cpus)
        self._ray = ray

    def cpus_per_job(self, jobs: int) -> int:
        """The cluster's share per job when there are fewer jobs than workers (a layer's forward over 5 calibration
        batches on 16 workers), at most one node's CPUs - a task's threads share one host's memory."""
        return max(1, min(self.node_cpus(), self.workers // max(1, jobs)))

    def node_cpus(self) -> int:
        """The smallest live node's CPUs: a job of that many fits on any node."""
        nodes = [int(n["Resources"].get("CPU", 0)) for n in self._ray.nodes() if n.get("Alive")]
        return min((c for c in nodes if c > 0), default=1)

    def _map(self, fn: Callable[[Any], Any], jobs: list[Any], cpus: int, ahead: int) -> Iterator[Any]:
        ray = self._ray
        remote = ray.remote(num_cpus=cpus, max_retries=0)(fn)

        def wait(ref: Any) -> Any:
            try:
                return ray.get(ref)
            except ray.exceptions.RayTaskError as e:  # the task's own exception (a UserError stays exit 2)
                cause = getattr(e, "cause", None)
                raise (cause if isinstance(cause, BaseException) else e) from None

        return _bounded(lambda j: remote.remote(j), wait, jobs, ahead)

    def close(self) -> None:
        if self._own and self._ray.is_initialized():
            self._ray.shutdown()


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("--executor ray needs Ray, which is not installed",
                        hint="pip install 'dsconv[ray]' (on the driver and every node), or use --executor local") \
            from None
    return ray


def make_executor(opts: ExecOptions | None) -> Executor:
    """The executor the options ask for (inline for one worker)."""
    opts = opts or ExecOptions(workers=1)
    check_options(opts)
    if opts.executor == "ray":
        return RayExecutor(opts.workers, opts.ray_address)
    n = opts.resolved_workers()
    return ProcessExecutor(n) if n > 1 else Executor(1)
