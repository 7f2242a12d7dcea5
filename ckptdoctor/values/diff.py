"""``diff --values``: tensor values compared in global coordinates, streamed one chunk at a time.

A and B may be chunked differently (TP=1 vs TP=4, PP stages): for each tensor key, every chunk of A is read
once, and the chunks of B that overlap its box are read (through a small LRU, so a B chunk shared by
consecutive A chunks is read once) and the overlapping sub-boxes compared. At most one chunk of A and the
cached chunk(s) of B (bounded by B's largest chunk of that key) are held, and comparisons run on slabs of
at most :data:`SLAB_ELEMENTS` elements, so memory is bounded by the largest chunk, never the checkpoint.

Equality is bitwise by default (same dtype, same bits: NaN payloads and -0.0 matter); with ``atol``/``rtol``
it is ``|a - b| <= atol + rtol * |b|`` with NaN positions required to match. Bytes items (ShardedObjects:
rng state, ``_extra_state``, rerun state) are compared by the sha256 of their raw bytes; when the bytes
differ, both are decoded (safe unpickler) and compared as objects, because torch.save archives of equal
objects can differ in serialization details.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.torch_dist import check_range_length, chunk_overlap
from ckptdoctor.ops.diff_items import KIND_TENSOR, Item
from ckptdoctor.values.io import Budget, Context, InFlight, Torch

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint
    from ckptdoctor.formats.torch_dist import DcpChunk

SLAB_ELEMENTS = 1 << 22  # elements compared at once: bounds temporaries to tens of MB


@dataclass
class ValueDiff:
    key: str
    section: str
    kind: str  # "tensor" | "object" | "bytes"
    equal: bool | None  # None: not compared (see note)
    max_abs_diff: float | str | None  # "inf"/"nan" where not finite; None for bytes items
    mismatched: int | None  # elements not equal (bitwise) or not within tolerance
    elements: int | None
    note: str | None = None
    sha256_a: str | None = None  # bytes items with one shard
    sha256_b: str | None = None
    max_rel_diff: float | str | None = None  # tensors: max |a - b| / |b| over differing elements (inf where b = 0)
    norm_diff: float | str | None = None  # tensors: L2 norm of a - b (NaN positions left out)
    mismatches: list[dict] | None = None  # --report N: first N mismatching elements {index, a, b} (global index)


@dataclass
class ValuesReport:
    mode: str  # "bitwise" | "tolerance"
    atol: float
    rtol: float
    compared: int
    equal: int
    different: int
    not_compared: int
    max_abs_diff: float | str | None
    bytes_read: dict
    seconds: float
    workers: int
    peak_in_flight: int  # most chunk bytes held at once (all workers), at most 3x the largest chunk
    different_keys: list[ValueDiff] = field(default_factory=list)
    not_compared_keys: list[ValueDiff] = field(default_factory=list)


def _finite(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else "inf"


# --- tensors -------------------------------------------------------------------------------------------


class _Accumulator:
    """Running result over the compared sub-boxes of one key."""

    def __init__(self, torch: Any, atol: float | None, rtol: float | None, report: int = 0) -> None:
        self._torch = torch  # torch itself, or a values.io.Torch that imports it on first use
        self.tolerance = atol is not None or rtol is not None
        self.atol = atol or 0.0
        self.rtol = rtol or 0.0
        self.max_abs = 0.0
        self.mismatched = 0
        self.elements = 0
        self.nan_mismatch = 0
        self.max_rel = 0.0
        self.sum_sq = 0.0
        self.report = report
        self.mismatches: list[tuple[tuple[int, ...], Any, Any]] = []  # (global index, a, b), the first ``report``

    @property
    def torch(self) -> Any:
        return self._torch.get() if isinstance(self._torch, Torch) else self._torch

    def update(self, a: Any, b: Any, origin: tuple[int, ...] = ()) -> None:
        """Compare ``a`` and ``b``, whose element 0 is at global index ``origin`` (for ``report``)."""
        origin = origin or (0,) * a.dim()
        for sa, sb, shift in _slabs(a, b, SLAB_ELEMENTS):
            self._slab(sa, sb, tuple(o + d for o, d in zip(origin, shift)))

    def first_mismatches(self) -> list[dict] | None:
        if not self.report:
            return None
        return [{"index": list(i), "a": x, "b": y} for i, x, y in self.mismatches]

    def _record(self, mask: Any, a: Any, b: Any, origin: tuple[int, ...]) -> None:
        """Keep the first ``report`` mismatches in global row-major order (a slab's own order agrees with it)."""
        if not self.report:
            return
        found = mask.nonzero()[: self.report].tolist() if mask.dim() else ([[]] if bool(mask) else [])
        for idx in found:
            at = tuple(int(o + i) for o, i in zip(origin, idx))
            pos = tuple(idx)
            self.mismatches.append((at, _plain(a[pos]), _plain(b[pos])))
        self.mismatches.sort(key=lambda m: m[0])
        del self.mismatches[self.report :]

    def _slab(self, a: Any, b: Any, origin: tuple[int, ...] = ()) -> None:
        torch = self.torch
        n = a.numel()
        self.elements += n
        if a.dtype == b.dtype and _bits_equal(torch, a, b):
            return
        wide = torch.float64 if max(a.element_size(), b.element_size()) > 2 else torch.float32
        if a.dtype.is_complex or b.dtype.is_complex:
            wide = torch.complex128
        xa, xb = a.to(wide), b.to(wide)
        same = xa == xb
        nan_a, nan_b = torch.isnan(xa), torch.isnan(xb)
        diff = (xa - xb).abs()
        if diff.is_complex():
            diff = diff.real
        diff.masked_fill_(same | nan_a | nan_b, 0.0)
        if n:
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.sum_sq += float((diff * diff).sum())
            scale = xb.abs()
            if scale.is_complex():
                scale = scale.real
            rel = diff / scale  # 0/0 = nan where equal (masked out), x/0 = inf
            rel.masked_fill_(diff == 0, 0.0)
            self.max_rel = max(self.max_rel, float(rel.max()))
        nan_mismatch = int((nan_a ^ nan_b).sum())
        self.nan_mismatch += nan_mismatch
        if self.tolerance:
            bound = self.atol + self.rtol * xb.abs()
            if bound.is_complex():
                bound = bound.real
            close = same | (nan_a & nan_b) | (diff <= bound)
            close &= ~(nan_a ^ nan_b)
            self.mismatched += n - int(close.sum())
            self._record(~close, a, b, origin)
        elif a.dtype != b.dtype:
            self.mismatched += n
            self._record(torch.ones_like(same), a, b, origin)
        else:
            equal = _bits_eq_mask(torch, a, b)
            self.mismatched += n - int(equal.sum())
            self._record(~equal, a, b, origin)


def _plain(x: Any) -> Any:
    """One element as JSON: a float (\"inf\"/\"nan\" where not finite), an int, a bool or [re, im]."""
    v = x.item()
    if isinstance(v, complex):
        return [_finite(v.real), _finite(v.imag)]
    return _finite(v) if isinstance(v, float) else v


def _int_view(torch: Any, t: Any) -> Any:
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if kind is None or t.dtype == torch.bool:
        return t if kind is None else t.view(torch.uint8)
    return t.view(kind)


def _bits_equal(torch: Any, a: Any, b: Any) -> bool:
    return bool(torch.equal(_int_view(torch, a), _int_view(torch, b)))


def _bits_eq_mask(torch: Any, a: Any, b: Any) -> Any:
    return _int_view(torch, a) == _int_view(torch, b)


def _slabs(a: Any, b: Any, limit: int):
    """Matching sub-views of ``a`` and ``b`` of at most ``limit`` elements (split along leading dims), each with
    the index of its first element in ``a``."""
    if a.numel() <= limit or a.dim() == 0:
        yield a, b, (0,) * a.dim()
        return
    dim = next(i for i, s in enumerate(a.shape) if s > 1)
    per = a.numel() // a.shape[dim]
    step = max(1, limit // max(per, 1))
    for start in range(0, a.shape[dim], step):
        length = min(step, a.shape[dim] - start)
        sa, sb = a.narrow(dim, start, length), b.narrow(dim, start, length)
        shift = tuple(start if i == dim else 0 for i in range(a.dim()))
        if sa.numel() > limit and length == 1:
            for xa, xb, inner in _slabs(sa, sb, limit):
                yield xa, xb, tuple(s + t for s, t in zip(shift, inner))
        else:
            yield sa, sb, shift


class _ChunkIndex:
    """B's chunks sorted along axis 0, to find the ones overlapping a box without an all-pairs scan."""

    def __init__(self, chunks: list[DcpChunk]) -> None:
        if chunks and chunks[0].offsets:
            self.chunks = sorted(chunks, key=lambda c: c.offsets)
            self.starts = [c.offsets[0] for c in self.chunks]
            self.span = max(c.sizes[0] for c in self.chunks)
        else:
            self.chunks, self.starts, self.span = list(chunks), [], 0

    def overlapping(self, box: DcpChunk) -> list[DcpChunk]:
        if not self.starts:
            return self.chunks
        lo = bisect.bisect_left(self.starts, box.offsets[0] - self.span + 1)
        hi = bisect.bisect_left(self.starts, box.offsets[0] + box.sizes[0])
        return self.chunks[lo:hi]


def _blob(ckpt: Checkpoint, entry: Any, chunk: DcpChunk, ctx: Context, side: str) -> bytes:
    """One chunk's byte range, reserved in the in-flight cap first (the caller releases its length)."""
    if chunk.storage is None:
        raise CkptError(f"{ckpt.iteration_dir}: {entry.key} chunk at {list(chunk.offsets)}: no storage entry")
    limit = entry.max_range_bytes(chunk)
    check_range_length(ckpt.iteration_dir / chunk.storage.relative_path, chunk.storage, limit)
    ctx.inflight.acquire(chunk.storage.length)
    try:
        data = ctx.files.read(ckpt, chunk.storage, limit)
    except BaseException:
        ctx.inflight.release(chunk.storage.length)
        raise
    ctx.budget.add(side, len(data))
    return data


def _view(ckpt: Checkpoint, entry: Any, chunk: DcpChunk, blob: bytes) -> Any:
    from ckptdoctor.values.read import read_chunk_view

    return read_chunk_view(ckpt, entry, chunk, blob)[0]


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


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
    acc = _Accumulator(ctx.torch, atol, rtol, report)
    index = _ChunkIndex(eb.chunks)
    cache_limit = max((c.storage.length for c in eb.chunks if c.storage), default=0)
    cache: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()  # B's chunks: offsets -> (view, bytes held)
    held = 0  # bytes this call holds in the in-flight cap: A's chunk and the B chunk paired with it
    covered = 0
    same_dtype = ea.dtype == eb.dtype
    try:
        for ca in sorted(ea.chunks, key=lambda c: c.offsets):
            blob_a = _blob(a, ea, ca, ctx, "a")
            held += len(blob_a)
            boxes = index.overlapping(ca)
            twin = next((cb for cb in boxes if cb.offsets == ca.offsets and cb.sizes == ca.sizes), None)
            pair: dict[tuple, tuple[Any, int]] = {}
            if twin is not None and same_dtype:
                # Same box in both (same layout): byte-identical chunk blobs hold identical values (same view,
                # same bytes), checked at memcmp speed without decoding or torch.
                blob_b = _blob(b, eb, twin, ctx, "b")
                held += len(blob_b)
                if blob_a == blob_b:
                    del blob_a, blob_b
                    ctx.inflight.release(held)
                    held = 0
                    acc.elements += _numel(ca.sizes)
                    covered += _numel(ca.sizes)
                    continue
                ctx.torch.get()
                boxes, pair = [twin], {twin.offsets: (_view(b, eb, twin, blob_b), len(blob_b))}
                del blob_b
            ctx.torch.get()
            xa = _view(a, ea, ca, blob_a)
            del blob_a
            for cb in boxes:
                region = chunk_overlap(ca, cb)
                if region is None:
                    continue
                hit = pair.get(cb.offsets) or cache.get(cb.offsets)
                if hit is None:
                    incoming = cb.storage.length if cb.storage else 0
                    while cache and sum(v[1] for v in cache.values()) + incoming > cache_limit:
                        ctx.inflight.release(cache.popitem(last=False)[1][1])  # evict before reading
                    blob = _blob(b, eb, cb, ctx, "b")
                    hit = cache[cb.offsets] = (_view(b, eb, cb, blob), len(blob))
                    del blob
                elif cb.offsets in cache:
                    cache.move_to_end(cb.offsets)
                acc.update(
                    xa[region[0]], hit[0][region[1]], tuple(o + (s.start or 0) for o, s in zip(ca.offsets, region[0]))
                )
                covered += region[2]
                hit = None
            del xa, pair
            ctx.inflight.release(held)
            held = 0
    finally:
        ctx.inflight.release(held + sum(v[1] for v in cache.values()))
        cache.clear()
    numel = _numel(ea.shape or ())
    note = None
    if covered != numel:
        note = f"the chunks of A and B overlap on {covered} of {numel} elements; only those were compared"
    if acc.nan_mismatch:
        note = (note + "; " if note else "") + f"NaN positions differ at {acc.nan_mismatch} elements"
    if ea.dtype != eb.dtype:
        note = (note + "; " if note else "") + f"dtypes differ ({ea.dtype} vs {eb.dtype})"
    equal = acc.mismatched == 0 and covered == numel and (acc.tolerance or ea.dtype == eb.dtype)
    return ValueDiff(
        ia.key,
        ia.section,
        KIND_TENSOR,
        equal,
        _finite(acc.max_abs),
        acc.mismatched,
        acc.elements,
        note,
        max_rel_diff=_finite(acc.max_rel),
        norm_diff=_finite(math.sqrt(acc.sum_sq)),
        mismatches=acc.first_mismatches() if not equal else None,
    )


# --- bytes items ---------------------------------------------------------------------------------------


def compare_objects(a: Checkpoint, ia: Item, b: Checkpoint, ib: Item, ctx: Context) -> ValueDiff:
    if sorted(ia.entries) != sorted(ib.entries):
        return ValueDiff(
            ia.key,
            ia.section,
            ia.kind,
            None,
            None,
            None,
            None,
            f"sharded differently (A: {ia.grid_summary()}, B: {ib.grid_summary()}): layout, values not compared",
        )
    hashes: dict[str, tuple[str, str]] = {}
    differing: list[str] = []
    for suffix in sorted(ia.entries):
        digests = []
        for side, ckpt, item in (("a", a, ia), ("b", b, ib)):
            location = item.entries[suffix].chunks[0].storage if item.entries[suffix].chunks else None
            if location is None:
                raise CkptError(f"{ckpt.iteration_dir}: item {item.entries[suffix].key}: no storage entry")
            entry = item.entries[suffix]
            # small items: not counted against the in-flight cap
            data = ctx.files.read(ckpt, location, entry.max_range_bytes(entry.chunks[0]))
            ctx.budget.add(side, len(data))
            digests.append(hashlib.sha256(data).hexdigest())
        hashes[suffix] = (digests[0], digests[1])
        if digests[0] != digests[1]:
            differing.append(suffix)
    single = hashes[next(iter(hashes))] if len(hashes) == 1 else (None, None)
    if not differing:
        return ValueDiff(ia.key, ia.section, ia.kind, True, None, None, None, None, *single)
    decoded_equal = True
    reason = None
    for suffix in differing:
        key_a, key_b = ia.entries[suffix].key, ib.entries[suffix].key
        try:
            if a.read_bytes_item(key_a) != b.read_bytes_item(key_b):
                decoded_equal = False
                break
        except CkptError as exc:
            decoded_equal, reason = False, f"cannot decode to compare objects: {exc}"
            break
    n = len(differing)
    what = f"{n} of {len(hashes)} shard{'s' if len(hashes) != 1 else ''}"
    if decoded_equal:
        note = f"serialized bytes differ in {what}, decoded objects are equal"
    else:
        note = reason or f"bytes and decoded objects differ in {what}"
    return ValueDiff(ia.key, ia.section, ia.kind, decoded_equal, None, None, None, note, *single)


# --- driver --------------------------------------------------------------------------------------------


def _first_storage(item: Item) -> tuple:
    for entry in item.entries.values():
        for chunk in entry.chunks:
            if chunk.storage is not None:
                return (chunk.storage.relative_path, chunk.storage.offset)
    return ("", 0)


def compare_values(
    a: Checkpoint,
    b: Checkpoint,
    pairs: list[tuple[Item, Item]],
    atol: float | None = None,
    rtol: float | None = None,
    limit: int | None = 20,
    progress: Callable[[int, int], None] | None = None,
    workers: int = 2,
    report: int = 0,
) -> ValuesReport:
    """Values of the key pairs (same logical key in A and B), in A's on-disk order for sequential reads.

    ``workers`` threads compare keys concurrently; chunk bytes held by all of them stay under 3x the largest
    chunk (:class:`~ckptdoctor.values.io.InFlight`).
    """
    start = time.perf_counter()
    results: list[ValueDiff] = []
    total = largest = 0
    for pair in pairs:  # one plain pass: this runs over every chunk of two 20,000-key checkpoints
        for item in pair:
            for entry in item.entries.values():
                for chunk in entry.chunks:
                    if chunk.storage is not None:
                        n = chunk.storage.length
                        total += n
                        if n > largest:
                            largest = n
    budget = Budget(total, progress)
    inflight = InFlight(3 * largest)
    torch = Torch()
    ordered = sorted(pairs, key=lambda p: _first_storage(p[0]))
    workers = max(1, min(workers, len(ordered)))
    contexts = [Context(budget, inflight, torch) for _ in range(workers)]

    def work(index: int) -> list[ValueDiff]:
        ctx, out = contexts[index], []
        for ia, ib in ordered[index::workers]:  # interleaved: both workers walk A's files in order
            if ia.kind != ib.kind:
                out.append(
                    ValueDiff(
                        ia.key, ia.section, ia.kind, None, None, None, None, f"kinds differ ({ia.kind} vs {ib.kind})"
                    )
                )
            elif ia.kind == KIND_TENSOR:
                out.append(compare_tensor(a, ia, b, ib, atol, rtol, ctx, report))
            else:
                out.append(compare_objects(a, ia, b, ib, ctx))
        return out

    try:
        if workers == 1:
            results += work(0)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="ckptdoctor-diff") as pool:
                for part in pool.map(work, range(workers)):
                    results += part
    finally:
        for ctx in contexts:
            ctx.files.close()
        torch.restore()
    different = sorted((r for r in results if r.equal is False), key=lambda r: r.key)
    skipped = sorted((r for r in results if r.equal is None), key=lambda r: r.key)
    finite = [r.max_abs_diff for r in results if isinstance(r.max_abs_diff, float)]
    texts = {r.max_abs_diff for r in results if isinstance(r.max_abs_diff, str)}
    overall: float | str | None = (
        "nan" if "nan" in texts else "inf" if "inf" in texts else (max(finite) if finite else None)
    )
    return ValuesReport(
        mode="tolerance" if atol is not None or rtol is not None else "bitwise",
        atol=atol or 0.0,
        rtol=rtol or 0.0,
        compared=sum(r.equal is not None for r in results),
        equal=sum(r.equal is True for r in results),
        different=len(different),
        not_compared=len(skipped),
        max_abs_diff=overall,
        bytes_read={"a": budget.a, "b": budget.b},
        seconds=round(time.perf_counter() - start, 3),
        workers=workers,
        peak_in_flight=inflight.peak,
        different_keys=different if limit is None else different[:limit],
        not_compared_keys=skipped if limit is None else skipped[:limit],
    )
