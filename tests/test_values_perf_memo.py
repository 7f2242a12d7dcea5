"""Answers remembered per archive layout and ``data.pkl`` (issue #16 §2): ``diff --values``' bit views
(values.read.chunk_bits) and ``check --deep``'s clean decodes (rules.deep_decode) give a later archive what the
full path gives it, and never the answer of an archive whose pickle, byteorder or metadata differ."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckptdoctor.checkpoint import Entry
from ckptdoctor.formats.torch_dist import DcpChunk, StorageLocation

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")


def _saved(tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


@pytest.fixture(autouse=True)
def _fresh_memos(monkeypatch):
    from ckptdoctor import numpy_lazy
    from ckptdoctor.values import archive_memo, read

    monkeypatch.setattr(archive_memo, "_LAYOUTS", {})
    monkeypatch.setattr(archive_memo, "_COUNT", [0])
    monkeypatch.setattr(read, "_PLAIN", {})
    monkeypatch.setattr(numpy_lazy, "_NUMPY", [])


def _chunk(blob: bytes, sizes: tuple[int, ...]) -> DcpChunk:
    return DcpChunk((0,) * len(sizes), sizes, StorageLocation("__0_0.distcp", 0, len(blob)))


def _entry(sizes: tuple[int, ...], dtype: str = "torch.float32", key: str = "decoder.w") -> Entry:
    return Entry(key, "tensor", dtype, sizes, [])


CKPT = SimpleNamespace(location=SimpleNamespace(backend="torch_dist"), iteration_dir=Path("/ckpt"))


def _bits(blob: bytes, sizes: tuple[int, ...], dtype: str = "torch.float32"):
    from ckptdoctor.values.read import chunk_bits

    return chunk_bits(CKPT, _entry(sizes, dtype), _chunk(blob, sizes), blob)  # type: ignore[arg-type]


def test_plain_pickle_is_the_parsed_pickle_and_checks_byteorder_every_time():
    from ckptdoctor.errors import CkptError
    from ckptdoctor.values import archive_memo

    first, second = _saved(torch.arange(12.0).view(3, 4)), _saved(torch.ones(3, 4))
    assert archive_memo.plain_pickle(first) is None  # nothing remembered yet
    archive_memo.parse(first, "first")  # parsed in full, remembered
    found = archive_memo.plain_pickle(second)
    assert found is not None
    assert found[1] == bytes(archive_memo.parse(second, "second").pickle(verify_crc=False))
    order = archive_memo.parse(second, "second").members
    record = next(m for name, m in order.items() if name.endswith("/byteorder"))
    big = bytearray(second)
    big[record.start : record.start + record.compressed_size] = b"big\0\0\0"
    assert archive_memo.lookup(bytes(big)) is not None  # the directory matches: the data does not
    assert archive_memo.plain_pickle(bytes(big)) is None
    with pytest.raises(CkptError, match="little-endian"):
        archive_memo.parse(bytes(big), "big")


def test_chunk_bits_remembered_answers_follow_pickle_and_metadata():
    from ckptdoctor.values import read

    values = torch.arange(12.0)
    first, second = _saved(values.view(3, 4)), _saved((values + 100).view(3, 4))
    transposed = _saved((values + 200).view(4, 3))
    assert len({len(first), len(second), len(transposed)}) == 1  # one directory layout for all three

    assert np.array_equal(_bits(first, (3, 4)), values.view(3, 4).view(torch.int32).numpy())
    assert not read._PLAIN  # the first archive of a layout: parsed in full, nothing remembered yet
    assert np.array_equal(_bits(second, (3, 4)), (values + 100).view(3, 4).view(torch.int32).numpy())
    assert len(read._PLAIN) == 1
    again = _bits(second, (3, 4))  # from the memo: a view of this archive's own bytes
    assert np.array_equal(again, (values + 100).view(3, 4).view(torch.int32).numpy())
    assert again.base is not None and not again.flags.writeable

    # Same layout, another data.pkl (shape 4x3): its own answer, never the 3x4 one.
    assert np.array_equal(_bits(transposed, (4, 3)), (values + 200).view(4, 3).view(torch.int32).numpy())
    assert _bits(transposed, (3, 4)) is None  # stored shape differs from the metadata: the torch path reports it
    assert _bits(second, (4, 3)) is None
    assert _bits(second, (3, 4), "torch.int32") is None  # stored dtype differs
    assert _bits(second, (3, 4)) is not None
    assert len(read._PLAIN) == 5


def _check(blob: bytes, sizes: tuple[int, ...], decoder, scan):
    from ckptdoctor.rules.deep_decode import _check_chunk

    entry = _entry(sizes)
    return _check_chunk(decoder, entry, _chunk(blob, sizes), memoryview(blob), Path("/ckpt/__0_0.distcp"), scan)


def test_check_deep_remembered_clean_decode_counts_and_reports_like_the_full_path():
    from ckptdoctor.rules.deep_decode import _ChunkDecoder
    from ckptdoctor.rules.non_finite import NonFinite

    decoder, scan = _ChunkDecoder(), NonFinite()
    clean = torch.arange(12.0).view(3, 4)
    assert _check(_saved(clean), (3, 4), decoder, scan) is None  # full parse, layout remembered
    assert _check(_saved(clean + 1), (3, 4), decoder, scan) is None  # full path again: remembers the clean decode
    assert len(decoder.clean) == 1
    poisoned = clean.clone()
    poisoned[1, 2] = float("nan")
    poisoned[2, 3] = float("-inf")
    assert _check(_saved(poisoned), (3, 4), decoder, scan) is None  # from the memo: its own bytes scanned
    assert scan.per_key["decoder.w"] == [1, 1, 1, 3]

    # Same layout, metadata that disagrees: the full path's finding, not the remembered verdict.
    wrong = _check(_saved(clean), (4, 3), decoder, scan)
    assert wrong is not None and wrong.code == "CKD310" and "stored shape [3, 4] differs" in wrong.message
    # A damaged record size in data.pkl's storage (numel 12 -> 13): other pickle bytes, checked in full.
    blob = bytearray(_saved(clean))
    at = blob.find(b"K\x0c", 0, 200)  # BININT1 12: the storage's numel in data.pkl
    assert at > 0
    blob[at + 1] = 13
    damaged = _check(bytes(blob), (3, 4), decoder, scan)
    assert damaged is not None and damaged.code in ("CKD310", "CKD311")
