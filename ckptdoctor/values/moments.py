"""The exact running statistics of a slice of tensor values (``check --health``), and how each dtype's bits decode.

:class:`Moments` holds plain integers and floats: counts, the exact sum and sum of squares of the finite values (as
integers, in units of the dtype's smallest subnormal: :attr:`Kind.scale`), min, max and the fingerprint. They merge
in any order, in any worker, to the same bits; :func:`moment_values` computes mean, std and the L2 norm once from the
totals, correctly rounded. :mod:`ckptdoctor.values.slab_stats` measures a slab into them,
:mod:`ckptdoctor.values.health` keeps them per key and slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Kind:
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


KINDS: dict[str, Kind] = {
    "torch.float16": Kind(2, 5, 10),
    "torch.bfloat16": Kind(2, 8, 7),
    "torch.float32": Kind(4, 8, 23),
    "torch.float64": Kind(8, 11, 52),
    "torch.int8": Kind(1),
    "torch.int16": Kind(2),
    "torch.int32": Kind(4),
    "torch.int64": Kind(8),
    "torch.uint8": Kind(1, signed=False),
    "torch.bool": Kind(1, signed=False),
}


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
        self.fingerprint = (self.fingerprint + other.fingerprint) & MASK64

    @property
    def all_zero(self) -> bool:
        return self.count > 0 and self.zeros == self.count


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
