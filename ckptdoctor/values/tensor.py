"""One tensor key of two checkpoints compared in global coordinates, whatever their two chunk grids.

The overlap of the two grids is planned once per key (:func:`plan_overlaps`: sorted intervals per axis, then
the boxes whose intervals overlap on every axis; no all-pairs scan). The side with fewer chunks is walked
chunk by chunk in file order. For each of its chunks:

- the other side has the same box (same layout): byte-identical blobs are equal without decoding or torch;
  otherwise both are decoded (zero-copy views) and compared in one call;
- otherwise the other side's chunks that cover it are each decoded once and copied into their region of one
  buffer of the chunk's shape, which is then compared with the chunk in one vectorised call (a TP=64 key
  against TP=1 is 64 copies and one compare, not 64 small compares). A chunk of the finer side that spans
  two chunks of the coarser side is kept (its bytes) until its last use (within a bound: re-read past it).

Where numpy is installed and both sides have one dtype, chunks are first compared as bit patterns (integer
views of the records, :func:`ckptdoctor.values.read.chunk_bits`): equal bits feed the accumulator what the torch
path would (elements, no difference), so torch is imported only for a chunk whose bits differ, which then takes
the torch path (with the assembled buffer viewed as the key's dtype) and gives the same report.

Memory per key: the coarse chunk, its buffer and the fine chunks held (about 3x the largest chunk).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.dcp_index import dims_key
from ckptdoctor.formats.torch_dist import chunk_overlap
from ckptdoctor.optimizer_keys import bucket_padding
from ckptdoctor.values.accumulate import Accumulator, Different
from ckptdoctor.values.io import Context, InFlight, ReadCounter, Torch
from ckptdoctor.values.read import chunk_bits, numpy_or_none, read_chunk_view

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from ckptdoctor.checkpoint import Checkpoint, Entry
    from ckptdoctor.formats.torch_dist import DcpChunk


@dataclass
class Side:
    """One checkpoint's tensor key: ``name`` is "a" or "b" (bytes read are counted per side)."""

    ckpt: Checkpoint
    entry: Entry
    name: str


@dataclass
class Plan:
    """For each chunk of the coarse side (in file order), the indices of the fine side's chunks overlapping it."""

    coarse: list[DcpChunk]
    overlaps: list[list[int]]
    disjoint: bool  # the fine side's chunks never overlap each other (so full volume means full cover)


def _storage_order(chunk: DcpChunk) -> tuple:
    return (chunk.storage.relative_path, chunk.storage.offset) if chunk.storage else ("", 0, chunk.offsets)


def plan_overlaps(coarse: Sequence[DcpChunk], fine: Sequence[DcpChunk]) -> Plan:
    """Which chunks of ``fine`` overlap each chunk of ``coarse``: per axis, the fine side's distinct intervals
    sorted by start, the ones overlapping an interval found by bisection (memoised per interval); a chunk
    overlaps where its intervals do on every axis. Cost: the overlaps found, not the chunk pairs."""
    if len(coarse) == 1 == len(fine):  # most keys of most pairs: one chunk on each side, the same non-empty box
        one, other = coarse[0], fine[0]
        if one.offsets == other.offsets and one.sizes == other.sizes and all(one.sizes):
            return Plan([one], [[0]], True)
    ordered = sorted(coarse, key=_storage_order)
    ndim = len(ordered[0].offsets) if ordered else 0
    if ndim == 0:
        everything = sorted(range(len(fine)), key=lambda j: _storage_order(fine[j]))
        return Plan(ordered, [list(everything) for _ in ordered], len(fine) <= 1)
    axes = []
    disjoint = True
    for d in range(ndim):
        intervals = [iv for iv, _ in itertools.groupby(sorted((c.offsets[d], c.sizes[d]) for c in fine))]
        disjoint = disjoint and all(s + z <= t for (s, z), (t, _) in zip(intervals, intervals[1:]))
        span = max((z for _, z in intervals), default=0)
        positions = {_interval_key(*iv): i for i, iv in enumerate(intervals)}
        axes.append((intervals, [s for s, _ in intervals], span, positions))
    boxes: dict[tuple[int, ...], list[int]] = {}
    for j, c in enumerate(fine):
        boxes.setdefault(tuple(axes[d][3][_interval_key(c.offsets[d], c.sizes[d])] for d in range(ndim)), []).append(j)
    disjoint = disjoint and all(len(js) == 1 for js in boxes.values())
    memo: list[dict[bytes | None, list[int]]] = [{} for _ in range(ndim)]
    overlaps = []
    for chunk in ordered:
        per_axis = []
        for d in range(ndim):
            lo, size = chunk.offsets[d], chunk.sizes[d]
            found = memo[d].get(_interval_key(lo, size))
            if found is None:
                intervals, starts, span, _ = axes[d]
                first = bisect.bisect_left(starts, lo - span + 1)
                last = bisect.bisect_left(starts, lo + size)
                found = memo[d][_interval_key(lo, size)] = [
                    i for i in range(first, last) if max(lo, intervals[i][0]) < min(lo + size, sum(intervals[i]))
                ]
            per_axis.append(found)
        hits = [j for ids in itertools.product(*per_axis) for j in boxes.get(ids, ())]
        overlaps.append(sorted(hits, key=lambda j: _storage_order(fine[j])))
    return Plan(ordered, overlaps, disjoint)


