"""Hostile inputs found by a code-review-driven audit (round 2): classes of attack that random mutation is unlikely
to hit. Each runs the real CLI in a child process (address-space limit, timeout) and expects a check finding or
one clean error line naming the file, never an internal error; the archive cases are parse differentials, where
torch's reader (miniz) would load other members than the ones ckptdoctor checked."""

from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
from conftest import FIXTURES, run_ckptdoctor
from test_hostile_inputs import MEMORY_LIMIT, assert_one_line_error, check_json, codes, run_limited

from ckptdoctor.formats.torch_dist import (
    StorageLocation,
    dump_metadata_object,
    index_fqn,
    load_metadata_object,
    set_storage,
    storage_items,
)

ITER = "iter_0000010"
KEY = "decoder.final_layernorm.weight"


def _edit_metadata(save: Path, edit) -> None:
    path = save / ITER / ".metadata"
    metadata = load_metadata_object(path)
    edit(metadata)
    path.write_bytes(dump_metadata_object(metadata))


# --- .metadata: storage ranges and chunk grids -----------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("length", float("inf")), ("offset", 2**70), ("length", -1), ("offset", -100)],
    ids=["length inf", "offset 2**70", "length -1", "offset -100"],
)
def test_a_storage_range_that_is_no_int64_is_refused_by_the_reader(copy_fixture, field, value):
    """A float length was an OverflowError (internal error) in every command, an offset past int64 one in show and
    diff --values, and a length of -1 read the rest of the data file into memory (GBs on a real checkpoint)."""
    save = copy_fixture("core019_tp1")
    data_file = save / ITER / "__0_0.distcp"
    with open(data_file, "r+b") as f:
        f.truncate(3 << 30)  # sparse: what a read to the end of a real data file would cost

    def edit(metadata) -> None:
        for index, info in storage_items(metadata).items():
            if index_fqn(index) == KEY:
                info.__dict__[field] = value

    _edit_metadata(save, edit)
    assert "CKD111" in codes(check_json(save)[1])
    for args in (["inspect", save], ["show", save, KEY], ["diff", "--values", save, FIXTURES / "core019_tp1"]):
        assert_one_line_error(run_limited(*args), "storage offset and length")


@pytest.mark.parametrize("shape", [(0,), (64,), (2**40,)], ids=["chunk outside", "gap", "huge gap"])
def test_show_slice_refuses_chunks_that_do_not_tile_the_shape(copy_fixture, shape):
    """show --slice assembled the tensor in torch.empty(shape): a chunk outside the shape was a RuntimeError, a gap
    printed whatever the allocator left there as values, a huge shape was an allocation failure."""
    save = copy_fixture("core019_tp1")

    def edit(metadata) -> None:
        item = metadata.state_dict_metadata[KEY]
        item.__dict__["size"] = type(item.size)(shape)

    _edit_metadata(save, edit)
    assert "CKD220" in codes(check_json(save)[1])
    for extra in (["--slice", "30:40"], ["--save", save.parent / "out.pt"]):
        proc = run_limited("show", save, KEY, *extra)
        assert_one_line_error(proc, ".metadata")
        assert "slice" not in proc.stdout
    assert not (save.parent / "out.pt").exists()


@pytest.mark.parametrize("dtype", [5, "torch.float32", "torch.\x1b[2Jfloat32"], ids=["int", "str", "escape"])
def test_a_dtype_that_is_no_torch_dtype_is_refused_by_the_reader(copy_fixture, dtype):
    """A dtype of another type became a name that check --deep, show and diff --values looked up as the global
    torch.<name>: an internal error ("refusing to register the global")."""
    save = copy_fixture("core019_tp1")

    def edit(metadata) -> None:
        properties = metadata.state_dict_metadata[KEY].properties
        state = properties.__dict__["_ckd_state"]
        properties.__dict__["_ckd_state"] = (dtype, *state[1:])

    _edit_metadata(save, edit)
    assert "CKD111" in codes(check_json(save, deep=True)[1])
    for args in (["show", save, KEY], ["diff", "--values", save, FIXTURES / "core019_tp1"]):
        assert_one_line_error(run_limited(*args), "is not a torch dtype")


