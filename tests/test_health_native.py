"""The per-element loop of ``check --health`` in C (``ckptdoctor/values/_health.c``) gives numpy's statistics, exactly.

``slab_stats.add_slab`` runs ``_health.floats`` for float32, bfloat16 and float16 slabs where the extension was built
and numpy (``_by_element``, ``_by_histogram``, ``_by_upper_bits``, ``_fingerprint``) where not, so every slab here goes
through both and the :class:`Moments` must be identical (counts, exact sums, min and max with their sign, the
fingerprint), and both must equal an independent reference: each element decoded from its bits by the IEEE
definition into a ``fractions.Fraction``, summed exactly, and the fingerprint as its definition says
(``Σ GOLDEN^i h(bits_i) mod 2^64``, ``i`` the row-major index in the slice). Slabs: normal values at scales from
1e-30 to 1e30, uniformly random bits (NaN, ±Inf, subnormals), zeros of both signs, subnormals, single elements and
0-d, rows of every length mod 4 and rows longer than 4096, blocks at nonzero origins of larger slices, strided and
transposed views, below and above ``_HISTOGRAM_MIN``. One tensor fed to ``HealthScan.scan`` in different chunkings
(shuffled, transposed storage included) gives the same key statistics, with C and without. ``floats`` rejects
arguments of the wrong size or layout with an exception rather than reading or writing out of bounds.
"""

from __future__ import annotations

import functools
import math
import random
from fractions import Fraction

import numpy as np
import pytest

_health = pytest.importorskip(
    "ckptdoctor.values._health", reason="the C health loop was not built or is blocked", exc_type=ImportError
)

from ckptdoctor.values import health, slab_stats  # noqa: E402
from ckptdoctor.values.health import HealthScan  # noqa: E402
from ckptdoctor.values.moments import KINDS, Moments  # noqa: E402

DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")
GOLDEN = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def _unsigned(kind) -> np.dtype:
    return np.dtype(f"<u{kind.itemsize}")


