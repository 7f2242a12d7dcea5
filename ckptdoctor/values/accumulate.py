"""Running comparison of two tensors' values: bitwise (same dtype, same bits) or within a tolerance.

:class:`Accumulator` is fed matching regions of A and B (any shapes, in any order) and keeps what a report
needs: elements compared, mismatches, max abs/rel difference, the L2 norm of the difference, the first N
mismatching elements in global row-major order. Regions are compared in slabs of at most
:data:`SLAB_ELEMENTS` elements, so temporaries stay at tens of MB whatever the chunk size. With
``first_difference`` it raises :class:`Different` at the first bitwise difference (``strip-frozen --base``
asks only whether two tensors are equal).
"""

from __future__ import annotations

import math
from typing import Any

from ckptdoctor.values.io import Torch

SLAB_ELEMENTS = 1 << 22  # elements compared at once: bounds temporaries to tens of MB


class Different(Exception):
    """Raised by an accumulator in ``first_difference`` mode at the first element that differs."""


def finite(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else "inf"


class Accumulator:
    """Running result over the compared sub-boxes of one key."""

    def __init__(
        self, torch: Any, atol: float | None, rtol: float | None, report: int = 0, first_difference: bool = False
    ) -> None:
        self.first_difference = first_difference
        self._torch = torch  # torch itself, or a values.io.Torch that imports it on first use
        self.tolerance = atol is not None or rtol is not None
        self.atol = atol or 0.0
        self.rtol = rtol or 0.0
        self.max_abs = 0.0
        self.mismatched = 0
        self.elements = 0
        self.nan_mismatch = 0
        self.padding = 0  # bucket padding elements on both sides (never written): covered, not compared
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
        if self.first_difference:
            raise Different
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
        return [finite(v.real), finite(v.imag)]
    return finite(v) if isinstance(v, float) else v


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