def _storage_bomb(numel: int) -> bytes:
    """A torch.save archive of a one-element view of a ``numel``-element float32 storage of zeros, deflated."""
    from ckptdoctor.formats.torch_zip import dump_torch_zip
    from ckptdoctor.pickle.torch_stand_ins import DtypeRef, StorageRef, TensorRef

    storage = StorageRef("0", DtypeRef.get("float32"), "cpu", numel)
    storage.set_data(bytes(4 * numel))
    stored = zipfile.ZipFile(io.BytesIO(dump_torch_zip(TensorRef(storage, 0, (1,), (1,)))))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for info in stored.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            archive.writestr(info.filename, stored.read(info), compress_type=method)
    return buf.getvalue()


def test_many_chunks_naming_one_deflate_bomb_are_bounded_in_all(copy_fixture):
    """Each compressed record inflates to at most 64 MiB; 300 chunk entries naming one 64 KB bomb inflated 19 GB
    (minutes of check --deep and show --stats from a 100 KB input)."""
    import copy

    save = copy_fixture("core019_tp1")
    blob = _storage_bomb(16 << 20)
    data_file = save / ITER / "__0_0.distcp"
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)
    count = 300

    def edit(metadata) -> None:
        item = metadata.state_dict_metadata[KEY]
        storage = storage_items(metadata)
        index, info = next((i, v) for i, v in storage.items() if index_fqn(i) == KEY)
        del storage[index]
        set_storage(info, StorageLocation(info.relative_path, offset, len(blob)))
        item.__dict__["size"] = type(item.size)((count,))
        chunks = []
        for i in range(count):
            chunk, entry = copy.copy(item.chunks[0]), copy.copy(index)
            chunk.__dict__ = {
                **item.chunks[0].__dict__,
                "offsets": type(item.size)((i,)),
                "sizes": type(item.size)((1,)),
            }
            entry.__dict__ = {**index.__dict__, "offset": type(item.size)((i,))}
            chunks.append(chunk)
            storage[entry] = info
        item.__dict__["chunks"] = chunks

    _edit_metadata(save, edit)
    proc = run_ckptdoctor("check", "--deep", "--format", "json", save, timeout=60, memory_headroom=MEMORY_LIMIT)
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr
    assert "CKD403" in {f["code"] for f in json.loads(proc.stdout)["findings"]}
    proc = run_ckptdoctor("show", "--stats", save, KEY, timeout=60, memory_headroom=MEMORY_LIMIT)
    assert_one_line_error(proc, "compressed records inflating to over")


@pytest.mark.parametrize("change", [{"order": "F"}, {"filters": [{"id": "delta", "dtype": "<f4"}]}], ids=repr)
def test_a_zarr_array_whose_chunks_zarr_would_transpose_or_filter_is_invalid_metadata(copy_fixture, change):
    """Chunks are read as raw C-order values; with order F or a filter, zarr (and Megatron's load) would read
    other values than show and diff --values did, silently."""
    save = copy_fixture("core014_zarr_tp2")
    zarray = save / ITER / KEY / ".zarray"
    zarray.write_text(json.dumps({**json.loads(zarray.read_text()), **change}))
    assert "CKD111" in codes(check_json(save)[1])
    assert_one_line_error(run_limited("diff", "--values", save, FIXTURES / "core014_zarr_tp2"), ".zarray")


def _rewrite_chunk(save: Path, change) -> None:
    """Rewrite the archive of KEY's chunk, each member's bytes through ``change(name, data)``, appended to the
    data file (the .metadata pointed at it)."""
    info = next(
        v for i, v in storage_items(load_metadata_object(save / ITER / ".metadata")).items() if index_fqn(i) == KEY
    )
    with open(save / ITER / info.relative_path, "rb") as f:
        f.seek(info.offset)
        stored = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for member in stored.infolist():
            archive.writestr(member.filename, change(member.filename, stored.read(member)))
    _point_item_at(save, KEY, buf.getvalue())


def test_a_chunk_pickle_of_megabytes_is_refused(copy_fixture):
    """A chunk's data.pkl is ~170 bytes; one padded to 800 KB (a valid tensor pickle after 400,000 no-op
    opcode pairs) cost 0.1-0.4 s to decode, once for each of as many .metadata entries as name it."""
    save = copy_fixture("core019_tp1")
    _rewrite_chunk(save, lambda name, data: data[:2] + b"N0" * 400_000 + data[2:] if name.endswith(".pkl") else data)
    assert "CKD403" in codes(check_json(save, deep=True)[1])
    for args in (["show", "--stats", save, KEY], ["diff", "--values", save, FIXTURES / "core019_tp1"]):
        assert_one_line_error(run_limited(*args), "data.pkl holds 800")