def _bits_from(kind, values) -> np.ndarray:
    """Bit patterns of float64 ``values`` rounded (float16) or truncated (bfloat16) to the dtype."""
    values = np.asarray(values, dtype=np.float64)
    if kind.itemsize == 4:
        return values.astype(np.float32).view(np.uint32)
    if kind.exponent_bits == 5:
        with np.errstate(over="ignore"):
            return values.astype(np.float16).view(np.uint16)
    return (values.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _pattern(kind, sign: int, exponent: int, fraction) -> np.ndarray:
    """Bits from sign, biased exponent and fraction fields (arrays broadcast)."""
    width = kind.itemsize * 8
    bits = (
        (np.asarray(sign, dtype=np.uint64) << np.uint64(width - 1))
        | (np.asarray(exponent, dtype=np.uint64) << np.uint64(kind.fraction_bits))
        | np.asarray(fraction, dtype=np.uint64)
    )
    return bits.astype(_unsigned(kind))


def _random_bits(rng, kind, shape) -> np.ndarray:
    return rng.integers(0, 1 << (8 * kind.itemsize), size=shape, dtype=_unsigned(kind))


# --- the reference ------------------------------------------------------------------------------------------


def _decode(kind, bits: int):
    """The element's value as a Fraction, or "nan" / "inf", from the IEEE definition."""
    width = kind.itemsize * 8
    sign = bits >> (width - 1)
    exponent = (bits >> kind.fraction_bits) & ((1 << kind.exponent_bits) - 1)
    fraction = bits & ((1 << kind.fraction_bits) - 1)
    if exponent == (1 << kind.exponent_bits) - 1:
        return "nan" if fraction else "inf"
    bias = (1 << (kind.exponent_bits - 1)) - 1
    if exponent == 0:  # subnormal: 0.fraction x 2^(1 - bias)
        value = Fraction(fraction, 1 << kind.fraction_bits) * Fraction(2) ** (1 - bias)
    else:
        value = (1 + Fraction(fraction, 1 << kind.fraction_bits)) * Fraction(2) ** (exponent - bias)
    return -value if sign else value


def _reference(kind, bits: np.ndarray, origin: tuple, shape: tuple) -> dict:
    flat = [int(b) for b in np.asarray(bits).reshape(-1)]
    hashes = [int(h) for h in slab_stats._value_hashes(np, kind, np.asarray(bits).reshape(-1))]
    ref = {"count": len(flat), "finite": 0, "zeros": 0, "nan": 0, "inf": 0}
    total = total_sq = Fraction(0)
    low = high = None
    fingerprint = 0
    for position, b, h in zip(np.ndindex(*np.shape(bits)), flat, hashes):
        index = 0
        for o, p, n in zip(origin, position, shape):
            index = index * n + o + p
        fingerprint = (fingerprint + pow(GOLDEN, index, 1 << 64) * h) & MASK
        value = _decode(kind, b)
        if isinstance(value, str):
            ref[value] += 1
            continue
        ref["finite"] += 1
        ref["zeros"] += value == 0
        total += value
        total_sq += value * value
        low = value if low is None else min(low, value)
        high = value if high is None else max(high, value)
    ref.update(total=total, total_sq=total_sq, low=low, high=high, fingerprint=fingerprint)
    return ref


def _matches_reference(kind, moments: Moments, ref: dict) -> None:
    for name in ("count", "finite", "zeros", "nan", "inf", "fingerprint"):
        assert getattr(moments, name) == ref[name], name
    assert Fraction(moments.total, 1 << kind.scale) == ref["total"]
    assert Fraction(moments.total_sq, 1 << (2 * kind.scale)) == ref["total_sq"]
    for name in ("low", "high"):
        shown = getattr(moments, name)
        if ref[name] is None:
            assert shown is None, name
        else:
            assert isinstance(shown, float) and Fraction(shown) == ref[name], name
            if shown == 0:  # -0.0 shows as 0.0
                assert math.copysign(1.0, shown) == 1.0, name


# --- both paths ---------------------------------------------------------------------------------------------


def _add(monkeypatch, kind, bits, origin, shape, native: bool) -> Moments:
    moments = Moments()
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(slab_stats, "native", None)
        slab_stats.add_slab(np, kind, moments, bits, origin, shape)
    return moments


def _shown(moments: Moments) -> tuple:
    """Every field, the floats by repr (0.0 and -0.0 differ)."""
    return (
        moments.count,
        moments.finite,
        moments.zeros,
        moments.nan,
        moments.inf,
        moments.total,
        moments.total_sq,
        repr(moments.low),
        repr(moments.high),
        moments.fingerprint,
    )


def _check(monkeypatch, kind, bits, origin=None, shape=None) -> Moments:
    """Both paths on one slab: identical, and equal to the reference. The C path's Moments."""
    if origin is None:
        origin, shape = (0,) * bits.ndim, bits.shape
    assert slab_stats.native is _health
    c = _add(monkeypatch, kind, bits, origin, shape, native=True)
    python = _add(monkeypatch, kind, bits, origin, shape, native=False)
    assert _shown(c) == _shown(python)
    _matches_reference(kind, c, _reference(kind, bits, origin, shape))
    return c


def _normals(rng, kind, shape, scale):
    return _bits_from(kind, rng.normal(size=shape) * scale)


SMALL, LARGE = (37, 29), (70, 67)  # 1073 and 4690 elements: either side of _HISTOGRAM_MIN
assert SMALL[0] * SMALL[1] < slab_stats._HISTOGRAM_MIN < LARGE[0] * LARGE[1]


def _normals_case(rng, kind, *, scale, size):
    return _normals(rng, kind, size, scale)


def _with_specials(rng, kind, shape):
    bits = _normals(rng, kind, shape, 3.0).reshape(-1)
    top = (1 << kind.exponent_bits) - 1
    specials = [
        _pattern(kind, 0, top, 0),  # +Inf
        _pattern(kind, 1, top, 0),  # -Inf
        _pattern(kind, 0, top, 1 << (kind.fraction_bits - 1)),  # quiet NaN
        _pattern(kind, 1, top, 1),  # negative signalling NaN
        _pattern(kind, 0, top, (1 << kind.fraction_bits) - 1),
    ]
    where = rng.choice(bits.size, size=7, replace=False)
    for at, special in zip(where, specials + specials[:2]):
        bits[at] = special
    return bits.reshape(shape)


def _signed_zeros(rng, kind, shape):
    return _pattern(kind, rng.integers(0, 2, size=shape), 0, 0)


def _subnormals(rng, kind, shape):
    fraction = rng.integers(1, 1 << kind.fraction_bits, size=shape)
    return _pattern(kind, rng.integers(0, 2, size=shape), 0, fraction)


def _zeros_and_tiny(rng, kind, shape):
    """±0 with subnormals of the smallest fraction bits (float32: in the zero bins of the upper 13 bits)."""
    fraction = rng.integers(0, 1 << (kind.fraction_bits - 4), size=shape) * rng.integers(0, 2, size=shape)
    return _pattern(kind, rng.integers(0, 2, size=shape), 0, fraction)


def _mixed(rng, kind, shape):
    """Normals, ±0, subnormals, NaN, ±Inf and random bits, element by element."""
    n = math.prod(shape)
    top = (1 << kind.exponent_bits) - 1
    choices = [
        _normals(rng, kind, n, 10.0 ** rng.integers(-8, 8)),
        _signed_zeros(rng, kind, n),
        _subnormals(rng, kind, n),
        _pattern(kind, rng.integers(0, 2, size=n), top, rng.integers(0, 2, size=n)),
        _random_bits(rng, kind, n),
    ]
    pick = rng.choice(len(choices), size=n, p=[0.5, 0.15, 0.1, 0.05, 0.2])
    return np.choose(pick, choices).astype(_unsigned(kind)).reshape(shape)


CASES = {
    **{
        f"normal-{scale:g}-{name}": functools.partial(_normals_case, scale=scale, size=size)
        for scale in (1e-30, 1e-6, 1.0, 1e6, 1e30)
        for name, size in (("small", SMALL), ("large", LARGE))
    },
    "random-bits-small": lambda rng, kind: _random_bits(rng, kind, SMALL),
    "random-bits-large": lambda rng, kind: _random_bits(rng, kind, LARGE),
    "all-zero-small": lambda rng, kind: np.zeros(SMALL, dtype=_unsigned(kind)),
    "all-zero-large": lambda rng, kind: np.zeros(LARGE, dtype=_unsigned(kind)),
    "negative-zero": lambda rng, kind: _pattern(kind, np.ones(SMALL, dtype=np.uint64), 0, 0),
    "signed-zeros-small": lambda rng, kind: _signed_zeros(rng, kind, SMALL),
    "signed-zeros-large": lambda rng, kind: _signed_zeros(rng, kind, LARGE),
    "nan-inf-among-normals-small": lambda rng, kind: _with_specials(rng, kind, SMALL),
    "nan-inf-among-normals-large": lambda rng, kind: _with_specials(rng, kind, LARGE),
    "only-non-finite": lambda rng, kind: _pattern(
        kind, rng.integers(0, 2, size=SMALL), (1 << kind.exponent_bits) - 1, rng.integers(0, 3, size=SMALL)
    ),
    "subnormal-small": lambda rng, kind: _subnormals(rng, kind, SMALL),
    "subnormal-large": lambda rng, kind: _subnormals(rng, kind, LARGE),
    "zeros-and-tiny-small": lambda rng, kind: _zeros_and_tiny(rng, kind, SMALL),
    "zeros-and-tiny-large": lambda rng, kind: _zeros_and_tiny(rng, kind, LARGE),
    "mixed-large": lambda rng, kind: _mixed(rng, kind, LARGE),
    "just-below-histogram": lambda rng, kind: _mixed(rng, kind, (slab_stats._HISTOGRAM_MIN - 1,)),
    "just-at-histogram": lambda rng, kind: _mixed(rng, kind, (slab_stats._HISTOGRAM_MIN,)),
    "single-element": lambda rng, kind: _normals(rng, kind, (1,), 1.0),
    "single-nan": lambda rng, kind: _pattern(kind, [0], (1 << kind.exponent_bits) - 1, [3]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_slabs_match_numpy_and_reference(monkeypatch, dtype, case):
    kind = KINDS[dtype]
    rng = np.random.default_rng([DTYPES.index(dtype), sorted(CASES).index(case)])
    _check(monkeypatch, kind, CASES[case](rng, kind))


def _both_passes(bits: np.ndarray) -> None:
    """float32 through ``floats``' vectorised pass (where this build and processor have it) and its portable one:
    the same tuple and the same row fingerprints."""
    rows = np.ascontiguousarray(bits).reshape(-1, bits.shape[-1] if bits.ndim else 1)
    results = []
    for portable in (False, True):
        out = np.zeros(rows.shape[0], dtype=np.uint64)
        results.append((_health.floats(rows, rows.shape[1], 8, 23, out, 12345, portable), out.tolist()))
    assert results[0] == results[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_passes_agree(case):
    kind = KINDS["torch.float32"]
    _both_passes(CASES[case](np.random.default_rng(sorted(CASES).index(case)), kind))


def test_float32_passes_agree_on_every_row_length():
    kind = KINDS["torch.float32"]
    rng = np.random.default_rng(29)
    for columns in (*range(1, 10), 63, 64, 65, 127, 128, 129, 4099):
        _both_passes(_mixed(rng, kind, (3, columns)))
    _both_passes(_mixed(rng, kind, (257, 4099)))  # over 2^20 elements: the counts moved aside mid-slab


def _scalars(kind) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    patterns = _mixed(rng, kind, (40,)).tolist() + [0, 1 << (kind.itemsize * 8 - 1)]
    return [np.array(bits, dtype=_unsigned(kind)) for bits in patterns]


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_dimensional_numpy(monkeypatch, dtype):
    kind = KINDS[dtype]
    for scalar in _scalars(kind):
        assert scalar.ndim == 0
        moments = _add(monkeypatch, kind, scalar, (), (), native=False)
        _matches_reference(kind, moments, _reference(kind, scalar, (), ()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_dimensional(monkeypatch, dtype):
    kind = KINDS[dtype]
    for scalar in _scalars(kind):
        _check(monkeypatch, kind, scalar, (), ())


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_dimensional_tensor_scanned(monkeypatch, dtype):
    """A 0-d tensor (a scalar buffer) through HealthScan.scan, as check --health feeds it, with C."""
    kind = KINDS[dtype]
    scalar = _bits_from(kind, np.array(1.5))
    assert scalar.ndim == 0
    scan = HealthScan()
    scan.scan("step", dtype, (), (), (), scalar.tobytes())
    _matches_reference(kind, scan.keys["step"].slices[()], _reference(kind, scalar, (), ()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_length(monkeypatch, dtype):
    """Rows of 1 to 9 columns and around multiples of 64 (every remainder of the C loops' 4 and 64 lanes), and rows
    longer than 4096."""
    kind = KINDS[dtype]
    rng = np.random.default_rng(11)
    for columns in (*range(1, 10), 63, 64, 65, 127, 128, 129, 191, 200):
        for rows in (1, 3):
            _check(monkeypatch, kind, _mixed(rng, kind, (rows, columns)))
    for columns in (4097, 4098, 4099, 4100, 5003):
        _check(monkeypatch, kind, _mixed(rng, kind, (1, columns)))
    _check(monkeypatch, kind, _mixed(rng, kind, (2, 4099)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_slab_over_a_million_elements(monkeypatch, dtype):
    """A slab of more than 2^20 elements (the float32 loop moves its bins' counts aside every 2^20 elements) with
    values over many exponents, zeros, subnormals, NaN and Inf: C and numpy agree (the reference would take minutes)."""
    kind = KINDS[dtype]
    bits = _mixed(np.random.default_rng(19), kind, (257, 4099))
    assert bits.size > 1 << 20
    c = _add(monkeypatch, kind, bits, (0, 0), bits.shape, native=True)
    assert _shown(c) == _shown(_add(monkeypatch, kind, bits, (0, 0), bits.shape, native=False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", (1e-3, 1e20))
def test_narrow_exponent_ranges(monkeypatch, dtype, scale):
    """Slabs whose exponents span a few values (the float32 loop visits only the bins of the exponents it saw),
    with and without zeros and subnormals beside them."""
    kind = KINDS[dtype]
    rng = np.random.default_rng(23)
    narrow = _bits_from(kind, rng.uniform(1.0, 2.0, size=(9, 70)) * scale)
    _check(monkeypatch, kind, narrow)
    mixed = narrow.copy().reshape(-1)
    mixed[::7] = _signed_zeros(rng, kind, mixed[::7].shape)
    mixed[3::11] = _subnormals(rng, kind, mixed[3::11].shape)
    _check(monkeypatch, kind, mixed.reshape(narrow.shape))


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_at_an_origin(monkeypatch, dtype):
    """Blocks of a larger slice, at nonzero origins: the fingerprint weighs each element by its index in the slice."""
    kind = KINDS[dtype]
    rng = np.random.default_rng(13)
    _check(monkeypatch, kind, _mixed(rng, kind, (3, 4, 5)), (2, 5, 7), (6, 10, 12))
    _check(monkeypatch, kind, _mixed(rng, kind, (5, 33, 27)), (1, 4, 2), (8, 40, 30))  # above _HISTOGRAM_MIN
    _check(monkeypatch, kind, _mixed(rng, kind, (2, 3)), (0, 9), (4, 12))
    _check(monkeypatch, kind, _mixed(rng, kind, (1, 1, 6)), (3, 7, 0), (4, 8, 6))
    _check(monkeypatch, kind, _mixed(rng, kind, (4,)), (100,), (200,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_views(monkeypatch, dtype):
    kind = KINDS[dtype]
    rng = np.random.default_rng(17)
    base = _mixed(rng, kind, (40, 120))
    transposed = base.T  # 4800 elements
    assert not transposed.flags.c_contiguous
    _check(monkeypatch, kind, transposed)
    _check(monkeypatch, kind, transposed, (10, 5), (200, 60))
    strided = base[::2, 1::3]  # 800 elements
    assert not strided.flags.c_contiguous
    _check(monkeypatch, kind, strided, (3, 0), (30, 45))
    small = base[:10, :30].T[::-1]  # reversed rows of a transposed block
    _check(monkeypatch, kind, small)


# --- one tensor in different chunkings ----------------------------------------------------------------------


def _chunkings(rows: int, columns: int) -> dict[str, list[tuple[tuple[int, int], tuple[int, int], bool]]]:
    """(offsets, sizes, stored transposed) of each chunk, per way to cut a (rows, columns) tensor."""

    def grid(row_cuts, column_cuts, transposed=False):
        return [
            ((r0, c0), (r1 - r0, c1 - c0), transposed)
            for r0, r1 in zip(row_cuts, row_cuts[1:])
            for c0, c1 in zip(column_cuts, column_cuts[1:])
        ]

    return {
        "whole": grid([0, rows], [0, columns]),
        "dim 0": grid([0, rows // 3, 2 * rows // 3, rows], [0, columns]),
        "dim 1": grid([0, rows], list(range(0, columns, 16)) + [columns]),
        "uneven grid": grid([0, 1, rows // 2 + 1, rows], [0, 7, 8, columns]),
        "transposed storage": grid([0, rows // 2, rows], [0, 33, columns], transposed=True),
    }


def _scan(key, dtype, tensor, chunks, shuffle_seed, per_layer=False):
    """``tensor``'s chunks (of its last two axes) scanned in a shuffled order; the leading axes whole, or with
    ``per_layer`` each chunk cut per index of the leading axis (as Megatron saves a stacked key's layers)."""
    scan = HealthScan()
    chunks = list(chunks)
    if per_layer:
        chunks = [(layer, *chunk) for layer in range(tensor.shape[0]) for chunk in chunks]
    else:
        chunks = [(None, *chunk) for chunk in chunks]
    random.Random(shuffle_seed).shuffle(chunks)
    k = tensor.ndim - 2  # leading axes kept whole
    for layer, (r0, c0), (nr, nc), transposed in chunks:
        block = tensor[..., r0 : r0 + nr, c0 : c0 + nc]
        offsets = (0,) * k + (r0, c0)
        sizes = tensor.shape[:k] + (nr, nc)
        if layer is not None:
            block = block[layer : layer + 1]
            offsets = (layer,) + offsets[1:]
            sizes = (1,) + sizes[1:]
        if transposed:  # the storage holds the block column-major: a strided view reads it
            data = np.ascontiguousarray(np.moveaxis(block, -1, -2)).tobytes()
            stride = tuple(math.prod(sizes[i + 1 :]) for i in range(k)) + (1, nr)
            scan.scan(key, dtype, tensor.shape, offsets, sizes, data, (0, sizes, stride))
        else:
            scan.scan(key, dtype, tensor.shape, offsets, sizes, np.ascontiguousarray(block).tobytes())
    return scan.keys[key]


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunkings_give_the_same_statistics(monkeypatch, dtype):
    kind = KINDS[dtype]
    rng = np.random.default_rng(19)
    tensor = _mixed(rng, kind, (96, 128))  # dim-0 chunks of 4096 elements, dim-1 chunks of 1536
    ref = _reference(kind, tensor, (0, 0), tensor.shape)
    seen = []
    for native in (True, False):
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(slab_stats, "native", None)
            for name, chunks in _chunkings(*tensor.shape).items():
                for shuffle in range(2):
                    stats = _scan("model.embedding.weight", dtype, tensor, chunks, shuffle)
                    assert list(stats.slices) == [()]
                    _matches_reference(kind, stats.slices[()], ref)
                    seen.append((native, name, _shown(stats.whole())))
    assert len({shown for _, _, shown in seen}) == 1, seen


@pytest.mark.parametrize("per_layer", [False, True], ids=["layers together", "a chunk per layer"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunkings_of_a_stacked_key(monkeypatch, dtype, per_layer):
    """A layer-stacked key: per-layer slices, each the same under every chunking of the other axes, whether a
    chunk holds every layer or one (the C loop's direct call)."""
    kind = KINDS[dtype]
    rng = np.random.default_rng(23)
    tensor = _mixed(rng, kind, (3, 24, 80))
    key = "decoder.layers.mlp.linear_fc1.weight"
    assert health.stack_axes(key) == ("layer",)
    refs = {(layer,): _reference(kind, tensor[layer], (0, 0), tensor.shape[1:]) for layer in range(3)}
    seen = set()
    for native in (True, False):
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(slab_stats, "native", None)
            for name, chunks in _chunkings(24, 80).items():
                stats = _scan(key, dtype, tensor, chunks, len(name), per_layer)
                assert sorted(stats.slices) == sorted(refs)
                for index, moments in stats.slices.items():
                    _matches_reference(kind, moments, refs[index])
                seen.add(_shown(stats.whole()))
    assert len(seen) == 1


def test_slices_too_small_for_a_layer_are_one_key():
    """A hostile stacked shape ([2^17, 1]: a slice per element) is measured whole, fast and in little memory, with
    the statistics of the same values under an unstacked name; slices of MIN_SLICE_ELEMENTS stay slices."""
    rows = 1 << 17
    values = np.random.default_rng(3).standard_normal((rows, 1), dtype=np.float32)
    stacked, plain = HealthScan(), HealthScan()
    stacked.scan(
        "decoder.layers.mlp.router.expert_bias", "torch.float32", (rows, 1), (0, 0), (rows, 1), values.tobytes()
    )
    plain.scan("output_layer.bias", "torch.float32", (rows, 1), (0, 0), (rows, 1), values.tobytes())
    key = stacked.keys["decoder.layers.mlp.router.expert_bias"]
    assert key.axes == () and list(key.slices) == [()]
    assert _shown(key.whole()) == _shown(plain.keys["output_layer.bias"].whole())
    width = health.MIN_SLICE_ELEMENTS
    kept = HealthScan()
    kept.scan(
        "decoder.layers.mlp.router.expert_bias",
        "torch.float32",
        (3, width),
        (0, 0),
        (3, width),
        values[: 3 * width].tobytes(),
    )
    assert kept.keys["decoder.layers.mlp.router.expert_bias"].axes == ("layer",)
    assert sorted(kept.keys["decoder.layers.mlp.router.expert_bias"].slices) == [(0,), (1,), (2,)]


def test_integer_slices_need_more_elements():
    """Integer tensors (numpy's path, tens of microseconds a slice) are kept per slice from MIN_INTEGER_SLICE_ELEMENTS
    elements a slice: FP8 weights' bytes per layer, not a hostile [2^16, 8] of uint8."""
    key = "decoder.layers.mlp.linear_fc1.weight"
    for width, axes in ((8, ()), (health.MIN_INTEGER_SLICE_ELEMENTS, ("layer",))):
        rows = 3 if axes else 1 << 16
        scan = HealthScan()
        scan.scan(key, "torch.uint8", (rows, width), (0, 0), (rows, width), bytes(range(256)) * (rows * width // 256))
        assert scan.keys[key].axes == axes
        assert len(scan.keys[key].slices) == (rows if axes else 1)


# --- argument validation ------------------------------------------------------------------------------------

F32, BF16, F16 = (8, 23), (8, 7), (5, 10)


def _still_works():
    data = np.array([[0x3F80, 0xC000, 0x0000]], dtype=np.uint16)  # bfloat16 1, -2, 0
    out = np.zeros(1, dtype=np.uint64)
    zeros, nan, inf, low, high, positive, negative, squares, rows = _health.floats(data, 3, *BF16, out, 7)
    assert (zeros, nan, inf, low, high) == (1, 0, 0, 0xC000, 0x3F80)
    scale = 2 ** KINDS["torch.bfloat16"].scale  # the sums count units of the smallest subnormal
    assert (int.from_bytes(positive, "little"), int.from_bytes(negative, "little")) == (1 * scale, 2 * scale)
    assert int.from_bytes(squares, "little") == 5 * scale * scale
    assert rows == int(out[0])  # one row: row_step^0 times its sum


@pytest.mark.parametrize(
    "data, columns, layout, rows",
    [
        pytest.param(np.zeros(10, np.uint16), 4, BF16, 3, id="not whole rows"),
        pytest.param(np.zeros(10, np.uint32), 4, F32, 3, id="float32 not whole rows"),
        pytest.param(bytes(7), 1, F16, 4, id="odd bytes for 2-byte elements"),
        pytest.param(bytes(6), 1, F32, 2, id="bytes not whole float32 elements"),
        pytest.param(np.zeros(8, np.uint16), 0, F16, 8, id="columns 0"),
        pytest.param(np.zeros(8, np.uint16), -4, F16, 8, id="columns negative"),
        pytest.param(np.zeros((1 << 22) + 1, np.uint16), 1, BF16, 1, id="2^22 + 1 elements"),
        pytest.param(np.zeros((1 << 22) + 4, np.uint32), 4, F32, 1, id="float32 over 2^22 elements"),
        pytest.param(np.zeros(12, np.uint16), 4, F16, 2, id="out too small"),
        pytest.param(np.zeros(12, np.uint32), 1, F32, 0, id="out empty"),
        pytest.param(np.zeros(8, np.uint32), 4, (11, 52), 2, id="float64 layout"),
        pytest.param(np.zeros(8, np.uint16), 4, (5, 11), 2, id="16 bits of fields"),
        pytest.param(np.zeros(8, np.uint16), 4, (0, 15), 2, id="no exponent"),
        pytest.param(np.zeros(8, np.uint16), 4, (15, 0), 2, id="no fraction"),
        pytest.param(np.zeros(8, np.uint16), 4, (16, -1), 2, id="negative fraction bits"),
        pytest.param(np.zeros(8, np.uint16), 4, (-1, 16), 2, id="negative exponent bits"),
        pytest.param(np.zeros(8, np.uint32), 4, (8, 24), 2, id="float32 with 24 fraction bits"),
        pytest.param(np.zeros(8, np.uint32), 4, (7, 23), 2, id="float32 with 7 exponent bits"),
    ],
)
def test_floats_rejects_wrong_sizes_and_layouts(data, columns, layout, rows):
    with pytest.raises(ValueError):
        _health.floats(data, columns, *layout, np.zeros(rows, np.uint64), 1)
    _still_works()


def test_floats_accepts_the_limits():
    """Exactly 2^22 elements, and an empty slab (no finite element: low and high are -1)."""
    out = np.zeros(1, dtype=np.uint64)
    zeros, nan, inf, low, high, *sums, rows = _health.floats(np.zeros(1 << 22, np.uint16), 1 << 22, *F16, out, 1)
    assert (zeros, nan, inf, low, high) == (1 << 22, 0, 0, 0, 0)
    assert [int.from_bytes(total, "little") for total in sums] == [0, 0, 0]
    assert _health.floats(np.zeros(0, np.uint32), 5, *F32, np.zeros(0, np.uint64), 1)[:5] == (0, 0, 0, -1, -1)


@pytest.mark.parametrize(
    "read_only, error",
    [
        pytest.param(lambda a: a.setflags(write=False) or a, ValueError, id="numpy read-only"),
        pytest.param(lambda a: a.tobytes(), BufferError, id="bytes"),
        pytest.param(lambda a: memoryview(a).toreadonly(), BufferError, id="read-only memoryview"),
    ],
)
def test_floats_refuses_read_only_buffers(read_only, error):
    """numpy refuses a writable buffer of a read-only array with ValueError; bytes and memoryview with BufferError."""
    data = np.array([[0x3C00, 0x4000]], dtype=np.uint16)  # float16 1, 2
    with pytest.raises(error):
        _health.floats(data, 2, *F16, read_only(np.zeros(1, np.uint64)), 1)
    _still_works()


def test_floats_refuses_non_contiguous_and_non_buffers():
    data = np.zeros((4, 6), np.uint16)[:, ::2]
    with pytest.raises(ValueError):  # numpy: "ndarray is not C-contiguous"
        _health.floats(data, 3, *F16, np.zeros(4, np.uint64), 1)
    with pytest.raises(TypeError):
        _health.floats([1, 2, 3], 3, *F16, np.zeros(1, np.uint64), 1)
    with pytest.raises(TypeError):
        _health.floats(np.zeros(3, np.uint16), 3, *F16, None, 1)
    _still_works()


@pytest.mark.parametrize("layout", [(12, 3), (14, 1), (9, 6)])
def test_floats_rejects_exponents_wider_than_its_sums(layout):
    """Its sums per exponent hold 256 exponents: a 2-byte layout of 9 or more exponent bits is refused."""
    data = np.array([[0x7FF0, 0x3000, 0x0001]], dtype=np.uint16)
    with pytest.raises(ValueError):
        _health.floats(data, 3, *layout, np.zeros(1, np.uint64), 1)
