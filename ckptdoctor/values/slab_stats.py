"""One slab's counts, exact sums and fingerprint, added to a slice's :class:`~ckptdoctor.values.moments.Moments`:
the C loop of ``_health.c`` for float32, bfloat16 and float16 where it was built, numpy everywhere else, with the
same integers (tests/test_health_native.py and fuzz/fuzz_native.py hold the two to each other).

Order independence is by exact arithmetic, not by a fixed order: an IEEE value is ``±m * 2^(E - bias - p)``
(``m`` the significand with its implicit bit, ``E`` the biased exponent, at least 1), so the sum of a slab is
``Σ_E 2^(E-1) * Σ{±m of the elements with exponent E}`` scaled by one constant per dtype. The inner sums are
``numpy.bincount`` over ``E`` of the significand cut in 12-bit limbs (weights below 2^24, at most
:data:`SLAB_ELEMENTS` of them: every partial sum is an integer below 2^53, so float64 adds it exactly in any
order); squares use the limbs' pairwise products. The totals are Python integers.

The fingerprint is the sum mod 2^64 of ``c^i * h(bits)`` over the elements (``i`` the index in the slice, ``c``
odd, ``h`` one-to-one: :func:`_value_hashes`): equal slices have equal fingerprints wherever their chunks lie,
and one changed value always changes it (``c^i`` is odd, so a different hash changes the sum). One- and two-byte
dtypes (bfloat16, float16) are counted by bit pattern: one ``bincount`` over the elements, the sums then over the
2^16 patterns; float32 by its upper 13 bits (:func:`_by_upper_bits`). Both reduce to sums per sign and exponent;
the C loop adds those up into exact totals itself (returned as integers' bytes, with each row's fingerprint sum),
numpy's path in :func:`_sum_parts`.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any

from ckptdoctor.values.moments import KINDS, MASK64, Kind, Moments

native: Any
try:  # the per-element loop in C (_health.c); without it numpy does the same work
    from ckptdoctor.values import _health as native
except ImportError:  # built without a compiler, or blocked (CKPTDOCTOR_NO_EXTENSIONS)
    native = None

SLAB_ELEMENTS = 1 << 22  # elements hashed and summed at once: exact sums need < 2^29, memory tens of MB
_LIMB = 12  # bits per significand limb: a product of two limbs is below 2^24


def mix(x: int) -> int:
    """splitmix64's finaliser on a Python integer (a key's fingerprint mixes each slice's with its index)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


_HISTOGRAM_MIN = 1 << 12  # elements from which 2-byte dtypes are counted by bit pattern (one bincount; 1-byte: always)
_SPLIT = 26  # float64 holds a significand below 2^26, and its square split at 2^26, with room for 2^22 additions


def add_slab(
    np: Any, kind: Kind, moments: Moments, bits: Any, origin: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, int]:
    """Add the elements ``bits`` (unsigned, at ``origin`` of a slice of ``shape``) to ``moments``; their (NaN, Inf)
    counts."""
    n = int(bits.size)
    if not n:
        return 0, 0
    moments.count += n
    if native is not None and kind.is_float and kind.itemsize in (2, 4):
        if not bits.flags.c_contiguous:  # a strided view (rare) once copied (ascontiguousarray makes 0-d 1-d)
            bits = bits.copy(order="C")
        consecutive = bits.shape[1:] == tuple(shape[1:])  # whole trailing extents: one run of the slice's elements
        if consecutive or bits.ndim == 2:  # one run, or rows of a 2-d slice: the loop's fingerprint is the slab's
            return add_native(kind, moments, bits, n, n if consecutive else bits.shape[-1], origin, shape)
        rows = bits.reshape(-1, bits.shape[-1])  # deeper: each row's sum, contracted with its index's powers
        sums = np.empty(rows.shape[0], dtype=np.uint64)
        measured = native.floats(rows, rows.shape[1], kind.exponent_bits, kind.fraction_bits, sums, 1)
        return _merge_native(kind, moments, n, measured, _contract(np, sums, bits, origin, shape))
    fingerprint = _fingerprint(np, kind, bits, origin, shape)
    flat = bits.reshape(-1)
    if kind.itemsize == 1 or (kind.itemsize == 2 and n >= _HISTOGRAM_MIN):
        part = _by_histogram(np, kind, flat)
    elif kind == KINDS["torch.float32"] and n >= _HISTOGRAM_MIN:
        part = _by_upper_bits(np, flat)
    else:
        part = _by_element(np, kind, flat)
    moments.fingerprint = (moments.fingerprint + fingerprint) & MASK64
    _merge_part(moments, part)
    return part.nan, part.inf