# --- torch.save archives: what torch's reader would load must be what was checked ------------------------


def _local(name: bytes, data: bytes) -> bytes:
    header = struct.pack(
        "<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data), len(name), 0
    )
    return header + name + data


def _central(name: bytes, data: bytes, offset: int) -> bytes:
    crc, size = zlib.crc32(data), len(data)
    return (
        struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset)
        + name
    )


def _end(count: int, cd_size: int, cd_offset: int, comment: bytes = b"") -> bytes:
    return struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, cd_size, cd_offset, len(comment)) + comment


def _zip64_end(count: int, cd_size: int, cd_offset: int) -> bytes:
    return struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)


def _members(tp: int) -> list[tuple[bytes, bytes]]:
    import argparse

    state = {"args": argparse.Namespace(tensor_model_parallel_size=tp), "iteration": 10 * tp}
    return [(b"archive/data.pkl", pickle.dumps(state, protocol=2)), (b"archive/version", b"3\n")]


def _entries(members: list[tuple[bytes, bytes]], at: int) -> tuple[bytes, bytes]:
    """(local headers and data, central directory) of ``members`` stored from offset ``at``."""
    body, directory = b"", b""
    for name, data in members:
        directory += _central(name, data, at + len(body))
        body += _local(name, data)
    return body, directory


def _second_directory(layout: str) -> bytes:
    """An archive with two central directories: the one torch reads lists TP=2 args, the other TP=1 args."""
    theirs, theirs_dir = _entries(_members(2), 0)
    head = theirs + theirs_dir  # members and directory torch (miniz) reads
    if layout == "offset":  # zipfile reads the directory before the end record and shifts the offsets it lists
        ours = _entries(_members(1), 0)[0]
        shift = len(head) + len(ours) - len(theirs)  # where zipfile finds the directory, less where it is declared
        ours_dir = _entries(_members(1), len(head) - shift)[1]
        return head + ours + ours_dir + _end(2, len(ours_dir), len(theirs), b"comment")
    # zip64: the locator names a zip64 end record listing their directory; the plain end record lists ours
    record = len(head)
    head += _zip64_end(2, len(theirs_dir), len(theirs))
    ours, ours_dir = _entries(_members(1), len(head))
    tail = head + ours + ours_dir
    if layout == "zip64 adjacent record":  # what zipfile reads: the record just before the locator
        tail += _zip64_end(2, len(ours_dir), len(head) + len(ours))
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, record, 1)
    return tail + locator + _end(2, len(ours_dir), len(head) + len(ours))


def _case_variant() -> bytes:
    """``archive/DATA.pkl`` beside ``archive/data.pkl``: torch finds members by name ignoring ASCII case."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in _members(1):
            archive.writestr(name.decode(), data)
        archive.writestr("archive/DATA.pkl", _members(2)[0][1])
    return buf.getvalue()


ARCHIVES = {
    "member names differing in case": _case_variant,
    "directory elsewhere than declared": lambda: _second_directory("offset"),
    "zip64 locator naming another record": lambda: _second_directory("zip64"),
    "zip64 locator past the adjacent record": lambda: _second_directory("zip64 adjacent record"),
}


@pytest.mark.parametrize("case", list(ARCHIVES))
def test_an_archive_torch_would_read_differently_is_ckd404(copy_fixture, case):
    save = copy_fixture("core016_tp1")
    blob = ARCHIVES[case]()
    (save / ITER / "common.pt").write_bytes(blob)
    try:  # where torch is here, show that it loads the other args (not needed for the test itself)
        import torch

        assert torch.load(io.BytesIO(blob), weights_only=False)["iteration"] == 20, case
    except ImportError:
        pass
    assert "CKD404" in codes(check_json(save)[1])
    assert_one_line_error(run_limited("inspect", save), "common.pt")


def test_a_big_endian_archive_is_ckd404(copy_fixture):
    """torch.load byte-swaps every storage of an archive whose byteorder record says "big": show, diff --values
    and check --deep's NaN/Inf scan saw other values than a real load (finite bits that load as NaN)."""
    save = copy_fixture("core019_tp1")
    _rewrite_chunk(save, lambda name, data: b"big" if name.endswith("/byteorder") else data)
    assert "CKD404" in codes(check_json(save, deep=True)[1])
    for args in (["show", "--stats", save, KEY], ["diff", "--values", save, FIXTURES / "core019_tp1"]):
        assert_one_line_error(run_limited(*args), "byteorder is not little-endian")


