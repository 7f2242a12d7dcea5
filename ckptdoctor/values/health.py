"""``check --health``: per-key statistics of tensor values, exact and the same at any layout of one saved state.

Fed one chunk at a time during ``check --deep``'s streaming pass (the raw bytes of the chunk's storage record, no
torch; float32, bfloat16 and float16 go through the C loop of ``_health.c`` where it was built, everything else
and everything without it through numpy, with the same results), it keeps per key, and per slice of a stacked
tensor (one layer of ``decoder.layers.*``, one expert of ``experts.experts.*``): the element count, finite count,
zeros, NaN, Inf, min, max, the sum and the sum of squares, and a fingerprint.

Order independence is by exact arithmetic, not by a fixed order: an IEEE value is ``±m * 2^(E - bias - p)``
(``m`` the significand with its implicit bit, ``E`` the biased exponent, at least 1), so the sum of a chunk is
``Σ_E 2^(E-1) * Σ{±m of the elements with exponent E}`` scaled by one constant per dtype. The inner sums are
``numpy.bincount`` over ``E`` of the significand cut in 12-bit limbs (weights below 2^24, at most
:data:`SLAB_ELEMENTS` of them: every partial sum is an integer below 2^53, so float64 adds it exactly in any
order); squares use the limbs' pairwise products. The totals are Python integers, so chunks merge in any order,
in any worker, to the same bits: mean, std and the L2 norm are computed once from them, correctly rounded.

The fingerprint is the sum mod 2^64 of ``c^i * h(bits)`` over the elements (``i`` the index in the slice, ``c``
odd, ``h`` one-to-one: :func:`_value_hashes`): equal slices have equal fingerprints wherever their chunks lie,
and one changed value always changes it (``c^i`` is odd, so a different hash changes the sum). A key's
fingerprint combines its slices' fingerprints with their indices. One- and two-byte dtypes (bfloat16, float16)
are counted by bit pattern: one ``bincount`` over the elements, the sums then over the 2^16 patterns; float32 by
its upper 13 bits (:func:`_by_upper_bits`). Both reduce to sums per sign and exponent; the C loop adds those up
into exact totals itself (returned as integers' bytes, with each row's fingerprint sum), numpy's path in
:func:`_sum_parts`.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.errors import MissingExtraError
from ckptdoctor.formats.plain_dcp import stacks_experts
from ckptdoctor.numpy_lazy import numpy_or_none

_native: Any
try:  # the per-element loop in C (_health.c); without it numpy does the same work
    from ckptdoctor.values import _health as _native
except ImportError:  # built without a compiler, or blocked (CKPTDOCTOR_NO_EXTENSIONS)
    _native = None

SLAB_ELEMENTS = 1 << 22  # elements hashed and summed at once: exact sums need < 2^29, memory tens of MB
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
_MASK64 = (1 << 64) - 1
_LIMB = 12  # bits per significand limb: a product of two limbs is below 2^24


@dataclass(frozen=True)
class _Kind:
    """How one dtype's elements decode: IEEE float (exponent and fraction bits) or integer (signed or not)."""

    itemsize: int
    exponent_bits: int = 0  # 0: an integer dtype
    fraction_bits: int = 0
    signed: bool = True

    @property
    def is_float(self) -> bool:
        return self.exponent_bits > 0

    @property
    def scale(self) -> int:
        """log2 of the factor that makes every finite value an integer (the smallest subnormal's exponent)."""
        if not self.is_float:
            return 0
        bias = (1 << (self.exponent_bits - 1)) - 1
        return bias + self.fraction_bits - 1

    @property
    def significand_bits(self) -> int:
        return self.fraction_bits + 1 if self.is_float else self.itemsize * 8


KINDS: dict[str, _Kind] = {
    "torch.float16": _Kind(2, 5, 10),
    "torch.bfloat16": _Kind(2, 8, 7),
    "torch.float32": _Kind(4, 8, 23),
    "torch.float64": _Kind(8, 11, 52),
    "torch.int8": _Kind(1),
    "torch.int16": _Kind(2),
    "torch.int32": _Kind(4),
    "torch.int64": _Kind(8),
    "torch.uint8": _Kind(1, signed=False),
    "torch.bool": _Kind(1, signed=False),
}