def _interval_key(offset: int, size: int) -> bytes | None:
    """A dict key for a chunk's interval on one axis that a pickle cannot make collide (see ``dims_key``)."""
    return dims_key((offset, size))


def _blob(side: Side, chunk: DcpChunk, ctx: Context) -> bytes:
    """One chunk's byte range, counted in the in-flight bytes (the caller releases its length)."""
    ckpt, entry = side.ckpt, side.entry
    if chunk.storage is None:
        raise CkptError(f"{ckpt.iteration_dir}: {entry.key} chunk at {list(chunk.offsets)}: no storage entry")
    ctx.inflight.acquire(chunk.storage.length)
    try:  # Files.read refuses a range longer than the chunk can need (Entry.max_range_bytes)
        data = ctx.preread.pop((side.name, id(chunk)), None)
        if data is None:
            data = ctx.files.read(ckpt, chunk.storage, entry.max_range_bytes(chunk))
    except BaseException:
        ctx.inflight.release(chunk.storage.length)
        raise
    ctx.read.add(side.name, len(data))
    if ctx.health is not None:
        ctx.health.add(side.name, ckpt, entry, chunk, data)
    return data


def _view(side: Side, chunk: DcpChunk, blob: bytes) -> Any:
    return read_chunk_view(side.ckpt, side.entry, chunk, blob)[0]


def _bits(side: Side, chunk: DcpChunk, blob: bytes) -> Any | None:
    """The chunk's bit patterns as a numpy array (values.read.chunk_bits), or None: decode it with torch."""
    return chunk_bits(side.ckpt, side.entry, chunk, blob)


def _torch_int(torch: Any, itemsize: int) -> Any:
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