def test_torch_saved_archives_keep_the_lean_directory_reader():
    """torch.save writes a zip64 end record and locator into every archive: agreeing with the plain end record,
    they keep the fast path (whose layouts archive_memo remembers)."""
    from ckptdoctor.formats.archive import parse_archive

    blob = (FIXTURES / "core016_tp1" / ITER / "common.pt").read_bytes()
    assert b"PK\x06\x07" in blob
    assert not parse_archive(blob, "common.pt").general


def _zip64_record_before_directory(cd_offset_in_record: int | None) -> bytes:
    """An archive whose zip64 end record lies between the members and the directory (torch.save writes it after
    the directory), naming the directory (None) or another offset."""
    body, directory = _entries(_members(1), 0)
    record_at = len(body)
    cd_offset = record_at + _ZIP64_RECORD_SIZE
    named = cd_offset if cd_offset_in_record is None else cd_offset_in_record
    body += _zip64_end(2, len(directory), named)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, record_at, 1)
    return body + directory + locator + _end(2, len(directory), cd_offset)


_ZIP64_RECORD_SIZE = 56


def test_a_remembered_archive_layout_never_skips_the_zip64_record_check():
    """check --deep and diff --values reuse the layout of an archive like one parsed before (archive_memo): a zip64
    end record outside the bytes that match compares could name another directory unseen."""
    from ckptdoctor.formats.archive import ArchiveError
    from ckptdoctor.values import archive_memo

    honest, hostile = _zip64_record_before_directory(None), _zip64_record_before_directory(0)
    assert len(honest) == len(hostile)
    archive_memo.parse(honest, "honest")
    with pytest.raises(ArchiveError, match="zip64 end record"):
        archive_memo.parse(hostile, "hostile")


# --- write commands: a bytes item that is no zip archive --------------------------------------------------


def _point_item_at(save: Path, key: str, blob: bytes) -> None:
    """Append ``blob`` to the data file and point the item ``key`` at it."""
    data_file = save / ITER / "__0_0.distcp"
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)

    def edit(metadata) -> None:
        for index, info in storage_items(metadata).items():
            if index_fqn(index) == key:
                set_storage(info, StorageLocation(info.relative_path, offset, len(blob)))

    _edit_metadata(save, edit)


def _tar_of(data: bytes) -> bytes:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("storages", "tensors", "pickle"):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("layout", ["raw pickle", "legacy tar"])
def test_write_commands_refuse_to_carry_a_bytes_item_that_is_no_zip_archive(copy_fixture, tmp_path, layout):
    """Torch's DCP loads bytes items with torch.load(weights_only=False), which reads anything but a zip as a
    legacy-format save: pickle.load from the first byte runs os.system before it finds no magic number. The
    write gate passed such an item as merely damaged, and the write carried it to the next loader."""
    marker = tmp_path / "marker"
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    blob = payload if layout == "raw pickle" else _tar_of(payload)
    save = copy_fixture("core019_tp1")
    key = "rng_state/shard_0.0_1.1"
    _point_item_at(save, key, blob)
    for command in (
        ["fix-args", save, "--output", tmp_path / "fa", "--set", "seed=3"],
        ["edit", save, "--rename", "final", "FINAL", "-o", tmp_path / "ed"],
        ["edit", save, "--remove", "^optimizer", "--compact", "-o", tmp_path / "edc"],
        ["strip-frozen", save, "--force", "-o", tmp_path / "sf"],
    ):
        proc = run_limited(*command)
        assert_one_line_error(proc, key)
        assert "torch.save archive" in proc.stderr or "os.system" in proc.stderr or "legacy tar format" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [save.name]
    assert not marker.exists()
    # removing the item is allowed: only what the output keeps is gated
    assert run_limited("edit", save, "--drop-section", "rng", "-o", tmp_path / "ok").returncode == 0


@pytest.mark.parametrize("layout, code", [("zip", "CKD401"), ("raw pickle", "CKD404")])
def test_a_te1_extra_state_bytesio_is_scanned(copy_fixture, tmp_path, layout, code):
    """Megatron saves Transformer Engine 1.x extra state as torch.save([BytesIO]) and TE torch.load()s the
    BytesIO: the list was unwrapped after the BytesIO test, so its pickle was never read (check --deep passed
    one naming os.system, and write commands carried it)."""
    from hostile_corpus import call, torch_zip

    from ckptdoctor.formats.torch_zip import dump_torch_zip

    payload = call("posix", "system", f"touch {tmp_path / 'marker'}")
    key = "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"
    save = copy_fixture("core019_tp1")
    _point_item_at(save, key, dump_torch_zip([io.BytesIO(torch_zip(payload) if layout == "zip" else payload)]))
    assert code in codes(check_json(save, deep=True)[1])
    assert_one_line_error(run_limited("edit", save, "--rename", "final", "FINAL", "-o", tmp_path / "out"), key)
    assert not (tmp_path / "out").exists() and not (tmp_path / "marker").exists()


