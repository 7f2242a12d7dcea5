"""The fast paths of ``check --deep``: CKD313's NaN/Inf count (numpy max-reductions, and the pure-Python scan
without numpy) against a definition of NaN/Inf by bit pattern, and archive directories validated from a
remembered layout (values.archive_memo.parse) against the full parse."""

from __future__ import annotations

import struct

import pytest

from ckptdoctor import numpy_lazy
from ckptdoctor.rules import non_finite

# dtype: (itemsize, exponent bits, mantissa bits)
FORMATS = {
    "torch.bfloat16": (2, 8, 7),
    "torch.float16": (2, 5, 10),
    "torch.float32": (4, 8, 23),
    "torch.float64": (8, 11, 52),
}


def _reference(raw: bytes, dtype: str) -> tuple[int, int]:
    """(NaN, Inf) by definition: exponent all ones, mantissa zero (Inf) or not (NaN)."""
    size, exponent, mantissa = FORMATS[dtype]
    nan = inf = 0
    for i in range(len(raw) // size):
        bits = int.from_bytes(raw[i * size : (i + 1) * size], "little")
        if (bits >> mantissa) & ((1 << exponent) - 1) == (1 << exponent) - 1:
            if bits & ((1 << mantissa) - 1):
                nan += 1
            else:
                inf += 1
    return nan, inf


def _edge_patterns(dtype: str) -> list[int]:
    """Bit patterns around the finite/non-finite border, both signs: zero, subnormals, the largest finite,
    Inf, the smallest and largest NaN payloads (quiet and signalling)."""
    size, exponent, mantissa = FORMATS[dtype]
    top = ((1 << exponent) - 1) << mantissa  # +Inf
    magnitudes = [0, 1, (1 << mantissa) - 1, 1 << mantissa, top - 1, top, top + 1, top | (1 << (mantissa - 1))]
    magnitudes += [top | ((1 << mantissa) - 1), (top >> 1) | 1]
    sign = 1 << (size * 8 - 1)
    return [m | s for m in magnitudes for s in (0, sign)]


@pytest.fixture(params=["numpy", "python"])
def scan_path(request, monkeypatch):
    if request.param == "numpy":
        pytest.importorskip("numpy")
        monkeypatch.setattr(numpy_lazy, "_NUMPY", [])
    else:
        monkeypatch.setattr(numpy_lazy, "_NUMPY", [None])
    return request.param


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_every_16_bit_pattern_is_classified(scan_path, dtype):
    raw = b"".join(i.to_bytes(2, "little") for i in range(1 << 16))
    expected = _reference(raw, dtype)
    assert expected[1] == 2  # +Inf and -Inf
    assert non_finite.count_non_finite(raw, dtype) == expected


@pytest.mark.parametrize("dtype", sorted(FORMATS))
def test_edge_patterns_anywhere(scan_path, dtype):
    size = FORMATS[dtype][0]
    finite = (1).to_bytes(size, "little") * 1000  # the smallest subnormal, everywhere
    assert non_finite.count_non_finite(finite, dtype) == (0, 0)
    assert non_finite.count_non_finite(b"\0" * size * 7, dtype) == (0, 0)
    negative_zero = (1 << (size * 8 - 1)).to_bytes(size, "little") * 9
    assert non_finite.count_non_finite(negative_zero, dtype) == (0, 0)
    for pattern in _edge_patterns(dtype):
        element = pattern.to_bytes(size, "little")
        for raw in (element, finite + element, element + finite, finite[: size * 500] + element + finite):
            assert non_finite.count_non_finite(raw, dtype) == _reference(raw, dtype), (hex(pattern), len(raw))


@pytest.mark.parametrize("dtype", sorted(FORMATS))
def test_unaligned_views_and_ragged_lengths(scan_path, dtype):
    size = FORMATS[dtype][0]
    patterns = _edge_patterns(dtype)
    raw = b"".join(p.to_bytes(size, "little") for p in patterns * 3)
    expected = _reference(raw, dtype)
    held = bytearray(b"\xff" + raw + b"\x7f" * (size - 1))  # odd start, a partial element at the end
    view = memoryview(held)[1:]
    assert non_finite.count_non_finite(view, dtype) == expected
    assert non_finite.count_non_finite(raw + b"\xff", dtype) == expected
    assert non_finite.count_non_finite(b"", dtype) == (0, 0)
    assert non_finite.count_non_finite(raw, "torch.int32") is None


def test_float32_values_through_struct(scan_path):
    nan, inf = float("nan"), float("inf")
    raw = struct.pack("<8f", 1.0, -0.0, 3.4e38, -1e-45, nan, inf, -inf, -nan)
    assert non_finite.count_non_finite(raw, "torch.float32") == (2, 2)
    raw = struct.pack("<4000f", *([0.5] * 3999 + [nan]))  # the last element only
    assert non_finite.count_non_finite(raw, "torch.float32") == (1, 0)
    raw = struct.pack("<4000d", *([1e308] * 3999 + [-inf]))
    assert non_finite.count_non_finite(raw, "torch.float64") == (0, 1)


# --- archive directories from a remembered layout (check --deep, diff --values) ------------------------------


def _saved(tensor) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def test_remembered_layout_validates_like_the_full_parse(monkeypatch):
    torch = pytest.importorskip("torch")
    from ckptdoctor.errors import CkptError
    from ckptdoctor.formats.archive import CorruptRecord, parse_archive
    from ckptdoctor.values import archive_memo

    monkeypatch.setattr(archive_memo, "_LAYOUTS", {})
    monkeypatch.setattr(archive_memo, "_COUNT", [0])
    first, second = _saved(torch.arange(12.0).view(3, 4)), _saved(torch.ones(3, 4))
    assert len(first) == len(second) and first != second
    full = parse_archive(first, "first")
    assert archive_memo.parse(first, "first").members == full.members  # parsed in full, remembered
    assert archive_memo.lookup(second) is not None  # parsed from the layout, not in full
    again = archive_memo.parse(second, "second")
    reference = parse_archive(second, "second")
    assert {n: (m.start, m.size, m.method) for n, m in again.members.items()} == {
        n: (m.start, m.size, m.method) for n, m in reference.members.items()
    }
    assert bytes(again.pickle(verify_crc=False)) == bytes(reference.pickle())
    record = again.storage("0")
    # its own CRC-32 checked (read where the first archive's lies): the two archives' differ
    assert bytes(again.read(record.name, 1 << 20)) == struct.pack("<12f", *[1.0] * 12)
    assert again.stored_crc(record) != full.stored_crc(full.storage("0"))
    damaged = bytearray(second)
    damaged[record.start] ^= 1
    with pytest.raises(CorruptRecord, match="fails its CRC-32"):
        archive_memo.parse(bytes(damaged), "damaged").read(record.name, 1 << 20)
    refiled = bytearray(second)  # the CRC-32 field changed, not the bytes: as corrupt (the two no longer agree)
    refiled[record.crc_at] ^= 1
    with pytest.raises(CorruptRecord, match="fails its CRC-32"):
        archive_memo.parse(bytes(refiled), "refiled").read(record.name, 1 << 20)
    # A local header of a member no reader reads (here "version") differs: not this layout, the full parse.
    layout = archive_memo.lookup(second)
    assert layout is not None
    version = next(offset for offset, header in layout.headers if b"/version" in header)
    moved = bytearray(second)
    moved[version + 28] ^= 1  # its extra-field length: the member's bytes start elsewhere
    assert archive_memo.lookup(bytes(moved)) is None
    assert archive_memo.parse(bytes(moved), "moved").members == parse_archive(bytes(moved), "moved").members
    broken = bytearray(second)
    broken[version : version + 4] = b"PK\x09\x09"  # its signature: the full parse refuses the archive
    assert archive_memo.lookup(bytes(broken)) is None
    for parse in (archive_memo.parse, parse_archive):
        with pytest.raises(CkptError, match="bad local header"):
            parse(bytes(broken), "broken")


# --- diff --values across layouts: bit patterns with numpy, torch only where values differ -------------------


def _values_json(capsys, *args: str) -> str:
    import re

    from ckptdoctor.cli import main

    rc = main(["diff", "--values", "--format", "json", "--jobs", "1", *args])
    out = capsys.readouterr().out
    return f"{rc}\n" + re.sub(r'"(seconds|peak_in_flight)": [0-9.e-]+', r'"\1": <t>', out)


@pytest.mark.parametrize("pair", [("core019_convert_src_tp1", "core019_convert_tp4"), ("core019_tp1", "core019_tp2")])
@pytest.mark.parametrize("extra", [(), ("--atol", "1e-3", "--report", "2")])
def test_diff_values_same_with_and_without_numpy(capsys, monkeypatch, pair, extra):
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    from conftest import FIXTURES

    paths = [str(FIXTURES / name) for name in pair]
    monkeypatch.setattr(numpy_lazy, "_NUMPY", [])
    with_numpy = _values_json(capsys, *extra, *paths)
    monkeypatch.setattr(numpy_lazy, "_NUMPY", [None])
    assert _values_json(capsys, *extra, *paths) == with_numpy


def test_equal_values_across_layouts_need_no_torch():
    pytest.importorskip("numpy")
    from conftest import FIXTURES, run_cli

    pair = [str(FIXTURES / "core019_convert_src_tp1"), str(FIXTURES / "core019_convert_tp4")]
    result = run_cli("diff", "--values", "--jobs", "1", "--format", "json", *pair, block=("torch",))
    assert result.returncode == 1, result.stderr  # the layouts differ (structure); the values do not
    assert result.stderr.strip().endswith("IMPORTED:")  # torch never imported: every key compared as bits
    import json

    values = json.loads(result.stdout)["values"]
    assert values["compared"] == values["equal"] == 13 and values["different"] == 0
