"""Byte-bound work split over worker processes and, under torchrun, over ranks; merged in a fixed order.

A command hands :func:`map_units` a list of independent units (a data file for ``check --deep``, a run of
keys for ``diff --values``, a file to hash for ``seal``) with their weights in bytes and a function of one
unit's index. The units are cut into shares balanced by bytes (:func:`shares`: largest first, each to the
lightest share, ties to the lowest share: the same shares on every rank and every run). Under torchrun
(:mod:`ckptdoctor.dist`) each rank takes one share and the results are exchanged; on one machine a pool of
``jobs`` forked processes works through the units. Either way the results come back in unit order, so what a
command prints does not depend on ``--jobs`` or the number of ranks.

Workers are forked: they inherit the parsed checkpoint, so nothing large is pickled towards them; only each
unit's (small) result is pickled back, on a pipe of the worker's own. Each worker holds at most one unit's
working set (one file's read window or one key's chunks), so memory in flight is ``jobs`` times one worker's
bound. A unit that raises fails the run with the exception of the first failing unit in unit order, as a
sequential run would. Ending a run early (an error, Ctrl-C at any instant) kills and reaps every worker and
cannot block (:class:`_Worker`).
"""

from __future__ import annotations

import os
import pickle
import signal
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from ckptdoctor import dist
from ckptdoctor.errors import CkptError

_TASK: Callable[[int], Any] | None = None  # the function forked workers run (inherited, never pickled)


def default_jobs() -> int:
    """Cores this process may run on (``os.sched_getaffinity``), shared among the ranks of this node under
    torchrun (``LOCAL_WORLD_SIZE``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) if dist.under_torchrun() else 1
    return max(1, cores // max(1, local))


def shares(weights: Sequence[int], n: int) -> list[list[int]]:
    """Unit indices cut into ``n`` shares of about equal weight, each share in unit order (deterministic)."""
    loads = [0] * max(1, n)
    out: list[list[int]] = [[] for _ in loads]
    for index in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        lightest = min(range(len(loads)), key=lambda s: (loads[s], s))
        loads[lightest] += weights[index]
        out[lightest].append(index)
    return [sorted(share) for share in out]


def consecutive_runs(weights: Sequence[int], count: int) -> list[tuple[int, int]]:
    """Consecutive (start, end) runs of the units, about ``count`` of them, of about equal weight each (units a
    command compares in a fixed order: each run is one unit of :func:`map_units`)."""
    total = sum(weights)
    target = max(1, -(-total // max(1, count)))
    out: list[tuple[int, int]] = []
    lo = acc = 0
    for i, w in enumerate(weights):
        acc += w
        if acc >= target:
            out.append((lo, i + 1))
            lo, acc = i + 1, 0
    if lo < len(weights):
        out.append((lo, len(weights)))
    return out


def runs_inline(jobs: int | None, units: int) -> bool:
    """Whether :func:`map_units` runs ``units`` units in this process (one job or one unit, no torchrun group)."""
    return dist.group() is None and min(jobs or default_jobs(), units) <= 1


@dataclass
class Failed:
    """A unit's exception, carried back as text when it cannot be pickled."""

    kind: str
    message: str
    exit_code: int


def _run(index: int) -> tuple[bool, Any]:
    assert _TASK is not None
    try:
        return True, _TASK(index)
    except Exception as exc:  # carried back and re-raised in unit order
        return False, _portable(exc)


def _portable(exc: Exception) -> Any:
    if isinstance(exc, CkptError) and type(exc) is not CkptError:
        # Subclasses with their own __init__ (MissingExtraError, UnsafePickleError, ...) do not survive a
        # pickle round trip; what the user sees of them is their one line and exit code, which is kept.
        return Failed("CkptError", str(exc), exc.exit_code)
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return Failed(type(exc).__name__, str(exc), getattr(exc, "exit_code", 2))


def _reraise(error: Any) -> None:
    if isinstance(error, Failed):
        if error.kind == "CkptError":
            carried = CkptError(error.message)
            carried.exit_code = error.exit_code
            raise carried
        raise RuntimeError(f"{error.kind}: {error.message}")
    raise error