@pytest.mark.parametrize("layout", ["zip", "raw pickle"])
def test_repair_refuses_to_complete_or_copy_a_checkpoint_with_an_unsafe_bytes_item(copy_fixture, tmp_path, layout):
    """repair wrote metadata.json (making a save Megatron loads) and copied the data files to --output after a
    check that reads bytes items only with --deep: an rng item naming os.system went along."""
    from hostile_corpus import call, torch_zip

    payload = call("posix", "system", f"touch {tmp_path / 'marker'}")
    save = copy_fixture("core019_tp1")
    _point_item_at(save, "rng_state/shard_0.0_1.1", torch_zip(payload) if layout == "zip" else payload)
    (save / ITER / "metadata.json").unlink()
    for command in (["--output", tmp_path / "out"], ["--in-place"]):
        assert_one_line_error(run_limited("repair", save, *command), "rng_state/shard_0.0_1.1")
    assert not (save / ITER / "metadata.json").exists() and not (tmp_path / "out").exists()
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("layout", ["zip", "raw pickle"])
def test_edit_refuses_to_carry_an_unsafe_common_pt(copy_fixture, tmp_path, layout):
    """edit links common.pt unchanged and read it only to change args: a common.pt naming os.system (or a legacy
    save, which torch.load unpickles from its first byte) went to the output as it was."""
    from hostile_corpus import call, torch_zip

    marker = tmp_path / "marker"
    payload = call("posix", "system", f"touch {marker}")
    save = copy_fixture("core016_tp1")
    (save / ITER / "common.pt").write_bytes(torch_zip(payload) if layout == "zip" else payload)
    for command in (["--rename", "final", "FINAL"], ["--drop-section", "rng"], ["--remove", "^optimizer", "--compact"]):
        proc = run_limited("edit", save, *command, "-o", tmp_path / "out")
        assert_one_line_error(proc, "common.pt")
        assert "posix.system" in proc.stderr or "legacy save" in proc.stderr
    assert not (tmp_path / "out").exists() and not marker.exists()


# --- run_config.yaml ---------------------------------------------------------------------------------------


def test_a_run_config_line_of_many_spaces_is_rewritten_in_linear_time(copy_fixture, tmp_path):
    """fix-args keeps run_config.yaml in step with a line regex whose lazy value before optional spaces
    backtracked quadratically: a 200 KB line took an hour."""
    save = copy_fixture("core019_tp1")
    (save / ITER / "run_config.yaml").write_text("seed: 1234\nseed: x" + " " * 200_000 + "y\n")
    proc = run_ckptdoctor(
        "fix-args", save, "--output", tmp_path / "out", "--set", "seed=3", timeout=60,
        memory_headroom=MEMORY_LIMIT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / ITER / "run_config.yaml").read_text().startswith("seed: 3\nseed: x ")


def test_an_empty_run_config_value_gets_its_new_value_on_its_own_line():
    """``lr:`` (a null) took its new value after the newline, onto the next line: ``lr:\\n0.5seed: 1``."""
    from ckptdoctor.ops.fix_args.plan import ArgChange
    from ckptdoctor.ops.fix_args.write import updated_run_config

    text, updated = updated_run_config("lr:\nseed: 1 # keep\r\n", [ArgChange("lr", None, 0.5, "set")])
    assert (text, updated) == ("lr: 0.5\nseed: 1 # keep\r\n", ["lr"])


# --- integrity.json --------------------------------------------------------------------------------------


def test_fix_args_write_refuses_an_integrity_manifest_whose_files_is_no_object(copy_fixture, tmp_path):
    save = copy_fixture("core019_tp1")
    (save / ITER / "integrity.json").write_text('{"files": [1, 2, 3]}')
    proc = run_limited("fix-args", save, "--output", tmp_path / "out", "--set", "seed=3")
    assert_one_line_error(proc, "integrity.json")
    assert not (tmp_path / "out" / ITER).exists()