def require_numpy(purpose: str = "check --health (tensor statistics)") -> Any:
    """numpy, or the one clear error ``check --health`` (or ``purpose``) gives without it."""
    numpy = numpy_or_none()
    if numpy is None:
        raise MissingExtraError("numpy", "torch", purpose)
    return numpy


@dataclass(slots=True)  # one per slice: thousands a checkpoint
class Moments:
    """Exact running statistics of one slice (or one key): plain integers and floats, merged in any order."""

    count: int = 0
    finite: int = 0
    zeros: int = 0
    nan: int = 0
    inf: int = 0
    total: int = 0  # sum of the finite values x 2^scale
    total_sq: int = 0  # sum of their squares x 2^(2 scale)
    low: float | None = None  # smallest finite value
    high: float | None = None
    fingerprint: int = 0  # sum mod 2^64 of the hashes of (index in the slice, value bits)

    def merge(self, other: Moments) -> None:
        self.count += other.count
        self.finite += other.finite
        self.zeros += other.zeros
        self.nan += other.nan
        self.inf += other.inf
        self.total += other.total
        self.total_sq += other.total_sq
        if other.low is not None:
            self.low = other.low if self.low is None else min(self.low, other.low)
        if other.high is not None:
            self.high = other.high if self.high is None else max(self.high, other.high)
        self.fingerprint = (self.fingerprint + other.fingerprint) & _MASK64

    @property
    def all_zero(self) -> bool:
        return self.count > 0 and self.zeros == self.count


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
            fingerprint += _mix(_flat_index(index, self.shape) ^ _mix(moments.fingerprint))
        out.fingerprint = fingerprint & _MASK64
        return out


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python integer."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


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
            and _native is not None
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
                slab_nan, slab_inf = _add(np, kind, moments, slab, origin, inner_shape)
                nan, inf = nan + slab_nan, inf + slab_inf
        return (nan, inf) if whole else None


def _key_stats(key: str, kind: _Kind, dtype: str, shape: tuple[int, ...], crowded: bool = False) -> KeyStats:
    """A key's empty statistics, kept per slice of its stacked axes (unless ``crowded``: see :func:`crowded_keys`)."""
    return KeyStats(dtype, shape, () if crowded else _slice_axes(key, kind, shape))


def _slice_axes(key: str, kind: _Kind, shape: tuple[int, ...]) -> tuple[str, ...]:
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
    stats: KeyStats, kind: _Kind, data: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], columns: int
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
        one = _add_native(kind, moments, raw[at * part : (at + 1) * part], inner, columns, inner_origin, inner_shape)
        nan, inf = nan + one[0], inf + one[1]
    return nan, inf


def _chunk_array(np: Any, kind: _Kind, data: Any, nbytes: int, sizes: tuple[int, ...], view: Any) -> Any:
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


_HISTOGRAM_MIN = 1 << 12  # elements from which 2-byte dtypes are counted by bit pattern (one bincount; 1-byte: always)
_SPLIT = 26  # float64 holds a significand below 2^26, and its square split at 2^26, with room for 2^22 additions


def _add(
    np: Any, kind: _Kind, moments: Moments, bits: Any, origin: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, int]:
    """Add the elements ``bits`` (unsigned, at ``origin`` of a slice of ``shape``) to ``moments``; their (NaN, Inf)
    counts."""
    n = int(bits.size)
    if not n:
        return 0, 0
    moments.count += n
    if _native is not None and kind.is_float and kind.itemsize in (2, 4):
        if not bits.flags.c_contiguous:  # a strided view (rare) once copied (ascontiguousarray makes 0-d 1-d)
            bits = bits.copy(order="C")
        consecutive = bits.shape[1:] == tuple(shape[1:])  # whole trailing extents: one run of the slice's elements
        if consecutive or bits.ndim == 2:  # one run, or rows of a 2-d slice: the loop's fingerprint is the slab's
            return _add_native(kind, moments, bits, n, n if consecutive else bits.shape[-1], origin, shape)
        rows = bits.reshape(-1, bits.shape[-1])  # deeper: each row's sum, contracted with its index's powers
        sums = np.empty(rows.shape[0], dtype=np.uint64)
        measured = _native.floats(rows, rows.shape[1], kind.exponent_bits, kind.fraction_bits, sums, 1)
        return _merge_native(kind, moments, n, measured, _contract(np, sums, bits, origin, shape))
    fingerprint = _fingerprint(np, kind, bits, origin, shape)
    flat = bits.reshape(-1)
    if kind.itemsize == 1 or (kind.itemsize == 2 and n >= _HISTOGRAM_MIN):
        part = _by_histogram(np, kind, flat)
    elif kind == KINDS["torch.float32"] and n >= _HISTOGRAM_MIN:
        part = _by_upper_bits(np, flat)
    else:
        part = _by_element(np, kind, flat)
    moments.fingerprint = (moments.fingerprint + fingerprint) & _MASK64
    _merge_part(moments, part)
    return part.nan, part.inf


