"""Whether a tensor's chunks tile its global shape exactly once: ``check``'s CKD220 and ``diff --values``' reader
ask the same question of an entry of the index."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Iterator

from ckptdoctor.checkpoint import Entry

_MAX_CELLS = 1 << 21  # coverage grids larger than this fall back to comparing element counts


def coverage_problems(entries: Iterable[Entry]) -> Iterator[tuple[Entry, str]]:
    """Each entry whose chunks do not tile its shape once, with why: :func:`coverage_problem`, decided once per
    layout. The keys of a checkpoint repeat a few layouts (every layer's keys of one kind are cut alike), and the
    index holds one tuple per distinct offsets, sizes and shape, shared by every chunk that has them: a layout is
    known by the identities of its tuples (a million chunks of 42k keys: ~0.3 s instead of ~7 s). Entries that
    share no tuples only miss the table; its keys are addresses, which a checkpoint cannot aim at."""
    decided: dict[tuple, tuple[str | None, Entry]] = {}  # layout -> (problem, an entry holding its tuples alive)
    for entry in entries:
        chunks = entry.chunks
        if len(chunks) == 1:  # (its own fast path below)
            problem = coverage_problem(entry)
        else:
            layout = (id(entry.shape), *[id(c.offsets) for c in chunks], *[id(c.sizes) for c in chunks])
            known = decided.get(layout)
            if known is None:
                known = decided[layout] = (coverage_problem(entry), entry)
            problem = known[0]
        if problem is not None:
            yield entry, problem


def coverage_problem(entry: Entry) -> str | None:
    """Why ``entry``'s chunks do not tile its global shape exactly once (None when they do)."""
    shape = entry.shape or ()
    if len(entry.chunks) == 1:  # the common case, cheaply: one chunk at the origin spanning the shape
        only = entry.chunks[0]
        if only.sizes == shape and not any(only.offsets):
            return None
    ndim = len(shape)
    chunks = [c for c in entry.chunks if not any(s == 0 for s in c.sizes) or len(c.sizes) != ndim]
    total = 0
    for c in chunks:
        if len(c.offsets) != ndim or len(c.sizes) != ndim:
            return f"chunk at {list(c.offsets)} has {len(c.sizes)} dims, the tensor {ndim}"
        if any(o < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            return f"chunk at {list(c.offsets)} of size {list(c.sizes)} lies outside the global shape {list(shape)}"
        total += math.prod(c.sizes)
    numel = math.prod(shape)
    if len(chunks) <= 1 and total == numel:
        return None
    # Cut every axis at all chunk boundaries; each grid cell must be covered exactly once.
    cuts = [
        sorted({0, d, *(c.offsets[a] for c in chunks), *(c.offsets[a] + c.sizes[a] for c in chunks)})
        for a, d in enumerate(shape)
    ]
    cells = math.prod(len(axis) - 1 for axis in cuts)
    if len(chunks) == cells and _one_chunk_per_cell(chunks, cuts):
        return None  # the usual grid (TP x PP x EP cuts): each cell held by exactly one chunk
    if cells > _MAX_CELLS:
        if total == numel:
            return None  # too fine a grid to map; element counts agree
        return _count_message(total, numel)
    count: dict[tuple[int, ...], int] = {}
    for c in chunks:
        ranges = [
            range(bisect.bisect_left(axis, o), bisect.bisect_left(axis, o + s))
            for axis, o, s in zip(cuts, c.offsets, c.sizes)
        ]
        for cell in itertools.product(*ranges):
            count[cell] = count.get(cell, 0) + 1
    overlap = [cell for cell, n in count.items() if n > 1]
    if overlap:
        return (
            f"chunks overlap at offsets {_origin(cuts, overlap[0])} ({len(chunks)} chunks hold {total} elements, "
            f"the shape {numel})"
        )
    if len(count) < cells:
        missing = next(cell for cell in itertools.product(*(range(len(a) - 1) for a in cuts)) if cell not in count)
        return (
            f"chunks leave a gap at offsets {_origin(cuts, missing)}: {numel - total} of {numel} elements "
            "are in no chunk"
        )
    return None


def _one_chunk_per_cell(chunks: list, cuts: list[list[int]]) -> bool:
    """Every chunk is exactly one cell of the grid ``cuts`` and no two are the same cell: with as many chunks as
    cells, they tile the shape once. A dict lookup per axis and chunk, where mapping every chunk's cells (below)
    costs a bisect per axis and a dict entry per cell (a 1M-chunk checkpoint: seconds)."""
    position = [{cut: i for i, cut in enumerate(axis)} for axis in cuts]
    seen: set[tuple[int, ...]] = set()
    for chunk in chunks:
        cell = []
        for axis, where, offset, size in zip(cuts, position, chunk.offsets, chunk.sizes):
            i = where[offset]
            if axis[i + 1] != offset + size:  # spans more than one cell: the general mapping decides
                return False
            cell.append(i)
        seen.add(tuple(cell))
    return len(seen) == len(chunks)


def _origin(cuts: list[list[int]], cell: tuple[int, ...]) -> list[int]:
    return [axis[i] for axis, i in zip(cuts, cell)]


def _count_message(total: int, numel: int) -> str:
    if total < numel:
        return f"chunks leave a gap: {numel - total} of {numel} elements are in no chunk"
    return f"chunks overlap: they hold {total} elements, the shape {numel}"
