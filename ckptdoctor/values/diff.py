"""``diff --values``: tensor values compared in global coordinates, streamed one chunk at a time.

A and B may be chunked differently (TP=1 vs TP=4, PP stages): :mod:`ckptdoctor.values.tensor` plans the
overlap of the two chunk grids per key and decodes each chunk once; :mod:`ckptdoctor.values.accumulate`
compares the regions. Memory is bounded by a few chunks per worker, never the checkpoint.

Equality is bitwise by default (same dtype, same bits: NaN payloads and -0.0 matter); with ``atol``/``rtol``
it is ``|a - b| <= atol + rtol * |b|`` with NaN positions required to match. Bytes items (ShardedObjects:
rng state, ``_extra_state``, rerun state) are compared by the sha256 of their raw bytes; when the bytes
differ, both are decoded (safe unpickler) and compared as objects, because torch.save archives of equal
objects can differ in serialization details.

Keys are cut into runs of about equal bytes in A's file order, compared by ``jobs`` forked processes or the
ranks of a torchrun job (:mod:`ckptdoctor.parallel`); the results are sorted by key, so they do not depend on
how the work was split (only ``seconds``, ``workers`` and ``peak_in_flight`` measure the run itself).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptdoctor import dist, parallel
from ckptdoctor.logical_items import KIND_TENSOR, Item
from ckptdoctor.progress import Progress
from ckptdoctor.values.accumulate import SLAB_ELEMENTS, Accumulator, finite
from ckptdoctor.values.health_tap import HealthTap
from ckptdoctor.values.io import Context, InFlight, ReadCounter, Torch
from ckptdoctor.values.objects import compare_objects
from ckptdoctor.values.read import numpy_or_none
from ckptdoctor.values.report import ValueDiff, ValuesReport
from ckptdoctor.values.tensor import Side, compare_entries, numel

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint, Entry

__all__ = ["SLAB_ELEMENTS", "Accumulator", "ValueDiff", "ValuesReport", "compare_values"]
_Accumulator = Accumulator  # the name earlier tests import


def compare_tensor(
    a: Checkpoint,
    ia: Item,
    b: Checkpoint,
    ib: Item,
    atol: float | None,
    rtol: float | None,
    ctx: Context,
    report: int = 0,
) -> ValueDiff:
    ea, eb = ia.entry, ib.entry
    if ea.shape != eb.shape:
        return ValueDiff(
            ia.key,
            ia.section,
            KIND_TENSOR,
            None,
            None,
            None,
            None,
            f"global shapes differ ({list(ea.shape or ())} vs {list(eb.shape or ())})",
        )
    acc = Accumulator(ctx.torch, atol, rtol, report)
    try:
        covered = compare_entries(Side(a, ea, "a"), Side(b, eb, "b"), acc, ctx)
    finally:
        ctx.preread.clear()
    size = numel(ea.shape or ())
    note = None
    if covered != size:
        note = f"the chunks of A and B overlap on {covered} of {size} elements; only those were compared"
    if acc.nan_mismatch:
        note = (note + "; " if note else "") + f"NaN positions differ at {acc.nan_mismatch} elements"
    if acc.padding:
        note = (note + "; " if note else "") + f"{acc.padding} bucket padding elements (never written) not compared"
    if ea.dtype != eb.dtype:
        note = (note + "; " if note else "") + f"dtypes differ ({ea.dtype} vs {eb.dtype})"
    equal = acc.mismatched == 0 and covered == size and (acc.tolerance or ea.dtype == eb.dtype)
    return ValueDiff(
        ia.key,
        ia.section,
        KIND_TENSOR,
        equal,
        finite(acc.max_abs),
        acc.mismatched,
        acc.elements,
        note,
        max_rel_diff=finite(acc.max_rel),
        norm_diff=finite(math.sqrt(acc.sum_sq)),
        mismatches=acc.first_mismatches() if not equal else None,
    )


def _twins(a: Checkpoint, ea: Entry, b: Checkpoint, eb: Entry, ctx: Context) -> bool:
    """The most common key of a same-layout diff, without the general walk: one chunk on each side, the same
    non-empty box covering the key, the same dtype, byte-identical ranges. True for such a key (the reads and the
    in-flight bytes accounted as :func:`compare_entries` would); False for any other key (ranges already read
    are handed to it in ``ctx.preread``, so nothing is read twice)."""
    if len(ea.chunks) != 1 or len(eb.chunks) != 1 or ea.dtype != eb.dtype:
        return False
    ca, cb = ea.chunks[0], eb.chunks[0]
    if ca.storage is None or cb.storage is None or ca.offsets != cb.offsets or ca.sizes != cb.sizes:
        return False
    if not all(ca.sizes) or tuple(ca.sizes) != tuple(ea.shape or ()) or any(ca.offsets):
        return False
    limit = ea.max_range_bytes(ca)  # the same for both: same kind, dtype and sizes
    blob = ctx.files.read(a, ca.storage, limit)
    twin = ctx.files.read(b, cb.storage, limit)
    if blob != twin:
        ctx.preread[("a", id(ca))] = blob
        ctx.preread[("b", id(cb))] = twin
        return False
    ctx.inflight.acquire(len(blob) + len(twin))
    ctx.inflight.release(len(blob) + len(twin))
    if ctx.health is not None:
        ctx.health.add_twin(a, ea, ca, blob)
    ctx.read.add("a", len(blob))
    ctx.read.add("b", len(twin))
    return True


# --- driver --------------------------------------------------------------------------------------------


def _order(pairs: list[tuple[Item, Item]]) -> tuple[list[tuple[Item, Item]], list[int]]:
    """The pairs in A's on-disk order (the file and offset of A's first stored chunk; ties in their given order)
    and their weights (bytes of both sides' chunks), in one pass over the chunks."""
    keyed = []
    for index, pair in enumerate(pairs):
        first: tuple | None = None
        weight = 0
        for side, item in enumerate(pair):
            for entry in item.entries.values():
                for chunk in entry.chunks:
                    location = chunk.storage
                    if location is not None:
                        weight += location.length
                        if first is None and not side:
                            first = (location.relative_path, location.offset)
        keyed.append((first or ("", 0), index, weight))
    keyed.sort()
    return [pairs[i] for _, i, _ in keyed], [w for _, _, w in keyed]


def _needs_torch(pair: tuple[Item, Item]) -> bool:
    """Values of this tensor pair are decoded for sure (different grids or dtypes), not only memcmp'ed."""
    ia, ib = pair
    if ia.kind != KIND_TENSOR or ib.kind != KIND_TENSOR or ia.entry.shape != ib.entry.shape:
        return False
    grid_a = sorted((c.offsets, c.sizes) for c in ia.entry.chunks)
    return grid_a != sorted((c.offsets, c.sizes) for c in ib.entry.chunks) or ia.entry.dtype != ib.entry.dtype


@dataclass
class _Run:
    """What one run of keys gave: the keys that differ or were not compared (the equal ones only counted, so a
    worker pickles back little), the largest finite and the non-finite max abs differences, bytes read per side,
    the most bytes held at once."""

    different: list[ValueDiff]
    skipped: list[ValueDiff]
    compared: int
    equal: int
    top: float | None
    texts: set[str]
    a: int
    b: int
    peak: int
    health: HealthTap | None = None  # with stats: the statistics of the chunks this run read


def _compare_run(
    a: Checkpoint,
    b: Checkpoint,
    pairs: list[tuple[Item, Item]],
    atol: float | None,
    rtol: float | None,
    ctx: Context,
    report: int,
) -> tuple[list[ValueDiff], int]:
    """The results of a run of key pairs, less the byte-identical single-chunk tensor keys (:func:`_twins`),
    which are only counted: each is what :func:`compare_tensor` reports for it (equal, max abs diff 0.0)."""
    found = []
    twins = 0
    for ia, ib in pairs:
        if ia.kind == KIND_TENSOR == ib.kind:
            ea, eb = ia.entry, ib.entry
            if ea.shape == eb.shape and _twins(a, ea, b, eb, ctx):
                twins += 1
                continue
        found.append(_compare_pair(a, b, ia, ib, atol, rtol, ctx, report))
    return found, twins


def _summary(found: list[ValueDiff], twins: int, counter: ReadCounter, peak: int) -> _Run:
    """A run's results as :class:`_Run`; ``twins`` equal keys (max abs diff 0.0) not in ``found``."""
    equal = twins + sum(r.equal is True for r in found)
    different = [r for r in found if r.equal is False]
    skipped = [r for r in found if r.equal is None]
    finite_diffs = [r.max_abs_diff for r in found if isinstance(r.max_abs_diff, float)] + [0.0] * bool(twins)
    texts = {r.max_abs_diff for r in found if isinstance(r.max_abs_diff, str)}
    top = max(finite_diffs) if finite_diffs else None
    return _Run(different, skipped, equal + len(different), equal, top, texts, counter.a, counter.b, peak)


def _fields_limited(result: ValueDiff, limit: int) -> ValueDiff:
    """A differing bytes item with at most ``limit`` of its differing fields listed (``fields_count`` says all)."""
    if result.fields is not None:
        result.fields = result.fields[:limit]
    return result


def compare_values(
    a: Checkpoint,
    b: Checkpoint,
    pairs: list[tuple[Item, Item]],
    atol: float | None = None,
    rtol: float | None = None,
    limit: int | None = 20,
    progress: Progress | None = None,
    workers: int | None = None,
    report: int = 0,
    meanwhile: Callable[[], None] | None = None,
    health: HealthTap | None = None,
) -> ValuesReport:
    """Values of the key pairs (same logical key in A and B), in A's on-disk order for sequential reads.

    ``workers`` processes (default: the available cores; see :mod:`ckptdoctor.parallel`) compare runs of keys
    of about equal bytes; under torchrun the runs are shared among the ranks.

    ``meanwhile``: the caller's other work (``diff``'s structural comparison), run once in this process: while
    the forked workers read (after the first run is back), else (one process, torchrun) before reading. Its
    errors come first either way: when a run fails before it has run, it runs, and its error is the one raised.

    ``health``: every chunk read is also measured as ``check --health`` measures it, into this tap (merged from
    the runs), so ``diff --values --stats`` reads each byte once.
    """
    start = time.perf_counter()
    ordered, weights = _order(pairs)
    total = sum(weights)
    jobs = workers or parallel.default_jobs()
    group = dist.group()
    runs = parallel.consecutive_runs(weights, jobs * (group.world if group else 1) * 4)
    inline = parallel.runs_inline(jobs, len(runs))
    torch = Torch()
    if not inline:
        # once, before the workers fork (each would import it again); with numpy, keys of one dtype are compared
        # as bit patterns and torch is imported only where values differ
        numpy = numpy_or_none() is not None
        if any(_needs_torch(p) for p in ordered if not numpy or p[0].dtype != p[1].dtype):  # a tensor's dtype
            torch.get()

    def task(index: int) -> _Run:
        lo, hi = runs[index]
        counter = ReadCounter(progress.advance if inline and progress is not None else None)
        ctx = Context(counter, InFlight(1 << 62), torch)  # a count only: each worker holds one key's chunks
        ctx.health = HealthTap() if health is not None else None
        ctx.files.plan(a, (e for ia, _ in ordered[lo:hi] for e in ia.entries.values()))  # remote: few requests
        ctx.files.plan(b, (e for _, ib in ordered[lo:hi] for e in ib.entries.values()))
        try:
            found, twins = _compare_run(a, b, ordered[lo:hi], atol, rtol, ctx, report)
        finally:
            ctx.files.close()
        run = _summary(found, twins, counter, ctx.inflight.peak)
        run.health = ctx.health
        return run

    pending = [meanwhile] if meanwhile is not None else []
    deferred: list[Exception] = []  # what meanwhile raised while the workers ran (raised once they are done)

    def run_meanwhile() -> None:
        if deferred:
            raise deferred.pop()
        if pending:
            pending.pop()()

    def done(index: int) -> None:
        # Not raised here, in the middle of the workers' run: that ends the pool (Pool.terminate), and a worker
        # ended while it sends a result leaves the result queue's lock held, so terminate() waits for it forever
        # (seen in CI: diff --values of a damaged checkpoint hung). Raised as soon as map_units returns.
        if pending:
            try:
                pending.pop()()
            except Exception as exc:  # noqa: BLE001 - any error of the structural comparison, raised below
                deferred.append(exc)
        if progress is not None:
            progress.advance(sum(weights[runs[index][0] : runs[index][1]]))

    if inline or group is not None:  # torchrun: every rank has run it before the ranks exchange results
        before = time.perf_counter()
        run_meanwhile()
        start += time.perf_counter() - before  # not part of the values' seconds
    if progress is not None:
        progress.start("reading values", total)
    try:
        parts = parallel.map_units([sum(weights[lo:hi]) for lo, hi in runs], task, jobs, None if inline else done)
    except Exception:
        run_meanwhile()  # raises first what it would have raised had it run before the values
        raise
    finally:
        torch.restore()
        if progress is not None:
            progress.finish()
    run_meanwhile()  # not run yet: no run came back (no pairs)
    if health is not None:
        for part in parts:
            if part.health is not None:
                health.merge(part.health)
    different = sorted((r for part in parts for r in part.different), key=lambda r: r.key)
    skipped = sorted((r for part in parts for r in part.skipped), key=lambda r: r.key)
    finite_diffs = [part.top for part in parts if part.top is not None]
    texts = {t for part in parts for t in part.texts}
    overall: float | str | None = (
        "nan" if "nan" in texts else "inf" if "inf" in texts else (max(finite_diffs) if finite_diffs else None)
    )
    return ValuesReport(
        mode="tolerance" if atol is not None or rtol is not None else "bitwise",
        atol=atol or 0.0,
        rtol=rtol or 0.0,
        compared=sum(part.compared for part in parts),
        equal=sum(part.equal for part in parts),
        different=len(different),
        not_compared=len(skipped),
        max_abs_diff=overall,
        bytes_read={"a": sum(p.a for p in parts), "b": sum(p.b for p in parts)},
        seconds=round(time.perf_counter() - start, 3),
        workers=1 if inline else max(1, min(jobs, len(runs))),
        peak_in_flight=max((p.peak for p in parts), default=0),
        different_keys=different if limit is None else [_fields_limited(r, limit) for r in different[:limit]],
        not_compared_keys=skipped if limit is None else skipped[:limit],
    )


def _compare_pair(
    a: Checkpoint,
    b: Checkpoint,
    ia: Item,
    ib: Item,
    atol: float | None,
    rtol: float | None,
    ctx: Context,
    report: int,
) -> ValueDiff:
    if ia.kind != ib.kind:
        return ValueDiff(ia.key, ia.section, ia.kind, None, None, None, None, f"kinds differ ({ia.kind} vs {ib.kind})")
    if ia.kind == KIND_TENSOR:
        return compare_tensor(a, ia, b, ib, atol, rtol, ctx, report)
    return compare_objects(a, ia, b, ib, ctx)
