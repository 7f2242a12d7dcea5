"""``check --health``: per-key statistics of tensor values, exact and the same at any layout of one saved state.

Fed one chunk at a time during ``check --deep``'s streaming pass (the raw bytes of the chunk's storage record, no
torch), it keeps per key, and per slice of a stacked tensor (one layer of ``decoder.layers.*``, one expert of
``experts.experts.*``), the :class:`~ckptdoctor.values.moments.Moments` of its elements: the element count, finite
count, zeros, NaN, Inf, min, max, the exact sum and sum of squares, and a fingerprint, each slab measured by
:mod:`ckptdoctor.values.slab_stats` (the C loop of ``_health.c`` for the usual chunk, as bytes, without numpy).
Slices merge in any order, in any worker, to the same bits; a key's fingerprint combines its slices' fingerprints
with their indices.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.errors import MissingExtraError
from ckptdoctor.formats.plain_dcp import stacks_experts
from ckptdoctor.numpy_lazy import numpy_or_none
from ckptdoctor.values import slab_stats
from ckptdoctor.values.moments import KINDS, MASK64, Kind, Moments, moment_values
from ckptdoctor.values.slab_stats import SLAB_ELEMENTS, add_native, add_slab, flat_index, mix

# A stacked key is kept per slice only where each slice holds at least this many elements: the smallest real ones
# (a layer's q/k norm scales: head_dim) hold more, and a hostile shape such as [2^21, 1] would otherwise make a
# million slices (hundreds of bytes of statistics each) of a few MB of input. Integer tensors (FP8 weights' bytes)
# need more: numpy measures them, at tens of microseconds a slice, and the real ones are whole matrices.
MIN_SLICE_ELEMENTS = 8
MIN_INTEGER_SLICE_ELEMENTS = 256
# Slices of fewer bytes than SMALL_SLICE_BYTES cost more in statistics (about 400 bytes a slice) than their elements:
# a checkpoint's keys of such slices are kept per slice, in key order, until their slices pass MAX_SMALL_SLICES
# (about 25 MB); later ones are measured whole (crowded_keys). A real model holds hundreds (each layer's bfloat16 q/k
# norm scales or per-head parameters; the fixtures at most 24); a few MB of hostile [2^18, 8] keys hold millions.
SMALL_SLICE_BYTES = 512
MAX_SMALL_SLICES = 1 << 16


def require_numpy(purpose: str = "check --health (tensor statistics)") -> Any:
    """numpy, or the one clear error ``check --health`` (or ``purpose``) gives without it."""
    numpy = numpy_or_none()
    if numpy is None:
        raise MissingExtraError("numpy", "torch", purpose)
    return numpy


def stack_axes(key: str) -> tuple[str, ...]:
    """The leading axes of a key that stack independent tensors: ``layer`` (``...layers.<not a number>...``, the
    layer axis Megatron prepends) and then ``expert`` (``experts.experts.``: SequentialMLP's experts, global shape
    ``[L, E, ...]`` or ``[E, ...]`` in per-layer keys; a plain DCP save's ``[E, ...]`` experts parameter, as
    TorchTitan's ``experts.w1``). Optimizer keys in model space stack as their parameter."""
    axes: list[str] = []
    if _STACKED_LAYERS.search(key):
        axes.append("layer")
    if "experts." in key and ("experts.experts." in key or stacks_experts(key)):  # both need "experts."
        axes.append("expert")
    return tuple(axes)


_STACKED_LAYERS = re.compile(r"(?<![^.])layers\.(?!\d+\.)")  # "layers." at the start or after a dot, no number next


@dataclass
class KeyStats:
    """One key's statistics: per slice of its stacked axes (the whole key when it has none)."""

    dtype: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # the stacked axes, leading (``layer``, ``expert``)
    slices: dict[tuple[int, ...], Moments] = field(default_factory=dict)
    # whole()'s result until a slice changes (merge, HealthScan.scan): the rules and the report each ask for it
    cached_whole: Moments | None = field(default=None, init=False, repr=False, compare=False)

    def merge(self, other: KeyStats) -> None:
        self.cached_whole = None
        for index, moments in other.slices.items():
            mine = self.slices.get(index)
            if mine is None:
                self.slices[index] = moments
            else:
                mine.merge(moments)

    def changing(self, index: tuple[int, ...]) -> Moments:
        """The statistics of slice ``index`` (new ones where it has none yet), which the caller is about to add to."""
        self.cached_whole = None
        moments = self.slices.get(index)
        if moments is None:
            moments = self.slices[index] = Moments()
        return moments

    def whole(self) -> Moments:
        """The key's statistics: its slices merged, the fingerprint combining each slice's with its index. Computed
        once until the slices change; the same object to every caller, not to be changed."""
        if self.cached_whole is None:
            self.cached_whole = self._whole()
        return self.cached_whole

    def _whole(self) -> Moments:
        out = Moments()
        fingerprint = 0
        for index, moments in self.slices.items():
            out.merge(moments)
            fingerprint += mix(flat_index(index, self.shape) ^ mix(moments.fingerprint))
        out.fingerprint = fingerprint & MASK64
        return out


class HealthScan:
    """Statistics of every tensor chunk fed to :meth:`scan`; one per data file (a worker's partial result, plain
    data to pickle back), merged with :meth:`merge`."""

    def __init__(self, crowded: frozenset[str] = frozenset()) -> None:
        self.keys: dict[str, KeyStats] = {}
        self.crowded = crowded  # stacked keys measured whole: crowded_keys() of the checkpoint's

    def merge(self, other: HealthScan) -> None:
        for key, stats in other.keys.items():
            mine = self.keys.get(key)
            if mine is None:
                self.keys[key] = stats
            else:
                mine.merge(stats)

    def scan(
        self,
        key: str,
        dtype: str | None,
        shape: tuple[int, ...] | None,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        data: Any,
        view: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None,
    ) -> tuple[int, int] | None:
        """Add one chunk: ``data`` holds its storage record's bytes, ``view`` its (storage offset, size, stride)
        (None: the first elements in row-major order). Returns the chunk's (NaN, Inf) counts where they are those of
        every element of ``data`` (a float chunk whose record holds exactly its elements in row-major order), so
        ``check --deep``'s NaN/Inf count need not read them again; else None."""
        kind = KINDS.get(dtype or "")
        if kind is None or shape is None or len(offsets) != len(shape):
            return None
        np = require_numpy()
        nbytes = memoryview(data).nbytes
        in_order = view is None or (view[0] == 0 and _row_major(view[1], view[2]))
        numel = math.prod(sizes)
        whole = kind.is_float and in_order and numel * kind.itemsize == nbytes
        stats = self.keys.get(key) or _key_stats(key, kind, dtype or "", tuple(shape), key in self.crowded)
        k = len(stats.axes)
        inner_shape, inner_origin = stats.shape[k:], tuple(offsets[k:])
        consecutive = sizes[k + 1 :] == inner_shape[1:]  # whole trailing extents: one run of the slice's elements
        inner = math.prod(sizes[k:])  # the chunk's elements in each slice it covers
        if (  # the usual chunk: straight to the C loop (see _scan_native)
            whole
            and slab_stats.native is not None
            and kind.itemsize in (2, 4)
            and 0 < inner <= SLAB_ELEMENTS
            and (consecutive or len(inner_shape) == 2)
        ):
            self.keys[key] = stats
            return _scan_native(stats, kind, data, offsets, sizes, inner if consecutive else sizes[-1])
        values = _chunk_array(np, kind, data, nbytes, sizes, None if in_order else view)
        if values is None:
            return None
        self.keys[key] = stats
        nan = inf = 0
        # each slice of the stacked axes the chunk covers (a key without them: the one slice ())
        for local in itertools.product(*(range(n) for n in sizes[:k])) if k else ((),):
            moments = stats.changing(tuple(map(operator.add, offsets[:k], local)))
            part = values[local] if k else values
            for slab, origin in _slabs(part, inner_origin):
                slab_nan, slab_inf = add_slab(np, kind, moments, slab, origin, inner_shape)
                nan, inf = nan + slab_nan, inf + slab_inf
        return (nan, inf) if whole else None


def _key_stats(key: str, kind: Kind, dtype: str, shape: tuple[int, ...], crowded: bool = False) -> KeyStats:
    """A key's empty statistics, kept per slice of its stacked axes (unless ``crowded``: see :func:`crowded_keys`)."""
    return KeyStats(dtype, shape, () if crowded else _slice_axes(key, kind, shape))


def _slice_axes(key: str, kind: Kind, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The stacked axes a key is kept per slice of: :func:`stack_axes` where each slice holds at least
    :data:`MIN_SLICE_ELEMENTS` elements (:data:`MIN_INTEGER_SLICE_ELEMENTS` for integers), else none."""
    axes = stack_axes(key)
    smallest = MIN_SLICE_ELEMENTS if kind.is_float else MIN_INTEGER_SLICE_ELEMENTS
    if len(axes) >= len(shape) or math.prod(shape[len(axes) :]) < smallest:
        return ()  # no slices, or slices too small to be a layer's or an expert's tensor
    return axes


def crowded_keys(entries: Iterable[tuple[str, str | None, tuple[int, ...] | None]]) -> frozenset[str]:
    """Of a checkpoint's (key, dtype, global shape) items, the stacked keys to measure whole though their slices
    are big enough: those of slices under :data:`SMALL_SLICE_BYTES`, in key order, from the one whose slices would
    take the small slices kept past :data:`MAX_SMALL_SLICES` (one that fits after it is still kept). A function of
    the metadata alone, so every worker, and every layout of one saved state, measures a key alike."""
    small: list[tuple[str, int]] = []
    for key, dtype, shape in entries:
        kind = KINDS.get(dtype or "")
        if kind is None or shape is None or len(shape) < 2:
            continue
        if math.prod(shape[2:] if len(shape) > 2 else shape[1:]) * kind.itemsize >= SMALL_SLICE_BYTES:
            continue  # no slice of at most two stacked axes is small (most keys: no need for stack_axes)
        axes = _slice_axes(key, kind, tuple(shape))
        if axes and math.prod(shape[len(axes) :]) * kind.itemsize < SMALL_SLICE_BYTES:
            small.append((key, math.prod(shape[: len(axes)])))
    crowded: list[str] = []
    kept = 0
    for key, slices in sorted(small):
        if kept + slices > MAX_SMALL_SLICES:
            crowded.append(key)
        else:
            kept += slices
    return frozenset(crowded)


def _scan_native(
    stats: KeyStats, kind: Kind, data: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], columns: int
) -> tuple[int, int]:
    """A chunk of 2- or 4-byte floats, its record its elements in row-major order, through the C loop as bytes
    (no numpy, no slabs): in each slice it covers (a stacked key's chunk may hold several layers; usually one),
    its part a contiguous run of the record, either one run of the slice's elements (``columns`` all of them) or
    (a 2-d slice's column split) rows of ``columns``. The chunk's (NaN, Inf) counts."""
    k = len(stats.axes)
    inner_shape, inner_origin = stats.shape[k:], tuple(offsets[k:])
    inner = math.prod(sizes[k:])
    raw = memoryview(data).cast("B")  # bytes, whatever the buffer's shape and format
    part = inner * kind.itemsize
    nan = inf = 0
    for at, local in enumerate(itertools.product(*(range(extent) for extent in sizes[:k]))):
        moments = stats.changing(tuple(map(operator.add, offsets[:k], local)))
        moments.count += inner
        one = add_native(kind, moments, raw[at * part : (at + 1) * part], inner, columns, inner_origin, inner_shape)
        nan, inf = nan + one[0], inf + one[1]
    return nan, inf


def _chunk_array(np: Any, kind: Kind, data: Any, nbytes: int, sizes: tuple[int, ...], view: Any) -> Any:
    """The chunk's elements as unsigned integers of the element's width (their bits), shaped ``sizes``; ``view``
    the record's (storage offset, size, stride), None where the chunk is its first elements in row-major order."""
    unsigned = _UNSIGNED.get(kind.itemsize) or _UNSIGNED.setdefault(kind.itemsize, np.dtype(f"<u{kind.itemsize}"))
    numel = math.prod(sizes)
    if view is None:
        if numel * kind.itemsize > nbytes:
            return None
        return np.frombuffer(data, dtype=unsigned, count=numel).reshape(sizes)
    offset, size, stride = view
    flat = np.frombuffer(data, dtype=unsigned, count=nbytes // kind.itemsize)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if numel else offset
    if offset < 0 or any(s < 0 for s in stride) or last >= len(flat):
        return None
    return np.lib.stride_tricks.as_strided(
        flat[offset:], shape=tuple(size), strides=tuple(s * kind.itemsize for s in stride), writeable=False
    )


_UNSIGNED: dict[int, Any] = {}  # itemsize -> numpy's little-endian unsigned dtype of that width


def _row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    step = 1
    for n, gap in zip(reversed(size), reversed(stride)):
        if n != 1 and gap != step:
            return False
        step *= n
    return True


def _slabs(part: Any, origin: tuple[int, ...]) -> Any:
    """Sub-arrays of ``part`` of at most :data:`SLAB_ELEMENTS` elements, each with its first element's index."""
    if part.size <= SLAB_ELEMENTS or part.ndim == 0:
        yield part, origin
        return
    dim = next(i for i, n in enumerate(part.shape) if n > 1)
    step = max(1, SLAB_ELEMENTS // max(part.size // part.shape[dim], 1))
    for start in range(0, part.shape[dim], step):
        sub = part[(slice(None),) * dim + (slice(start, start + step),)]
        yield from _slabs(sub, tuple(o + (start if i == dim else 0) for i, o in enumerate(origin)))


@dataclass(frozen=True)
class KeyHealth:
    """One key's statistics as ``check --health`` reports them (JSON ``health[].keys[]``)."""

    key: str
    dtype: str
    shape: list[int]
    count: int
    finite: int
    zeros: int
    nan: int
    inf: int
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    l2: float | None
    fingerprint: str  # 16 hex digits


def summarise(key: str, stats: KeyStats) -> KeyHealth:
    """The reported statistics of one key, computed once from its exact totals (correctly rounded)."""
    whole = stats.whole()
    mean, std, l2 = moment_values(whole, stats.dtype)
    return KeyHealth(
        key,
        stats.dtype,
        list(stats.shape),
        whole.count,
        whole.finite,
        whole.zeros,
        whole.nan,
        whole.inf,
        whole.low,
        whole.high,
        mean,
        std,
        l2,
        f"{whole.fingerprint:016x}",
    )