def _record(index: int, outcome: tuple[bool, Any], done: Callable[[int], None] | None) -> tuple[bool, Any]:
    if done is not None and outcome[0]:
        done(index)
    return outcome


_ENDING = {signal.SIGINT, signal.SIGTERM}


def _worker_init(parent: int) -> None:
    """In each forked worker: Ctrl-C is the parent's to answer (it ends the workers), SIGTERM ends a worker (the
    parent's handler, inherited by the fork, would raise in it instead), and a worker ends with the parent
    however the parent dies (Linux ``PR_SET_PDEATHSIG``), so no worker outlives its run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


@dataclass
class _Worker:
    """A forked worker: batch numbers in on ``tasks``, each batch's outcomes back on ``results``. A pipe each way
    per worker, each with one writer and one reader: no lock is shared with a process that can die holding it
    (``multiprocessing.Pool`` shares its queues' locks: a worker ended while sending a result made
    ``Pool.terminate()`` wait forever for the result queue's lock)."""

    pid: int  # 0 once reaped
    tasks: Connection
    results: Connection
    queued: deque[int]


def _serve(tasks: Connection, results: Connection, batches: list[list[int]]) -> None:
    while True:
        try:
            outcomes = [_run(index) for index in batches[int.from_bytes(tasks.recv_bytes(), "little")]]
        except EOFError:  # the parent is done
            return
        try:
            payload = pickle.dumps(outcomes, pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # a result that cannot be pickled fails its units
            payload = pickle.dumps([(False, _portable(exc))] * len(outcomes))
        results.send_bytes(payload)


def _fork(workers: list[_Worker], batches: list[list[int]]) -> None:
    """One more worker in ``workers``. SIGINT and SIGTERM are held across the fork: one landing in between
    would run the parent's handler in the worker, or in the parent before the worker is on the list."""
    parent, (task_r, task_w), (result_r, result_w) = os.getpid(), os.pipe(), os.pipe()
    held, pid = signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING), -1
    try:
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            try:
                for other in workers:  # the others' pipes: a worker's death must be seen as EOF
                    other.tasks.close()
                    other.results.close()
                os.close(task_w)
                os.close(result_r)
                _worker_init(parent)
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
                _serve(Connection(task_r), Connection(result_w), batches)
                os._exit(0)
            finally:
                os._exit(1)
        workers.append(_Worker(pid, Connection(task_w), Connection(result_r), deque()))
    finally:
        for fd in (task_r, result_w) if pid > 0 else (task_r, task_w, result_r, result_w):
            os.close(fd)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _pool(indices: list[int], jobs: int, done: Callable[[int], None] | None) -> dict[int, tuple[bool, Any]]:
    """index -> (ok, result) on ``jobs`` forked workers, ``done`` called in unit order. However it ends (an
    error, Ctrl-C anywhere), every worker is ended (SIGKILL unless idle) and reaped before this returns."""
    # Thousands of small units (check --deep's data files) go to the workers a few at a time: one round trip
    # per unit cost ~0.1 ms of each side's CPU; 16 shares per worker keep the load balanced.
    size = max(1, min(16, len(indices) // (jobs * 16)))
    batches = [indices[at : at + size] for at in range(0, len(indices), size)]
    results: dict[int, tuple[bool, Any]] = {}
    workers: list[_Worker] = []
    handed = cursor = 0
    finished = False
    try:
        for _ in range(jobs):
            _fork(workers, batches)
        while True:
            for worker in workers:  # two batches ahead: a worker never waits for its next one
                while len(worker.queued) < 2 and handed < len(batches):
                    with suppress(BrokenPipeError):  # it died: its results' EOF says so
                        worker.tasks.send_bytes(handed.to_bytes(8, "little"))
                    worker.queued.append(handed)
                    handed += 1
            busy = {worker.results: worker for worker in workers if worker.queued}
            if not busy:
                break
            for ready in wait(list(busy)):
                worker = busy[ready]  # type: ignore[index]
                try:
                    outcomes = pickle.loads(worker.results.recv_bytes())
                except (EOFError, OSError):  # it died
                    worker.tasks.close()
                    worker.results.close()
                    worker.pid, code = 0, os.waitstatus_to_exitcode(os.waitpid(worker.pid, 0)[1])
                    how = f"was killed by signal {-code}" if code < 0 else f"exited ({code})"
                    how += " (out of memory?)" if code == -signal.SIGKILL else ""
                    raise CkptError(f"a worker process {how} before returning its results") from None
                results.update(zip(batches[worker.queued.popleft()], outcomes))
            while cursor < len(indices) and indices[cursor] in results:
                _record(indices[cursor], results[indices[cursor]], done)
                cursor += 1
        finished = True
    finally:
        _end(workers, kill=not finished)
    return results


def _end(workers: list[_Worker], kill: bool) -> None:
    """Every worker ended (EOF to an idle one, SIGKILL to a busy one) and reaped, SIGINT and SIGTERM held
    meanwhile. An exception from a handler run here anyway (a signal another thread took) is raised after."""
    held, late = signal.pthread_sigmask(signal.SIG_BLOCK, _ENDING), None
    for worker in workers:
        for _ in range(3):  # tried again only after an exception (bounded: this must never spin)
            try:
                worker.tasks.close()
                worker.results.close()
                if kill and worker.pid:
                    with suppress(ProcessLookupError):
                        os.kill(worker.pid, signal.SIGKILL)
                if worker.pid:
                    with suppress(ChildProcessError):
                        os.waitpid(worker.pid, 0)
                worker.pid = 0
                break
            except BaseException as exc:
                late, kill = exc, True
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if late is not None:
        raise late


def _local(
    indices: list[int], task: Callable[[int], Any], jobs: int, done: Callable[[int], None] | None, threads: bool
) -> dict:
    """index -> (ok, result) for ``indices``, on ``jobs`` forked processes or threads (inline for one job or
    one unit)."""
    global _TASK
    results: dict[int, tuple[bool, Any]] = {}
    jobs = max(1, min(jobs, len(indices)))
    _TASK = task
    try:
        if jobs == 1 or not (threads or hasattr(os, "fork")):
            for index in indices:
                results[index] = _run(index)
                if not results[index][0]:
                    break  # a sequential run stops at the first failure
                if done is not None:
                    done(index)
            return results
        if threads:
            with ThreadPoolExecutor(jobs, thread_name_prefix="ckptdoctor-worker") as threads_pool:
                try:
                    for index, outcome in zip(indices, threads_pool.map(_run, indices)):
                        results[index] = _record(index, outcome, done)
                except BaseException:  # Ctrl-C: the queued units are dropped, not waited for
                    threads_pool.shutdown(wait=False, cancel_futures=True)
                    raise
            return results
        return _pool(indices, jobs, done)
    finally:
        _TASK = None


def map_units(
    weights: Sequence[int],
    task: Callable[[int], Any],
    jobs: int | None = None,
    done: Callable[[int], None] | None = None,
    threads: bool = False,
) -> list[Any]:
    """``task(i)`` for every unit ``i`` (weights in bytes), in unit order; see the module doc.

    ``done(i)`` is called in this process as unit ``i`` completes here (for a progress bar). ``threads``: a
    thread pool instead of processes, for work that releases the GIL (hashing).
    """
    jobs = jobs or default_jobs()
    group = dist.group()
    everything = list(range(len(weights)))
    if group is None:
        results = _local(everything, task, jobs, done, threads)
    else:
        mine = shares(weights, group.world)[group.rank]
        results = {}
        for part in group.exchange(_local(mine, task, jobs, done, threads)):
            results.update(part)
    out = []
    for index in everything:
        ok, value = results.get(index, (False, None))
        if not ok:
            if value is None:  # a unit after one that failed in the same worker: never run
                continue
            _reraise(value)
        out.append(value)
    return out
