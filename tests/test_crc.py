"""The CRC-32 of every record: the C fold against zlib, and ``check --deep``'s CKD314 on copies of real fixtures
with one bit flipped (a value torch.load loads without a word)."""

from __future__ import annotations

import io
import json
import os
import random
import zlib
from pathlib import Path

import pytest
from conftest import FIXTURES

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.cli import main
from ckptdoctor.formats import crc
from ckptdoctor.formats.archive import parse_archive

LENGTHS = [*range(0, 300), 511, 512, 513, 1023, 1024, 1025, 4096 + 15, 65535, 65536, 65537, (1 << 20) + 3]


@pytest.mark.skipif(crc.native_crc32 is None, reason="the C extension was not built")
@pytest.mark.parametrize("widest", [0, 1, 2], ids=["table", "128-bit fold", "512-bit fold"])
def test_every_fold_gives_zlibs_crc(widest):
    """Each path of _crc32.c (those this processor runs; a wider one asked for runs the widest it has) equals
    zlib.crc32 at every length around its block sizes, any alignment and any running value."""
    native = crc.native_crc32
    rng = random.Random(widest)
    pool = os.urandom(max(LENGTHS) + 64)
    for length in LENGTHS:
        for shift in (0, 1, 7):
            data = memoryview(pool)[shift : shift + length]
            value = rng.getrandbits(32)
            assert native(data, 0, widest) == zlib.crc32(data), (length, shift)
            assert native(data, value, widest) == zlib.crc32(data, value), (length, shift, value)
    assert native(b"\xff" * 4096, 0, widest) == zlib.crc32(b"\xff" * 4096)


def test_the_crc_in_use_is_zlibs():
    data = os.urandom(100_003)
    assert crc.crc32(data, 0) == zlib.crc32(data) and crc.crc32(data, 12345) == zlib.crc32(data, 12345)
    assert crc.implementation() in ("zlib", "C, 128-bit folds", "C, 512-bit folds")


def _record(path: Path, chunk) -> tuple[int, object]:
    """(offset in the data file, member) of the storage record of ``chunk``."""
    location = chunk.storage
    blob = path.read_bytes()[location.offset : location.offset + location.length]
    member = next(m for name, m in parse_archive(blob, "chunk").members.items() if "/data/" in name)
    return location.offset, member


def _flip(path: Path, at: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1 << bit
    path.write_bytes(bytes(data))


def _check(*args: str, capsys) -> tuple[int, list[dict]]:
    rc = main(["check", "--isolated", "--format", "json", *args])
    report = json.loads(capsys.readouterr().out)
    return rc, report["findings"]


KEY = "decoder.layers.mlp.linear_fc1.weight"


@pytest.mark.parametrize("index", [0, 3], ids=["first chunk (full parse)", "later chunk (remembered layout)"])
@pytest.mark.parametrize("mode", ["--deep", "--health"])
def test_a_flipped_bit_in_a_tensor_is_ckd314_and_torch_loads_it(copy_fixture, capsys, index, mode):
    """One low mantissa bit of one float32 of a real megatron-core chunk: no NaN, no shape change; torch.load
    loads the changed value. check --deep / --health report exactly CKD314 naming the key, the chunk and the
    record, at --jobs 1 and 2 alike; the first chunk of a layout goes through the full parse, the later ones
    through the remembered layout (each reads its own CRC-32)."""
    if mode == "--health":
        pytest.importorskip("numpy")
    save = copy_fixture("core019_tp2")
    ckpt = open_checkpoint(save)
    chunk = ckpt.entries[KEY].chunks[index]
    path = ckpt.iteration_dir / chunk.storage.relative_path
    offset, record = _record(path, chunk)
    _flip(path, offset + record.start + 4 * 5)  # element 5, lowest bit
    for jobs in ("1", "2"):
        rc, findings = _check(mode, "--jobs", jobs, str(save), capsys=capsys)
        assert rc == 1 and [f["code"] for f in findings] == ["CKD314"], findings
        message = findings[0]["message"]
        assert message.startswith(f"{KEY} chunk at {list(chunk.offsets)}: record {record.name} fails its CRC-32")
    torch = pytest.importorskip("torch")
    span = slice(chunk.storage.offset, chunk.storage.offset + chunk.storage.length)
    loaded = torch.load(io.BytesIO(path.read_bytes()[span]), weights_only=True)  # no CRC-32 check: a value
    saved = torch.load(io.BytesIO((FIXTURES / "core019_tp2" / path.relative_to(save)).read_bytes()[span]))
    changed = (loaded != saved).flatten().nonzero().flatten().tolist()
    assert changed == [5] and torch.isfinite(loaded).all()


def test_a_changed_crc_field_is_ckd314(copy_fixture, capsys):
    """The record's bytes as saved, its CRC-32 in the central directory changed: the two disagree, CKD314 (the
    archive is not what was saved either way)."""
    save = copy_fixture("core019_tp1")
    ckpt = open_checkpoint(save)
    chunk = ckpt.entries[KEY].chunks[2]
    path = ckpt.iteration_dir / chunk.storage.relative_path
    offset, record = _record(path, chunk)
    _flip(path, offset + record.crc_at, 3)
    rc, findings = _check("--deep", str(save), capsys=capsys)
    assert rc == 1 and [f["code"] for f in findings] == ["CKD314"], findings


def test_a_flipped_bit_in_a_bytes_item_is_ckd314(copy_fixture, capsys):
    """A bytes item (the RNG state, a ShardedObject whose archive holds tensors): a flipped bit in its storage
    record is CKD314 too, not "undecodable"."""
    save = copy_fixture("core019_tp1")
    ckpt = open_checkpoint(save)
    entry = next(e for e in ckpt.entries.values() if e.kind != "tensor" and e.key.startswith("rng_state"))
    location = entry.chunks[0].storage
    path = ckpt.iteration_dir / location.relative_path
    blob = path.read_bytes()[location.offset : location.offset + location.length]
    member = next(m for name, m in parse_archive(blob, "item").members.items() if "/data/" in name and m.size > 8)
    _flip(path, location.offset + member.start + member.size // 2, 6)
    rc, findings = _check("--deep", str(save), capsys=capsys)
    assert rc == 1 and [f["code"] for f in findings] == ["CKD314"], findings
    assert findings[0]["message"].startswith(f"item {entry.key}: ") and "fails its CRC-32" in findings[0]["message"]


def test_the_real_fixtures_pass_every_crc(capsys):
    """No record of a real save fails its CRC-32 (the fixtures are checked with --deep elsewhere; here the
    claim that they hold their saved bytes, the zarr and plain-DCP ones included, is the test)."""
    names = [p for p in sorted(FIXTURES.iterdir()) if (p / "latest_checkpointed_iteration.txt").is_file()]
    assert len(names) > 30
    rc = main(["check", "--isolated", "--deep", "--select", "CKD314", "--format", "json", *map(str, names)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["findings"] == [] and len(report["checked"]) >= len(names), report["skipped"]


def test_a_compressed_member_is_checked_within_the_inflation_bound():
    """Checking every member's CRC-32 must not inflate a deflate bomb (200 MB from 200 KB here): a member over the
    bound of a compressed record is a PickleLimitError (CKD403 in check --deep), raised before any inflating."""
    import zipfile

    from ckptdoctor.errors import PickleLimitError

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02N.")
        archive.writestr(zipfile.ZipInfo("archive/bomb"), bytes(200 << 20), compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(PickleLimitError, match="over the limit"):
        parse_archive(buf.getvalue(), "bomb").members_crc_problem()
