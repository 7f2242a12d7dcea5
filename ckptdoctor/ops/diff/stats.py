"""``diff --values --stats``: the statistics of ``check --health`` for two checkpoints side by side.

Each side goes through ``check --health``'s one streaming pass (:func:`ckptdoctor.ops.check.health_scan`), so the
numbers are exact and the same at any layout: a resharded copy of one saved state has equal statistics and
fingerprints, and every relative change is exactly 0. Stacked keys (``decoder.layers.*``, experts) get one row per
layer / expert, so a table shows which layers moved between two iterations.

:func:`stats_series` does the same for every iteration dir of a save dir (``--all-iterations``), oldest first,
each iteration against the one before it, with one row per layer of the model weights together.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from ckptdoctor.checkpoint import Checkpoint, open_checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.logical_items import KIND_TENSOR, Item, logical_items
from ckptdoctor.ops.check import health_scan
from ckptdoctor.ops.diff.report import (
    SCHEMA,
    LayerRow,
    SeriesPoint,
    SeriesRow,
    SeriesStats,
    SliceStats,
    StatsDiff,
    StatsRow,
    StatsSeries,
)
from ckptdoctor.ops.latest_good import iteration_value, save_dir_of
from ckptdoctor.progress import Progress
from ckptdoctor.values.health import KeyStats
from ckptdoctor.values.health_tap import HealthTap
from ckptdoctor.values.moments import Moments, moment_values


def compare_stats(
    a: Checkpoint,
    b: Checkpoint,
    keys: dict[str, tuple[str, str]],
    limit: int | None = None,
    jobs: int | None = None,
    progress: Progress | None = None,
    measured: HealthTap | None = None,
) -> StatsDiff:
    """Both checkpoints' statistics of the tensor ``keys`` (those in both that the filters kept, each compared name
    with its key in A and in B: TorchTitan's two model layouts name one tensor two ways), one row per key
    or per slice of a stacked key, the largest change first (then key and slice order); ``limit`` caps the rows
    listed (counts are complete). ``measured``: what the value comparison measured as it read (its one read);
    a side it could not measure whole is read again by ``check --health``'s pass."""
    scan_a = scan_b = None
    if measured is not None:
        scan_a = None if measured.missed["a"] else measured.scans["a"]
        scan_b = None if measured.missed["b"] else measured.scans["b"]
    if scan_a is None:
        scan_a = health_scan(a.iteration_dir, a.iteration_dir, jobs, progress)
    if scan_b is None:
        scan_b = health_scan(b.iteration_dir, b.iteration_dir, jobs, progress)
    rows: list[StatsRow] = []
    compared = 0
    for key, (key_a, key_b) in sorted(keys.items()):
        if key_a not in scan_a.keys or key_b not in scan_b.keys:
            continue
        stats_a, stats_b = scan_a.keys[key_a], scan_b.keys[key_b]
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


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a per-layer key: decoder.layers.3.mlp...


def stats_series(
    save_dir: str,
    accepts: Callable[[Item], bool],
    limit: int | None = None,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> StatsSeries:
    """The statistics of the tensor keys ``accepts`` keeps in every numbered iteration dir of ``save_dir``
    (oldest first; ``release`` is left out), one row per key or slice of a stacked key, each iteration's point
    with the change from the previous iteration that has the row; ``limit`` caps the rows listed."""
    path, dirs = save_dir_of(save_dir)
    numbered = sorted((int(value), d) for d in dirs if (value := iteration_value(d)) != "release")
    if not numbered:
        raise CkptError(f"{path}: no numbered iteration dir (iter_NNNNNNN, step-N) to compare")
    model: set[str] = set()
    series: dict[tuple[str, tuple[tuple[str, int], ...]], list[SeriesPoint]] = {}
    keys: set[str] = set()
    for iteration, directory in numbered:
        checkpoint = open_checkpoint(directory)
        items = logical_items(checkpoint)
        tensors = {k for k, item in items.items() if item.kind == KIND_TENSOR and accepts(item)}
        model |= {k for k in tensors if items[k].section == "model"}
        scan = health_scan(checkpoint.iteration_dir, checkpoint.iteration_dir, jobs, progress)
        for key in sorted(tensors & scan.keys.keys()):
            keys.add(key)
            stats = scan.keys[key]
            slices = sorted(stats.slices.items()) if stats.axes else [((), stats.whole())]
            for index, moments in slices:
                points = series.setdefault((key, tuple(zip(stats.axes, index))), [])
                points.append(_point(iteration, _side(moments, stats.dtype), points[-1] if points else None))
    rows = [SeriesRow(key, dict(where), points) for (key, where), points in sorted(series.items())]
    iterations = [iteration for iteration, _ in numbered]
    changed = sum(any(p.equal_previous is False for p in row.points) for row in rows)
    listed = rows if limit is None else rows[:limit]
    summary = SeriesStats(len(keys), len(rows), changed, listed, _layers(rows, model, iterations))
    return StatsSeries(SCHEMA, str(path), iterations, limit, summary)


def _point(iteration: int, side: SliceStats, previous: SeriesPoint | None) -> SeriesPoint:
    if previous is None:
        return SeriesPoint(iteration, side, None, None)
    before = previous.stats
    return SeriesPoint(iteration, side, relative_change(before.l2, side.l2), before.fingerprint == side.fingerprint)


def _layers(rows: list[SeriesRow], model: set[str], iterations: list[int]) -> list[LayerRow]:
    """One row per decoder layer: its model weights' L2 norm together per iteration (the layer of a stacked key's
    slice, or the number in a per-layer key), the change from the iteration before, the rows that moved."""
    position = {iteration: i for i, iteration in enumerate(iterations)}
    squares: dict[int, list[float | None]] = {}
    moved: dict[int, list[int]] = {}
    counted: dict[int, int] = {}
    for row in rows:
        if row.key not in model:
            continue
        layer = row.slice.get("layer")
        if layer is None:
            match = _LAYER_NUMBER.search(row.key)
            if match is None:
                continue
            layer = int(match.group(1))
        sums = squares.setdefault(layer, [None] * len(iterations))
        changed = moved.setdefault(layer, [0] * len(iterations))
        counted[layer] = counted.get(layer, 0) + 1
        for point in row.points:
            i = position[point.iteration]
            if point.stats.l2 is not None:
                sums[i] = (sums[i] or 0.0) + point.stats.l2 * point.stats.l2
            changed[i] += point.equal_previous is False
    out = []
    for layer in sorted(squares):
        l2 = [None if s is None else math.sqrt(s) for s in squares[layer]]
        changes = [None] + [relative_change(a, b) for a, b in zip(l2, l2[1:])]
        out.append(LayerRow(layer, l2, changes, moved[layer], counted[layer]))
    return out
