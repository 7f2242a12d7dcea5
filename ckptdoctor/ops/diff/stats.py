"""``diff --values --stats``: the statistics of ``check --health`` for two checkpoints side by side.

Each side goes through ``check --health``'s one streaming pass (:func:`ckptdoctor.ops.check.health_scan`), so the
numbers are exact and the same at any layout: a resharded copy of one saved state has equal statistics and
fingerprints, and every relative change is exactly 0. Stacked keys (``decoder.layers.*``, experts) get one row per
layer / expert, so a table shows which layers moved between two iterations.
"""

from __future__ import annotations

import math

from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.ops.check import health_scan
from ckptdoctor.ops.diff.report import SliceStats, StatsDiff, StatsRow
from ckptdoctor.progress import Progress
from ckptdoctor.values.health import KeyStats, Moments, moment_values


def compare_stats(
    a: Checkpoint,
    b: Checkpoint,
    keys: set[str],
    limit: int | None = None,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> StatsDiff:
    """Both checkpoints' statistics of the tensor ``keys`` (those in both that the filters kept), one row per key
    or per slice of a stacked key, the largest change first (then key and slice order); ``limit`` caps the rows
    listed (counts are complete)."""
    scan_a = health_scan(a.iteration_dir, a.iteration_dir, jobs, progress)
    scan_b = health_scan(b.iteration_dir, b.iteration_dir, jobs, progress)
    rows: list[StatsRow] = []
    compared = 0
    for key in sorted(keys & scan_a.keys.keys() & scan_b.keys.keys()):
        stats_a, stats_b = scan_a.keys[key], scan_b.keys[key]
        if stats_a.dtype != stats_b.dtype or stats_a.shape != stats_b.shape:
            continue  # a kind, dtype or shape change: the structural diff reports it
        compared += 1
        if stats_a.axes and stats_a.axes == stats_b.axes:
            for index in sorted(stats_a.slices.keys() & stats_b.slices.keys()):
                where = dict(zip(stats_a.axes, index))
                rows.append(_row(key, where, stats_a, stats_a.slices[index], stats_b.slices[index]))
        else:
            rows.append(_row(key, {}, stats_a, stats_a.whole(), stats_b.whole()))
    changed = sum(not row.equal for row in rows)
    rows.sort(key=_largest_change_first)  # stable: equal rows stay in key and slice order
    return StatsDiff(compared, len(rows), changed, rows if limit is None else rows[:limit])


def _largest_change_first(row: StatsRow) -> tuple[bool, float]:
    """Changed rows first, the largest relative change first (from zero: infinite); a changed row whose
    statistics all match (values moved, moments did not) before the equal ones."""
    changes = (row.l2_change, row.std_change, row.mean_change)
    size = max(math.inf if c is None else abs(c) for c in changes)
    return row.equal, -size


def _row(key: str, where: dict[str, int], stats: KeyStats, a: Moments, b: Moments) -> StatsRow:
    side_a, side_b = _side(a, stats.dtype), _side(b, stats.dtype)
    return StatsRow(
        key,
        where,
        side_a,
        side_b,
        side_a.fingerprint == side_b.fingerprint,
        relative_change(side_a.l2, side_b.l2),
        relative_change(side_a.std, side_b.std),
        relative_change(side_a.mean, side_b.mean),
    )


def _side(moments: Moments, dtype: str) -> SliceStats:
    mean, std, l2 = moment_values(moments, dtype)
    return SliceStats(
        moments.count, moments.zeros, moments.low, moments.high, mean, std, l2, f"{moments.fingerprint:016x}"
    )


def relative_change(a: float | None, b: float | None) -> float | None:
    """``(b - a) / |a|``: exactly 0 when equal; None when either is missing or A is 0 and B is not."""
    if a is None or b is None:
        return None
    if a == b:
        return 0.0
    if a == 0:
        return None
    return (b - a) / abs(a)