class _Key:
    """The walk over one key (see the module doc); ``covered`` counts the elements compared."""

    def __init__(self, a: Side, b: Side, acc: Accumulator, ctx: Context) -> None:
        self.acc, self.ctx = acc, ctx
        self.coarse, self.fine = (a, b) if len(a.entry.chunks) <= len(b.entry.chunks) else (b, a)
        self.a_is_coarse = self.coarse is a
        self.fine_chunks = self.fine.entry.chunks
        self.cache: OrderedDict[int, tuple[bytes, int]] = OrderedDict()  # fine chunks' bytes still needed later
        self.cache_limit = 2 * max((c.storage.length for c in self.fine_chunks if c.storage), default=0)
        self.held = 0  # bytes held in the in-flight count by this walk outside the cache
        self.covered = 0

    def run(self) -> int:
        plan = plan_overlaps(self.coarse.entry.chunks, self.fine_chunks)
        self.uses = Counter(j for js in plan.overlaps for j in js)
        try:
            for chunk, js in zip(plan.coarse, plan.overlaps):
                if js:
                    self._chunk(chunk, js, plan.disjoint)
                self.ctx.inflight.release(self.held)
                self.held = 0
        finally:
            self.ctx.inflight.release(self.held + sum(n for _, n in self.cache.values()))
            self.cache.clear()
        return self.covered

    def _compare(self, coarse: Any, fine: Any, origin: tuple[int, ...]) -> None:
        if self.a_is_coarse:
            self.acc.update(coarse, fine, origin)
        else:
            self.acc.update(fine, coarse, origin)

    def _take(self, j: int) -> tuple[bytes, int]:
        """Fine chunk ``j``'s bytes, from the cache or read now (and cached while later chunks need it), and the
        bytes the caller releases from the in-flight count when done with them (0 when they stay cached)."""
        self.uses[j] -= 1
        hit = self.cache.pop(j, None)
        if hit is None:
            blob = _blob(self.fine, self.fine_chunks[j], self.ctx)
            hit = (blob, len(blob))
        if self.uses[j] > 0:
            self.cache[j] = hit
            while sum(n for _, n in self.cache.values()) > self.cache_limit and len(self.cache) > 1:
                self.ctx.inflight.release(self.cache.popitem(last=False)[1][1])  # read again if needed
            return hit[0], 0
        return hit

    @contextmanager
    def _fine(self, j: int) -> Iterator[bytes]:
        """:meth:`_take` as a block: the bytes released from the in-flight count when it ends."""
        blob, release = self._take(j)
        try:
            yield blob
        finally:
            del blob
            self.ctx.inflight.release(release)

    def _chunk(self, chunk: DcpChunk, js: list[int], disjoint: bool) -> None:
        ctx, size = self.ctx, numel(chunk.sizes)
        key = self.coarse.entry.key
        if bucket_padding(key, chunk.offsets, chunk.sizes) and all(
            bucket_padding(key, self.fine_chunks[j].offsets, self.fine_chunks[j].sizes) for j in js
        ):
            # A distributed-optimizer bucket's padding between parameters on both sides: never written, it holds
            # what memory held (check --deep and --health leave it out too).
            for j in js:
                self.uses[j] -= 1
            self.acc.padding += size
            self.covered += size
            return
        blob = _blob(self.coarse, chunk, ctx)
        self.held += len(blob)
        other = self.fine_chunks[js[0]]
        if len(js) == 1 and other.offsets == chunk.offsets and other.sizes == chunk.sizes:
            if self.coarse.entry.dtype == self.fine.entry.dtype and js[0] not in self.cache:
                # Same box in both (same layout): byte-identical blobs hold identical values (same view, same
                # bytes), checked at memcmp speed without decoding or torch.
                twin = _blob(self.fine, other, ctx)
                self.held += len(twin)
                self.uses[js[0]] -= 1
                if blob == twin or self._bits_equal(chunk, blob, other, twin):
                    self.acc.elements += size
                    self.covered += size
                    return
                ctx.torch.get()
                self._compare(_view(self.coarse, chunk, blob), _view(self.fine, other, twin), chunk.offsets)
            else:
                ctx.torch.get()
                with self._fine(js[0]) as fine:
                    self._compare(_view(self.coarse, chunk, blob), _view(self.fine, other, fine), chunk.offsets)
            self.covered += size
            return
        regions = [(j, chunk_overlap(chunk, self.fine_chunks[j])) for j in js]
        volume = sum(r[2] for _, r in regions if r is not None)
        tiled = disjoint and volume == size  # the fine chunks tile this chunk: assemble them, compare once
        if tiled and self.coarse.entry.dtype == self.fine.entry.dtype and self._tiled_bits(chunk, blob, regions):
            self.covered += volume
            return
        torch = ctx.torch.get()
        values = _view(self.coarse, chunk, blob)
        if tiled:
            dtype = getattr(torch, (self.fine.entry.dtype or "").removeprefix("torch."), None)
            buffer = torch.empty(tuple(chunk.sizes), dtype=dtype if dtype is not None else values.dtype)
            nbytes = buffer.numel() * buffer.element_size()
            ctx.inflight.acquire(nbytes)
            self.held += nbytes
            for j, region in regions:
                if region is not None:
                    with self._fine(j) as fine:
                        buffer[region[0]] = _view(self.fine, self.fine_chunks[j], fine)[region[1]]
            self._compare(values, buffer, chunk.offsets)
        else:  # a partial cover (chunks missing on one side): the overlapping regions one by one
            for j, region in regions:
                if region is not None:
                    origin = tuple(o + (s.start or 0) for o, s in zip(chunk.offsets, region[0]))
                    with self._fine(j) as fine:
                        self._compare(values[region[0]], _view(self.fine, self.fine_chunks[j], fine)[region[1]], origin)
        self.covered += volume

    def _bits_equal(self, chunk: DcpChunk, blob: bytes, other: DcpChunk, twin: bytes) -> bool:
        """Whether two chunks of the same box and dtype hold the same bit patterns, told without torch (their
        archives can differ elsewhere: another save's serialization id). False: not known, compare with torch."""
        mine, theirs = _bits(self.coarse, chunk, blob), _bits(self.fine, other, twin)
        if mine is None or theirs is None or mine.dtype != theirs.dtype:
            return False
        return bool(numpy_or_none().array_equal(mine, theirs))

    def _tiled_bits(self, chunk: DcpChunk, blob: bytes, regions: list) -> bool:
        """The tiled case without torch: the fine chunks' bit patterns copied into one buffer of the coarse
        chunk's shape and compared with it in one call. True when equal (the accumulator is fed what the torch
        path would feed it); when they differ, the buffer goes to the torch path as a tensor of the key's dtype;
        False (nothing consumed) where a chunk is not the plain case (values.read.chunk_bits)."""
        values = _bits(self.coarse, chunk, blob)
        if values is None:
            return False
        np = numpy_or_none()
        buffer = np.empty(values.shape, dtype=values.dtype)
        self.ctx.inflight.acquire(buffer.nbytes)
        self.held += buffer.nbytes
        for j, region in regions:
            if region is None:
                continue
            fine, release = self._take(j)
            try:
                bits = _bits(self.fine, self.fine_chunks[j], fine)
                if bits is None or bits.dtype != values.dtype:  # an irregular chunk: its torch view's bits
                    torch = self.ctx.torch.get()
                    view = _view(self.fine, self.fine_chunks[j], fine)[region[1]]
                    buffer[region[0]] = view.contiguous().view(_torch_int(torch, buffer.itemsize)).numpy()
                else:
                    buffer[region[0]] = bits[region[1]]
            finally:
                del fine
                self.ctx.inflight.release(release)
        if np.array_equal(values, buffer):
            self.acc.elements += values.size
            return True
        torch = self.ctx.torch.get()
        dtype = getattr(torch, (self.coarse.entry.dtype or "").removeprefix("torch."))
        self._compare(_view(self.coarse, chunk, blob), torch.from_numpy(buffer).view(dtype), chunk.offsets)
        return True


def compare_entries(a: Side, b: Side, acc: Accumulator, ctx: Context) -> int:
    """Feed every overlapping region of ``a`` and ``b`` (same global shape) to ``acc``; the elements covered."""
    for side in (a, b):
        side.entry.require_chunk_ranks(side.ckpt.iteration_dir)
    return _Key(a, b, acc, ctx).run()


def tensors_bitwise_equal(a: Checkpoint, ea: Entry, b: Checkpoint, eb: Entry) -> bool:
    """Whether tensor ``ea`` of ``a`` and ``eb`` of ``b`` hold byte-identical values (same shape and dtype),
    stopping at the first difference (``strip-frozen --base``)."""
    if ea.shape != eb.shape or ea.dtype != eb.dtype:
        return False
    torch = Torch()
    ctx = Context(ReadCounter(None), InFlight(1 << 62), torch)
    acc = Accumulator(torch, None, None, first_difference=True)
    try:
        covered = compare_entries(Side(a, ea, "a"), Side(b, eb, "b"), acc, ctx)
    except Different:
        return False
    finally:
        ctx.files.close()
        torch.restore()
    return covered == numel(ea.shape or ())
