"""Byte-bound work split over worker processes and, under torchrun, over ranks; merged in a fixed order.

A command hands :func:`map_units` a list of independent units (a data file for ``check --deep``, a run of
keys for ``diff --values``, a file to hash for ``seal``) with their weights in bytes and a function of one
unit's index. The units are cut into shares balanced by bytes (:func:`shares`: largest first, each to the
lightest share, ties to the lowest share: the same shares on every rank and every run). Under torchrun
(:mod:`ckptdoctor.dist`) each rank takes one share and the results are exchanged; on one machine a pool of
``jobs`` forked processes works through the units. Either way the results come back in unit order, so what a
command prints does not depend on ``--jobs`` or the number of ranks.

Workers are forked (``fork`` start method): they inherit the parsed checkpoint, so nothing large is pickled
towards them; only each unit's (small) result is pickled back. Each worker holds at most one unit's working
set (one file's read window or one key's chunks), so memory in flight is ``jobs`` times one worker's bound.
A unit that raises fails the run with the exception of the first failing unit in unit order, as a
sequential run would.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptdoctor import dist

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
    import pickle

    from ckptdoctor.errors import CkptError

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
        from ckptdoctor.errors import CkptError

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


def _worker_init() -> None:
    """In each forked worker: Ctrl-C is the parent's to answer (it ends the workers), SIGTERM ends a worker (the
    parent's SIGTERM handler, inherited by the fork, would raise in it instead: the pool ends its workers with
    SIGTERM), and a worker ends with the parent however the parent dies (Linux ``PR_SET_PDEATHSIG``), so no
    worker outlives its run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass


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
        if jobs == 1 or not (threads or "fork" in multiprocessing.get_all_start_methods()):
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
        pool = multiprocessing.get_context("fork").Pool(jobs, initializer=_worker_init)
        try:
            # Thousands of small units (check --deep's data files) go to the workers a few at a time: one round
            # trip per unit cost ~0.1 ms of each side's CPU; 16 shares per worker keep the load balanced.
            batch = max(1, min(16, len(indices) // (jobs * 16)))
            for index, outcome in zip(indices, pool.imap(_run, indices, batch)):
                results[index] = _record(index, outcome, done)
        except BaseException:  # Ctrl-C, an error: the workers are ended (SIGTERM), nothing is left running
            pool.terminate()
            pool.join()
            raise
        pool.close()
        pool.join()
    finally:
        _TASK = None
    return results


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