def _add_native(
    kind: _Kind, moments: Moments, data: Any, n: int, columns: int, origin: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, int]:
    """Add the ``n`` elements of ``data`` to ``moments`` (whose count the caller has added): 2- or 4-byte floats
    from ``origin`` of a slice of ``shape``, either one run of its elements (``columns`` is ``n``) or (a 2-d slice)
    rows of ``columns`` elements; their (NaN, Inf) counts. The C loop's call without numpy."""
    run = n == columns
    out = bytearray(8 if run else 8 * (n // columns))  # each row's fingerprint (scratch: their sum comes back)
    row_step = 1 if run else _golden_power(shape[-1])  # the index step from one row to the next
    measured = _native.floats(data, n if run else columns, kind.exponent_bits, kind.fraction_bits, out, row_step)
    fingerprint = _golden_power(_flat_index(origin, shape)) * measured[-1] & _MASK64
    return _merge_native(kind, moments, n, measured, fingerprint)


def _merge_native(kind: _Kind, moments: Moments, n: int, measured: tuple, fingerprint: int) -> tuple[int, int]:
    """Add what ``_health.floats`` measured of ``n`` elements, and their ``fingerprint``, to ``moments``."""
    zeros, nan, inf, low, high, positive, negative, squares, _ = measured
    moments.fingerprint = (moments.fingerprint + fingerprint) & _MASK64
    finite = n - nan - inf
    if finite:
        low, high = _FLOAT_PAIR[kind.itemsize, kind.exponent_bits](low, high)
    total = int.from_bytes(positive, "little") - int.from_bytes(negative, "little")
    _merge_counts(moments, finite, zeros, nan, inf, low, high, total, int.from_bytes(squares, "little"))
    return nan, inf


def _flat_index(origin: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The row-major index of the element at ``origin`` of an array of ``shape``."""
    start = 0
    for position, size in zip(origin, shape):
        start = start * size + position
    return start


@functools.lru_cache(maxsize=1024)
def _golden_power(exponent: int) -> int:
    """``c^exponent mod 2^64`` (``c`` the fingerprint's base): a chunk's weight from its first element's index, a few
    microseconds each and the same few indices in every key of one shape and chunking."""
    return pow(_GOLDEN, exponent, 1 << 64)


@dataclass
class _Part:
    """One slab's counts and exact sums (see :class:`Moments`)."""

    finite: int = 0
    zeros: int = 0
    nan: int = 0
    inf: int = 0
    low: float | int | None = None
    high: float | int | None = None
    total: int = 0
    total_sq: int = 0


def _merge_part(part: _Part | Moments, other: _Part) -> None:
    """Add a slab's counts and sums to ``part`` (another slab's, or a slice's :class:`Moments`)."""
    _merge_counts(
        part, other.finite, other.zeros, other.nan, other.inf, other.low, other.high, other.total, other.total_sq
    )


def _merge_counts(
    part: _Part | Moments,
    finite: int,
    zeros: int,
    nan: int,
    inf: int,
    low: float | int | None,
    high: float | int | None,
    total: int,
    total_sq: int,
) -> None:
    """Add a slab's counts and sums (``low`` and ``high`` read only where ``finite``) to ``part``."""
    if finite:
        if isinstance(low, float):  # -0.0 is 0.0: which of the two a zero min or max shows depends on no layout
            low, high = low + 0.0, high + 0.0  # type: ignore[operator]
        part.low = low if part.low is None else min(part.low, low)  # type: ignore[type-var]
        part.high = high if part.high is None else max(part.high, high)  # type: ignore[type-var]
    part.finite += finite
    part.zeros += zeros
    part.nan += nan
    part.inf += inf
    part.total += total
    part.total_sq += total_sq


_BLOCK = 1 << 17  # elements per step of the element-wise passes: their buffers stay in the core's cache
_LOW_BITS = 19  # float32 split: the upper 13 bits (sign, exponent, 4 fraction bits) pick the bin
_FRACTION_BINS = 1 << (23 - _LOW_BITS)  # bins per (sign, exponent)
_BINS = 2 * 256 * _FRACTION_BINS  # 2^13: the bin arrays stay in the core's cache
_SQUARES_BLOCK = 1 << 15  # float32 elements per float64 sum of squared low parts: (2^19)^2 * 2^15 < 2^53, exact


def _by_upper_bits(np: Any, flat: Any) -> _Part:
    """float32 by the count of each upper part (sign, exponent, 4 fraction bits: 2^13 bins), with the sums of the
    low 19 bits ``l`` and of their squares per bin: each value is ``±(a 2^19 + l) 2^bucket`` with ``a`` fixed by
    the bin, so a bin's sum is ``c a 2^19 + Σl`` and its sum of squares ``c a² 2^38 + 2 a Σl 2^19 + Σl²``. Three
    bincounts over the elements, in blocks through two reused buffers (bin index, low part); the squares summed
    in float64 per :data:`_SQUARES_BLOCK` elements (exact) and then in int64; the rest over the bins, in Python
    integers. NaN and Inf show in min and max (rare: then counted element-wise and left out)."""
    part = _Part()
    values = flat.view(np.float32)
    low, high = values.min(), values.max()
    if not (np.isfinite(low) and np.isfinite(high)):
        non_finite = (flat & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
        bad = int(np.count_nonzero(non_finite))
        part.nan = int(np.count_nonzero(flat[non_finite] & np.uint32(0x7FFFFF)))
        part.inf = bad - part.nan
        flat = flat[~non_finite]
        values = flat.view(np.float32)
        if not flat.size:
            return part
        low, high = values.min(), values.max()
    n = int(flat.size)
    part.finite = n
    part.low, part.high = float(low), float(high)
    step = min(n, _SQUARES_BLOCK)
    upper = np.empty(step, dtype=np.intp)
    lower = np.empty(step, dtype=np.float64)
    counts = np.zeros(_BINS, dtype=np.intp)
    lows = np.zeros(_BINS, dtype=np.float64)  # Σl < 2^22 * 2^19: exact
    squares = np.zeros(_BINS, dtype=np.int64)
    for start in range(0, n, step):
        block = flat[start : start + step]
        m = int(block.size)
        index, weight = upper[:m], lower[:m]
        np.right_shift(block, _LOW_BITS, out=index)
        np.bitwise_and(block, (1 << _LOW_BITS) - 1, out=weight)
        counts += np.bincount(index, minlength=_BINS)
        lows += np.bincount(index, weights=weight, minlength=_BINS)
        np.multiply(weight, weight, out=weight)
        squares += np.bincount(index, weights=weight, minlength=_BINS).astype(np.int64)
    # ±0 are the elements of the two bins of upper part ±0 whose low part is 0: all of them when those bins' low
    # parts sum to 0 (the usual case: no subnormal below 2^-130), else counted
    negative_zero = _BINS // 2
    if lows[0] == 0 and lows[negative_zero] == 0:
        part.zeros = int(counts[0] + counts[negative_zero])
    else:
        part.zeros = n - int(np.count_nonzero(values))  # -0.0 == 0
    _sum_parts(np, KINDS["torch.float32"], part, _bin_parts(np, counts, lows.astype(np.int64), squares))
    return part


def _bin_parts(np: Any, counts: Any, lows: Any, squares: Any) -> Any:
    """Per (sign, exponent) of float32 elements binned by their upper 13 bits (``counts``, and the sums of the low
    19 bits and of their squares per bin), with ``a`` the bin's upper significand: Σ c a, Σ c a², Σl, Σ a l, Σl²
    (the ``parts`` of :func:`_sum_parts`; every sum below 2^61)."""
    grid = (2, 256, _FRACTION_BINS)  # sign, exponent, upper fraction bits
    upper = (
        np.arange(_FRACTION_BINS, dtype=np.int64)[None, None, :]
        + (np.arange(256, dtype=np.int64)[None, :, None] > 0) * _FRACTION_BINS
    )
    c = counts.reshape(grid).astype(np.int64)
    low_sums = lows.reshape(grid)
    return np.stack(
        [
            (c * upper).sum(axis=2),
            (c * upper * upper).sum(axis=2),
            low_sums.sum(axis=2),
            (low_sums * upper).sum(axis=2),
            squares.reshape(grid).sum(axis=2),
        ]
    )


def _sum_parts(np: Any, kind: _Kind, part: _Part, parts: Any) -> None:
    """Add to ``part`` the exact sum and sum of squares of a slab's finite elements from their sums per (sign,
    biased exponent E), ``parts[i][sign][E]``: for 1- and 2-byte floats the significands ``m`` and their squares
    (the value is ``±m 2^(max(E, 1) - 1 - scale)``); for float32 the five sums of :func:`_bin_parts` (the
    significand is ``a 2^19 + l``). The signs' sums are combined in int64 (every one below 2^62), the rest per
    exponent present in Python integers."""
    present = np.flatnonzero(parts.any(axis=(0, 1)))
    if not present.size:
        return
    shifts = (np.maximum(present, 1) - 1).tolist()
    positive, negative = parts[:, 0, present], parts[:, 1, present]
    if kind.itemsize == 4:
        net = ((positive[0] - negative[0]) << _LOW_BITS) + (positive[2] - negative[2])  # below 2^48
        both = positive + negative
        terms = zip(shifts, net.tolist(), both[1].tolist(), both[3].tolist(), both[4].tolist())
        for shift, total, square_a, cross, square_l in terms:
            part.total += total << shift
            square = (square_a << (2 * _LOW_BITS)) + (cross << (_LOW_BITS + 1)) + square_l
            part.total_sq += square << (2 * shift)
    else:
        totals, squares = (positive[0] - negative[0]).tolist(), (positive[1] + negative[1]).tolist()
        for shift, total, square in zip(shifts, totals, squares):
            part.total += total << shift
            part.total_sq += square << (2 * shift)


_TABLES: dict[_Kind, tuple[Any, Any]] = {}  # kind -> (value of each bit pattern, whether it is finite)


def _pattern_table(np: Any, kind: _Kind) -> tuple[Any, Any]:
    """Every bit pattern of a 1- or 2-byte dtype: its value (float64 or int64) and whether it is finite."""
    table = _TABLES.get(kind)
    if table is None:
        patterns = np.arange(1 << (8 * kind.itemsize), dtype=np.uint64).astype(f"<u{kind.itemsize}")
        if kind.is_float:
            with np.errstate(invalid="ignore"):  # NaN patterns widen to NaN
                values = _float_values(np, kind, patterns).astype(np.float64)
            table = (values, np.isfinite(values))
        else:
            values = patterns.view(f"<i{kind.itemsize}") if kind.signed else patterns
            table = (values.astype(np.int64), np.ones(len(values), dtype=bool))
        _TABLES[kind] = table
    return table


def _by_histogram(np: Any, kind: _Kind, flat: Any) -> _Part:
    """A 1- or 2-byte dtype's slab from the count of each bit pattern: one pass over the elements, then work on the
    2^8 or 2^16 patterns. Exact in int64: every sum is at most 2^22 elements times a square below 2^44."""
    counts = np.zeros(1 << (8 * kind.itemsize), dtype=np.intp)
    index = np.empty(min(int(flat.size), _BLOCK), dtype=np.intp)  # bincount's own cast would be as large as flat
    for start in range(0, int(flat.size), _BLOCK):
        block = flat[start : start + _BLOCK]
        np.copyto(index[: block.size], block)
        counts += np.bincount(index[: block.size], minlength=len(counts))
    return _from_counts(np, kind, counts)


def _from_counts(np: Any, kind: _Kind, counts: Any) -> _Part:
    """A slab's counts and sums from the number of elements of each bit pattern (``counts``, one per pattern)."""
    values, finite_mask = _pattern_table(np, kind)
    counts = counts.astype(np.int64, copy=False)
    part = _Part()
    present = (counts > 0) & finite_mask
    if kind.is_float:
        eb, fb = kind.exponent_bits, kind.fraction_bits
        grid = counts.reshape(2, 1 << eb, 1 << fb)  # sign, exponent, fraction
        top = (1 << eb) - 1
        part.inf = int(grid[:, top, 0].sum())
        part.nan = int(grid[:, top, 1:].sum())
        part.zeros = int(grid[:, 0, 0].sum())
        significand = np.arange(1 << fb, dtype=np.int64)[None, None, :] + (
            np.arange(top, dtype=np.int64)[None, :, None] > 0
        ) * (1 << fb)
        finite = grid[:, :top, :]
        parts = np.zeros((2, 2, 256), dtype=np.int64)
        parts[0, :, :top] = (finite * significand).sum(axis=2)  # (sign, exponent)
        parts[1, :, :top] = (finite * significand * significand).sum(axis=2)
        _sum_parts(np, kind, part, parts)
    else:
        part.zeros = int(counts[0])
        part.total = int((counts * values).sum())
        part.total_sq = int((counts * values * values).sum())
    part.finite = int(counts.sum()) - part.nan - part.inf
    if part.finite:
        shown = values[present]
        low, high = shown.min(), shown.max()
        part.low, part.high = (float(low), float(high)) if kind.is_float else (int(low), int(high))
    return part


def _by_element(np: Any, kind: _Kind, flat: Any) -> _Part:
    """A slab element by element: sums per exponent by ``numpy.bincount`` (see the module doc)."""
    part = _Part()
    width = kind.itemsize * 8
    sign_bit = 1 << (width - 1)
    buckets = None
    if kind.is_float:
        top = (1 << kind.exponent_bits) - 1
        exponent = (flat >> kind.fraction_bits) & top
        non_finite = exponent == top
        bad = int(np.count_nonzero(non_finite))
        if bad:
            nan = int(np.count_nonzero(flat[non_finite] & ((1 << kind.fraction_bits) - 1)))
            part.nan, part.inf = nan, bad - nan
            keep = ~non_finite
            flat, exponent = flat[keep], exponent[keep]
        part.finite = int(flat.size)
        part.zeros = part.finite - int(np.count_nonzero(flat & (sign_bit - 1)))
        negative = flat >= sign_bit
        buckets = exponent.astype(np.intp)
        np.maximum(buckets, 1, out=buckets)
        buckets -= 1  # the value is ±significand * 2^(bucket - scale)
        values = _float_values(np, kind, flat)
        if kind.significand_bits <= _SPLIT:
            significand = (flat & ((1 << kind.fraction_bits) - 1)).astype(np.float64)
            np.add(significand, float(1 << kind.fraction_bits), out=significand, where=exponent > 0)
        else:
            significand = (flat & ((1 << kind.fraction_bits) - 1)).astype(np.int64)
            significand += (exponent > 0).astype(np.int64) << kind.fraction_bits
    else:
        part.finite = int(flat.size)
        part.zeros = part.finite - int(np.count_nonzero(flat))
        if kind.signed:
            signed = flat.view(f"<i{kind.itemsize}")
            negative = signed < 0
            significand = np.abs(signed.astype(np.int64)) if kind.itemsize < 8 else _abs64(np, signed)
            values = signed
        else:
            negative = np.zeros(flat.shape, dtype=bool)
            significand = flat.astype(np.uint64 if kind.itemsize == 8 else np.int64)
            values = flat
    if part.finite:
        low, high = values.min(), values.max()
        part.low, part.high = (float(low), float(high)) if kind.is_float else (int(low), int(high))
        if significand.dtype == np.float64:
            part.total, part.total_sq = _split_sums(np, kind, significand, negative, buckets)
        else:
            part.total, part.total_sq = _exact_sums(np, kind, significand, negative, buckets)
    return part


def _split_sums(np: Any, kind: _Kind, significand: Any, negative: Any, buckets: Any) -> tuple[int, int]:
    """(Σ ±m 2^bucket, Σ m² 2^(2 bucket)) for significands below 2^26 held in float64: three weighted bincounts,
    the squares (exact below 2^52) split at 2^26, so every bucket's sum of at most 2^22 stays below 2^53."""
    length = 1 << kind.exponent_bits
    square = significand * significand
    high = np.floor(square * (1.0 / (1 << _SPLIT)))
    low = square - high * float(1 << _SPLIT)
    np.negative(significand, out=significand, where=negative)
    sums = np.bincount(buckets, weights=significand, minlength=length)
    highs = np.bincount(buckets, weights=high, minlength=length)
    lows = np.bincount(buckets, weights=low, minlength=length)
    total = total_sq = 0
    for bucket in np.flatnonzero(highs + lows):
        total += int(sums[bucket]) << int(bucket)
        total_sq += ((int(highs[bucket]) << _SPLIT) + int(lows[bucket])) << (2 * int(bucket))
    return total, total_sq


def _abs64(np: Any, signed: Any) -> Any:
    """|x| of int64 elements as uint64 (|-2^63| included)."""
    unsigned = signed.view(np.uint64)
    return np.where(signed < 0, (~unsigned) + np.uint64(1), unsigned)


def _float_pair(unpack: str, shift: int) -> Any:
    """Two elements' bits (bfloat16 shifted into float32's place) to Python floats, without numpy."""
    pair = struct.Struct(unpack)
    pack = struct.Struct(unpack.replace("e", "H").replace("f", "I")).pack
    return lambda low, high: pair.unpack(pack(low << shift, high << shift))


_FLOAT_PAIR = {  # by (itemsize, exponent bits): a tuple of two ints hashes faster than a _Kind (a Python __hash__)
    (4, 8): _float_pair("<2f", 0),  # float32
    (2, 8): _float_pair("<2f", 16),  # bfloat16
    (2, 5): _float_pair("<2e", 0),  # float16
}


def _float_values(np: Any, kind: _Kind, bits: Any) -> Any:
    """The elements as numpy floats (bfloat16 widened to float32 by its bits), for min and max."""
    if kind.itemsize == 2 and kind.exponent_bits == 8:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view({2: np.float16, 4: np.float32, 8: np.float64}[kind.itemsize])


def _exact_sums(np: Any, kind: _Kind, significand: Any, negative: Any, buckets: Any) -> tuple[int, int]:
    """(Σ ±m 2^bucket, Σ m² 2^(2 bucket)) as exact integers for wide significands (float64, 32- and 64-bit
    integers): bincounts of 12-bit limbs and of their pairwise products (see the module doc)."""
    limbs = []
    remaining = significand
    mask = (1 << _LIMB) - 1
    for _ in range(-(-kind.significand_bits // _LIMB)):
        limbs.append((remaining & mask).astype(np.float64))
        remaining = remaining >> _LIMB
    sign = np.where(negative, -1.0, 1.0)
    minlength = (1 << kind.exponent_bits) if kind.is_float else 1

    def summed(weights: Any) -> list[int]:
        if buckets is None:
            return [int(weights.sum())]
        return [int(x) for x in np.bincount(buckets, weights=weights, minlength=minlength)]

    total = 0
    for i, limb in enumerate(limbs):
        for bucket, s in enumerate(summed(limb * sign)):
            if s:
                total += s << (bucket + _LIMB * i)
    total_sq = 0
    for i, a in enumerate(limbs):
        for j in range(i, len(limbs)):
            product = a * limbs[j]
            factor = 1 if i == j else 2
            for bucket, s in enumerate(summed(product)):
                if s:
                    total_sq += (factor * s) << (2 * bucket + _LIMB * (i + j))
    return total, total_sq


# splitmix64's constants: the golden-ratio increment (also the fingerprint's odd base) and the finaliser multipliers
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_HASHES: list[Any] = []  # splitmix64 of every 16-bit pattern: 1- and 2-byte elements hash by one lookup


def _hash_table(np: Any) -> Any:
    """splitmix64 of every 16-bit pattern (uint64[2^16])."""
    if not _HASHES:
        _HASHES.append(_splitmix(np, np.arange(1 << 16, dtype=np.uint64)))
    return _HASHES[0]


def _value_hashes(np: Any, kind: _Kind, bits: Any) -> Any:
    """A hash of each element's bits, one-to-one (distinct bits, distinct hashes): splitmix64 by table lookup for
    1- and 2-byte elements and computed for 8-byte ones; for 4-byte ones a 32-bit multiply-xorshift (a bijection,
    at a third of splitmix64's cost on uint64)."""
    if kind.itemsize <= 2:
        return _hash_table(np)[bits]
    if kind.itemsize == 4:  # in uint64 from the start: the matrix-vector product then casts nothing
        x = np.multiply(bits, np.uint32(0x9E3779B1), dtype=np.uint32).astype(np.uint64)
        x ^= x >> np.uint64(16)  # x < 2^32: as in uint32
        return x
    return _splitmix(np, bits.astype(np.uint64))


def _splitmix(np: Any, x: Any) -> Any:
    """splitmix64 of each element of the uint64 array ``x`` (in place)."""
    x += np.uint64(_GOLDEN)
    x ^= x >> np.uint64(30)
    x *= np.uint64(_M1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_M2)
    x ^= x >> np.uint64(31)
    return x


_POWERS: list[Any] = []  # c^j mod 2^64 for j < _BLOCK: the weights of one block of a last axis


def _fingerprint(np: Any, kind: _Kind, bits: Any, origin: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Σ c^i h(v_i) mod 2^64 over the elements ``bits`` at ``origin`` of a slice of ``shape`` (``i`` the index in
    the slice, row-major; ``c`` odd; ``h``: :func:`_value_hashes`): :func:`_row_sums`, then :func:`_contract`."""
    if bits.ndim == 0:
        return int(_value_hashes(np, kind, bits.reshape(1))[0])
    return _contract(np, _row_sums(np, kind, bits), bits, origin, shape)


def _row_sums(np: Any, kind: _Kind, bits: Any) -> Any:
    """Σ_j c^j h(v_j) mod 2^64 of each row (last axis) of ``bits``, as uint64. The last axis goes in blocks of
    :data:`_BLOCK` columns and rows: its powers are the cached ``c^j`` times one factor per block, and the
    contraction a uint64 matrix-vector product (wrapping, exact mod 2^64) with no temporary as large as the slab."""
    if not _POWERS:
        powers = np.full(_BLOCK, _GOLDEN, dtype=np.uint64)
        powers[0] = 1
        _POWERS.append(np.multiply.accumulate(powers))
    table = _POWERS[0]
    columns = bits.shape[-1]
    rows = bits.reshape(-1, columns)
    acc = np.zeros(rows.shape[0], dtype=np.uint64)
    step = max(1, _BLOCK // columns)
    for first in range(0, rows.shape[0], step):
        hashes = _value_hashes(np, kind, rows[first : first + step])
        out = acc[first : first + step]
        for column in range(0, columns, _BLOCK):
            block = hashes[:, column : column + _BLOCK]
            partial = np.matmul(block, table[: block.shape[1]])
            if column:
                partial *= np.uint64(pow(_GOLDEN, column, 1 << 64))
            out += partial
    return acc


def _contract(np: Any, sums: Any, bits: Any, origin: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The fingerprint of the elements ``bits`` from the sums of their rows (:func:`_row_sums`): ``c^i`` is the
    product over dims of ``(c^stride)^position``, so the sum contracts one axis at a time with a vector of
    powers."""
    if bits.ndim == 0:
        return int(sums[0])
    acc = sums * np.uint64(pow(_GOLDEN, origin[-1], 1 << 64))
    acc = acc.reshape(bits.shape[:-1])
    stride = shape[-1]
    for dim in range(len(shape) - 2, -1, -1):
        base = pow(_GOLDEN, stride, 1 << 64)
        powers = np.full(bits.shape[dim], base, dtype=np.uint64)
        powers[0] = pow(base, origin[dim], 1 << 64)
        np.multiply.accumulate(powers, out=powers)
        acc = (acc * powers).sum(axis=-1, dtype=np.uint64)
        stride *= shape[dim]
    return int(acc)


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


def moment_values(moments: Moments, dtype: str) -> tuple[float | None, float | None, float | None]:
    """Mean, std and L2 norm of the finite values of a key or slice of ``dtype``, from its exact totals (correctly
    rounded); None where it has no finite value."""
    n, scale = moments.finite, KINDS[dtype].scale
    if not n:
        return None, None, None
    mean = _ratio(moments.total, n << scale)
    variance = n * moments.total_sq - moments.total * moments.total  # n^2 2^(2 scale) times the variance
    std = math.sqrt(_ratio(max(variance, 0), (n * n) << (2 * scale)))
    l2 = math.sqrt(_ratio(moments.total_sq, 1 << (2 * scale)))
    return mean, std, l2


def _ratio(numerator: int, denominator: int) -> float:
    try:
        return numerator / denominator  # Python's int division: correctly rounded
    except OverflowError:
        return math.inf if numerator > 0 else -math.inf