def add_native(
    kind: Kind, moments: Moments, data: Any, n: int, columns: int, origin: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, int]:
    """Add the ``n`` elements of ``data`` to ``moments`` (whose count the caller has added): 2- or 4-byte floats
    from ``origin`` of a slice of ``shape``, either one run of its elements (``columns`` is ``n``) or (a 2-d slice)
    rows of ``columns`` elements; their (NaN, Inf) counts. The C loop's call without numpy."""
    run = n == columns
    out = bytearray(8 if run else 8 * (n // columns))  # each row's fingerprint (scratch: their sum comes back)
    row_step = 1 if run else _golden_power(shape[-1])  # the index step from one row to the next
    measured = native.floats(data, n if run else columns, kind.exponent_bits, kind.fraction_bits, out, row_step)
    fingerprint = _golden_power(flat_index(origin, shape)) * measured[-1] & MASK64
    return _merge_native(kind, moments, n, measured, fingerprint)


def _merge_native(kind: Kind, moments: Moments, n: int, measured: tuple, fingerprint: int) -> tuple[int, int]:
    """Add what ``_health.floats`` measured of ``n`` elements, and their ``fingerprint``, to ``moments``."""
    zeros, nan, inf, low, high, positive, negative, squares, _ = measured
    moments.fingerprint = (moments.fingerprint + fingerprint) & MASK64
    finite = n - nan - inf
    if finite:
        low, high = _FLOAT_PAIR[kind.itemsize, kind.exponent_bits](low, high)
    total = int.from_bytes(positive, "little") - int.from_bytes(negative, "little")
    _merge_counts(moments, finite, zeros, nan, inf, low, high, total, int.from_bytes(squares, "little"))
    return nan, inf


def flat_index(origin: tuple[int, ...], shape: tuple[int, ...]) -> int:
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


def _sum_parts(np: Any, kind: Kind, part: _Part, parts: Any) -> None:
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


_TABLES: dict[Kind, tuple[Any, Any]] = {}  # kind -> (value of each bit pattern, whether it is finite)


def _pattern_table(np: Any, kind: Kind) -> tuple[Any, Any]:
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


def _by_histogram(np: Any, kind: Kind, flat: Any) -> _Part:
    """A 1- or 2-byte dtype's slab from the count of each bit pattern: one pass over the elements, then work on the
    2^8 or 2^16 patterns. Exact in int64: every sum is at most 2^22 elements times a square below 2^44."""
    counts = np.zeros(1 << (8 * kind.itemsize), dtype=np.intp)
    index = np.empty(min(int(flat.size), _BLOCK), dtype=np.intp)  # bincount's own cast would be as large as flat
    for start in range(0, int(flat.size), _BLOCK):
        block = flat[start : start + _BLOCK]
        np.copyto(index[: block.size], block)
        counts += np.bincount(index[: block.size], minlength=len(counts))
    return _from_counts(np, kind, counts)


def _from_counts(np: Any, kind: Kind, counts: Any) -> _Part:
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


def _by_element(np: Any, kind: Kind, flat: Any) -> _Part:
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


def _split_sums(np: Any, kind: Kind, significand: Any, negative: Any, buckets: Any) -> tuple[int, int]:
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


_FLOAT_PAIR = {  # by (itemsize, exponent bits): a tuple of two ints hashes faster than a Kind (a Python __hash__)
    (4, 8): _float_pair("<2f", 0),  # float32
    (2, 8): _float_pair("<2f", 16),  # bfloat16
    (2, 5): _float_pair("<2e", 0),  # float16
}


def _float_values(np: Any, kind: Kind, bits: Any) -> Any:
    """The elements as numpy floats (bfloat16 widened to float32 by its bits), for min and max."""
    if kind.itemsize == 2 and kind.exponent_bits == 8:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view({2: np.float16, 4: np.float32, 8: np.float64}[kind.itemsize])


def _exact_sums(np: Any, kind: Kind, significand: Any, negative: Any, buckets: Any) -> tuple[int, int]:
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


def _value_hashes(np: Any, kind: Kind, bits: Any) -> Any:
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


def _fingerprint(np: Any, kind: Kind, bits: Any, origin: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Σ c^i h(v_i) mod 2^64 over the elements ``bits`` at ``origin`` of a slice of ``shape`` (``i`` the index in
    the slice, row-major; ``c`` odd; ``h``: :func:`_value_hashes`): :func:`_row_sums`, then :func:`_contract`."""
    if bits.ndim == 0:
        return int(_value_hashes(np, kind, bits.reshape(1))[0])
    return _contract(np, _row_sums(np, kind, bits), bits, origin, shape)


def _row_sums(np: Any, kind: Kind, bits: Any) -> Any:
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
