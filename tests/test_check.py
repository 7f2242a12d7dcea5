"""``ckptdoctor check`` and ``ckptdoctor rules``: every rule triggered on a checkpoint derived from a real
fixture, and silent on the real fixtures themselves."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import zipfile
from pathlib import Path

import pytest
from conftest import FIXTURES, fixture_names, manifest

from ckptdoctor import arg_rules
from ckptdoctor.cli import main
from ckptdoctor.formats.torch_dist import (
    StorageLocation,
    dump_metadata_object,
    index_fqn,
    load_metadata_object,
    record_attr,
    set_storage,
    storage_items,
)
from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip
from ckptdoctor.parallelism import SavedLayout

NAMES = fixture_names()
ITER = "iter_0000010"
QKV = "decoder.layers.self_attention.linear_qkv"

# 512 random bytes, fixed: random garbage sometimes starts with an opcode we refuse by policy (CKD403)
# rather than damage (CKD111); a fixed draw keeps the test deterministic.
GARBAGE_METADATA = random.Random(1).randbytes(512)


def _check(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["check", "--isolated", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys, *args: str) -> tuple[int, dict]:
    rc, out, _ = _check(capsys, "--format", "json", *args)
    return rc, json.loads(out)


def _codes(report: dict) -> list[str]:
    return [f["code"] for f in report["findings"]]


def _edit_metadata(iteration_dir: Path, edit) -> None:
    """Rewrite .metadata after ``edit(metadata_object)`` (stand-ins pickle back to the torch classes)."""
    path = iteration_dir / ".metadata"
    metadata = load_metadata_object(path)
    edit(metadata)
    path.write_bytes(dump_metadata_object(metadata))


def _storage_of(iteration_dir: Path, key: str) -> list[StorageLocation]:
    metadata = load_metadata_object(iteration_dir / ".metadata")
    return [
        StorageLocation(info.relative_path, info.offset, info.length)
        for index, info in storage_items(metadata).items()
        if index_fqn(index) == key
    ]


def _append_blob(iteration_dir: Path, key: str, blob: bytes) -> None:
    """Append ``blob`` to the item's data file and point the item's (first) storage entry at it."""
    location = _storage_of(iteration_dir, key)[0]
    path = iteration_dir / location.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(blob)

    def edit(metadata):
        for index, info in storage_items(metadata).items():
            if index_fqn(index) == key:
                set_storage(info, StorageLocation(location.relative_path, offset, len(blob)))
                return

    _edit_metadata(iteration_dir, edit)


def _malicious_zip(marker: Path) -> bytes:
    """A torch.save-shaped archive whose pickle would run ``touch marker`` if loaded by plain pickle."""
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("archive/data.pkl", payload)
        archive.writestr("archive/version", "3\n")
    return buf.getvalue()


# --- clean fixtures: no rule fires ----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_real_fixtures_pass_deep(capsys, name):
    """The fixtures megatron-core saved pass every rule, --deep included; converted ones only show the args
    the converter inherited (their manifest says so), with the megatron-core error; the two saved with a NaN or an
    Inf on purpose (their manifest's ``damage``) only CKD313."""
    rc, report = _json(capsys, "--deep", str(FIXTURES / name))
    info = manifest(name)
    assert report["checked"] == [str(FIXTURES / name / ITER)]
    if info.get("damage") in ("nan-weight", "inf-exp-avg-sq"):  # a NaN or Inf saved on purpose (check --health)
        assert rc == 1 and _codes(report) == ["CKD313"]
        return
    if "converted_from" not in info:
        assert rc == 0 and report["findings"] == []
        return
    assert rc == 1
    assert set(_codes(report)) <= {r.code for r in arg_rules.RULES} | {"CKD204"}
    shards = info["weight_shard_args"]["tensor_parallel_num_weight_shards"]  # the source's, inherited
    assert info["weight_shard_args"]["gtp_weight_remat_size"] == 1  # no source ran GTP: shards = TP is right
    f210 = [f for f in report["findings"] if f["code"] == "CKD210"]
    if shards == info["tp"]:
        assert f210 == []
    elif shards < info["tp"]:  # megatron-core refuses it
        assert f"({shards}) must be >= tensor_model_parallel_size ({info['tp']})" in f210[0]["message"]
    else:  # megatron-core derives a GTP weight remat from it
        assert f"makes megatron derive gtp_weight_remat_size={shards // info['tp']}" in f210[0]["message"]


def test_clean_text_output(capsys):
    rc, out, err = _check(capsys, str(FIXTURES / "core019_tp2"))
    assert rc == 0 and out.strip() == "All checks passed (1 checkpoint)." and err == ""


# --- structure ------------------------------------------------------------------------------------------


def _break(kind: str, save: Path) -> Path:
    """Derive a broken checkpoint from a copy of a real fixture; returns the path to check."""
    it = save / ITER
    if kind == "CKD100":
        (save.parent / "empty").mkdir()
        (save.parent / "empty" / "notes.txt").write_text("hi")
        return save.parent / "empty"
    if kind == "CKD101":
        (it / "metadata.json").unlink()
    elif kind == "CKD102":
        (it / "metadata.json").write_text("{not json")
    elif kind == "CKD103":
        (it / "metadata.json").write_text('{"sharded_backend": "fsdp_dtensor"}')
    elif kind == "CKD110":
        (it / ".metadata").unlink()
    elif kind == "CKD111":
        (it / ".metadata").write_bytes(GARBAGE_METADATA)
    elif kind == "CKD112":

        def drop(metadata):
            data = storage_items(metadata)
            del data[next(i for i in data if index_fqn(i) == f"{QKV}.weight")]

        _edit_metadata(it, drop)
    elif kind == "CKD113":
        (it / "__1_0.distcp").unlink()
    elif kind == "CKD114":
        with open(it / "__0_0.distcp", "r+b") as f:
            f.truncate((it / "__0_0.distcp").stat().st_size // 2)
    elif kind == "CKD115":
        shutil.copy(it / "__0_0.distcp", it / "__7_0.distcp")
    elif kind == "CKD120":
        (save / "latest_checkpointed_iteration.txt").write_text("\x00garbage")
    elif kind == "CKD121":
        (save / "latest_checkpointed_iteration.txt").write_text("20")
    elif kind == "CKD122":
        (save / "latest_checkpointed_iteration.txt").unlink()
    elif kind == "CKD130":

        def drop_common(metadata):
            metadata.state_dict_metadata.pop("common_state/shard_0_1")

        _edit_metadata(it, drop_common)
    elif kind == "CKD131":
        data = (it / "__0_0.distcp").read_bytes()
        (location,) = _storage_of(it, "common_state/shard_0_1")
        start = location.offset + location.length // 2
        data = data[:start] + bytes(64) + data[start + 64 :]  # zero the middle of the common state blob
        (it / "__0_0.distcp").write_bytes(data)
    elif kind == "CKD132":
        it.rename(save / "iter_0000020")
        (save / "latest_checkpointed_iteration.txt").write_text("20")
    return save


STRUCTURE = {
    "CKD100": "no tracker, iteration dirs",
    "CKD101": "metadata.json missing (incomplete save: rank 0 writes it last)",
    "CKD102": "not valid JSON",
    "CKD103": "'fsdp_dtensor'",
    "CKD110": ".metadata missing",
    "CKD111": "corrupt DCP metadata",
    "CKD112": f"have no storage entry: {QKV}.weight",
    "CKD113": "__1_0.distcp missing",
    "CKD114": "truncated",
    "CKD115": "no .metadata entry references this file",
    "CKD120": "not an iteration number",
    "CKD121": "tracker says 20 but iter_0000020 does not exist",
    "CKD122": "no latest_checkpointed_iteration.txt",
    "CKD130": "no common state",
    "CKD131": "common state (item common_state/shard_0_1) unreadable",
    "CKD132": "common state says iteration 10, the dir name 20",
}


@pytest.mark.parametrize("code", list(STRUCTURE))
def test_structure_rule_fires_on_broken_copy(capsys, copy_fixture, code):
    target = _break(code, copy_fixture("core019_tp2"))
    rc, out, err = _check(capsys, str(target))
    assert rc == 1, out + err
    lines = [line for line in out.splitlines() if f": {code} " in line]
    assert lines, out
    assert STRUCTURE[code] in lines[0]
    assert "Traceback" not in out + err and err == ""


def test_messages_name_the_file(capsys, copy_fixture):
    save = _break("CKD114", copy_fixture("core019_tp2"))
    _, out, _ = _check(capsys, str(save))
    assert f"{save / ITER / '__0_0.distcp'}: CKD114 [error] truncated:" in out
    save = _break("CKD101", copy_fixture("core016_tp1"))
    _, out, _ = _check(capsys, str(save))
    assert out.startswith(
        f"{save / ITER}: CKD101 [error] metadata.json missing (incomplete save: rank 0 writes it last)"
    )


@pytest.mark.parametrize(
    "content, why",
    [
        ("[]", "not an object whose 'files' maps"),
        ('{"files": []}', "not an object whose 'files' maps"),
        ('{"files": {"__0_0.distcp": 1}}', "not an object whose 'files' maps"),
        ('"sha256"', "not an object whose 'files' maps"),
        ("{", "not valid JSON"),
    ],
)
def test_a_malformed_manifest_is_ckd303_in_plain_words(capsys, copy_fixture, content, why):
    """No Python exception names ("AttributeError: 'list' object has no attribute 'get'") in the finding."""
    save = copy_fixture("core019_tp1")
    (save / ITER / "integrity.json").write_text(content)
    rc, report = _json(capsys, str(save))
    assert rc == 1 and _codes(report) == ["CKD303"], report
    message = report["findings"][0]["message"]
    assert why in message and "Error" not in message, message


def test_a_listed_file_that_is_not_a_regular_file_is_named_so(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    it = save / ITER
    (it / "integrity.json").write_text('{"algorithm": "sha256", "files": {"odd.distcp": "00", "gone.distcp": "00"}}')
    os.mkfifo(it / "odd.distcp")
    rc, report = _json(capsys, str(save))
    messages = sorted(f["message"] for f in report["findings"] if f["code"] == "CKD302")
    assert rc == 1 and messages == [
        "gone.distcp listed in integrity.json but missing",
        "odd.distcp listed in integrity.json but not a regular file",
    ], report


def test_garbage_common_pt_is_a_finding(capsys, copy_fixture):
    save = copy_fixture("core016_tp1")
    (save / ITER / "common.pt").write_bytes(b"PK\x03\x04" + os.urandom(300))
    rc, report = _json(capsys, str(save))
    assert rc == 1 and _codes(report) == ["CKD131"]
    assert report["findings"][0]["path"] == str(save / ITER / "common.pt")


def test_a_check_never_stops_at_the_first_problem(capsys, copy_fixture):
    """Tracker updated before the data landed: metadata.json missing, a data file missing, another truncated,
    and the tracker pointing past the newest dir of a second save: all reported, with exit 1, not 2."""
    save = copy_fixture("core019_tp2")
    it = save / ITER
    (it / "metadata.json").unlink()
    (it / "__1_0.distcp").unlink()
    with open(it / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    other = _break("CKD121", copy_fixture("core016_tp1"))
    rc, report = _json(capsys, str(save), str(other))
    assert rc == 1
    assert {"CKD101", "CKD113", "CKD114", "CKD121"} <= set(_codes(report))


def test_garbage_metadata_is_a_finding_and_checks_go_on(capsys, copy_fixture):
    save = copy_fixture("core016_tp1")
    (save / ITER / ".metadata").write_bytes(GARBAGE_METADATA)
    (save / ITER / "metadata.json").unlink()
    rc, report = _json(capsys, str(save))
    # common.pt still read (the args are fine), no crash, no exit 2
    assert rc == 1 and _codes(report) == ["CKD101", "CKD111"]


# --- consistency ----------------------------------------------------------------------------------------


def _set_common_arg(iteration_dir: Path, **values) -> None:
    common = load_torch_zip(iteration_dir / "common.pt", "common.pt")
    for name, value in values.items():
        setattr(common["args"], name, value)
    (iteration_dir / "common.pt").write_bytes(dump_torch_zip(common))


def test_inherited_weight_shard_args_fire_arg_rules(capsys, copy_fixture):
    """A TP=2 save whose args carry a TP=1 source's weight-shard values (what a converter leaves)."""
    save = copy_fixture("core016_tp2")
    _set_common_arg(save / ITER, tensor_parallel_num_weight_shards=1, gtp_weight_remat_size=1)
    rc, report = _json(capsys, str(save))
    assert rc == 1 and _codes(report) == ["CKD210"]
    finding = report["findings"][0]
    assert finding["severity"] == "error" and finding["path"] == str(save / ITER / "common.pt")
    assert "tensor_parallel_num_weight_shards (1) must be >= tensor_model_parallel_size (2)." in finding["message"]


@pytest.mark.parametrize(
    "shards,remat,expected",
    [
        (4, 2, []),  # a real GTP run: shards = TP x remat
        (None, 3, []),  # megatron derives the shards: TP x remat
        (1, 1, [("CKD210", "error", 2)]),  # fewer than TP: megatron-core refuses it
        (4, 1, [("CKD210", "warning", 2)]),  # a TP=4 source's shards: megatron would derive remat 2
        (2, 0, [("CKD211", "warning", 1)]),  # derived again from the shards
        (None, 0, [("CKD211", "error", 1)]),  # the shards would be TP x 0
    ],
)
def test_gtp_weight_shards_keep_the_saved_remat(shards, remat, expected):
    args = {
        "tensor_model_parallel_size": 2,
        "tensor_parallel_num_weight_shards": shards,
        "gtp_weight_remat_size": remat,
    }
    layout = SavedLayout(tp=2, pp=1, layers=2, ep=None, writer_ranks=[0, 1])
    found = [(f.code, f.severity, f.correct) for f in arg_rules.check_args(args, layout)]
    assert found == expected


def test_args_parallelism_vs_chunk_layout(capsys, copy_fixture):
    save = copy_fixture("core016_tp2")
    _set_common_arg(save / ITER, tensor_model_parallel_size=1)
    rc, report = _json(capsys, "--select", "CKD201", str(save))
    assert rc == 1 and _codes(report) == ["CKD201"]
    assert "chunks show TP=2" in report["findings"][0]["message"]


def _chunks(metadata, key):
    return metadata.state_dict_metadata[key].chunks


@pytest.mark.parametrize("how", ["gap", "overlap"])
def test_chunk_coverage(capsys, copy_fixture, how):
    save = copy_fixture("core019_tp2")

    def edit(metadata):
        chunks = _chunks(metadata, f"{QKV}.weight")
        if how == "gap":
            chunks.pop()
        else:
            chunks.append(chunks[0])

    _edit_metadata(save / ITER, edit)
    rc, report = _json(capsys, "--select", "CKD220", str(save))
    assert rc == 1 and _codes(report) == ["CKD220"]
    message = report["findings"][0]["message"]
    assert message.startswith(f"{QKV}.weight: chunks {'leave a gap' if how == 'gap' else 'overlap'}")


def test_chunk_outside_global_shape(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")

    def edit(metadata):
        metadata.state_dict_metadata[f"{QKV}.weight"].__dict__["size"] = (2, 48, 32)

    _edit_metadata(save / ITER, edit)
    rc, report = _json(capsys, "--select", "CKD220", str(save))
    assert rc == 1 and "lies outside the global shape [2, 48, 32]" in report["findings"][0]["message"]


def test_orphan_extra_state(capsys, copy_fixture):
    """A filter that dropped linear_qkv's weights but kept its _extra_state (what breaks trainable-only loads)."""
    save = copy_fixture("core019_tp1")

    def edit(metadata):
        for key in [k for k in metadata.state_dict_metadata if k.startswith(f"{QKV}.") and "_extra_state" not in k]:
            del metadata.state_dict_metadata[key]

    _edit_metadata(save / ITER, edit)
    rc, report = _json(capsys, str(save))
    assert rc == 1 and "CKD221" in _codes(report)
    (orphan,) = [f for f in report["findings"] if f["code"] == "CKD221"]
    assert orphan["message"].startswith(f"{QKV}._extra_state/") and f"no weight of {QKV}" in orphan["message"]
    assert "(a TELayerNormColumnParallelLinear in megatron-core's Transformer Engine spec)" in orphan["message"]
    # the peft trainable-only fixtures dropped weights *and* extra state: no orphan there
    rc, report = _json(capsys, str(FIXTURES / "core019_peft_trainable_tp2"))
    assert "CKD221" not in _codes(report)


# --- integrity ------------------------------------------------------------------------------------------


@pytest.fixture
def with_manifest(copy_fixture):
    """A fixture copy with integrity.json written by megatron-core's own save_integrity_manifest."""
    from conftest import require_mcore

    require_mcore()
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest

    save = copy_fixture("core019_tp2")
    save_integrity_manifest(str(save / ITER))
    return save


def _megatron_verifies(iteration_dir: Path) -> bool:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    try:
        verify_integrity_manifest(str(iteration_dir))  # no process group: checks in this process
    except CheckpointingException:
        return False
    return True


@pytest.mark.mcore
def test_integrity_manifest_clean(capsys, with_manifest):
    rc, report = _json(capsys, str(with_manifest))
    assert rc == 0 and report["findings"] == [] and _megatron_verifies(with_manifest / ITER)


@pytest.mark.mcore
def test_integrity_hash_mismatch_agrees_with_megatron(capsys, with_manifest):
    path = with_manifest / ITER / "__1_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size: structure rules see nothing
    path.write_bytes(bytes(data))
    rc, report = _json(capsys, str(with_manifest))
    assert rc == 1 and _codes(report) == ["CKD301"] and report["findings"][0]["path"] == str(path)
    assert not _megatron_verifies(with_manifest / ITER)
    rc, report = _json(capsys, "--no-verify-integrity", str(with_manifest))
    assert rc == 0  # hashes skipped: only presence is checked


@pytest.mark.mcore
def test_integrity_missing_unlisted_invalid(capsys, with_manifest):
    it = with_manifest / ITER
    (it / "__1_0.distcp").unlink()
    (it / "notes.txt").write_text("added after the save")
    rc, report = _json(capsys, str(with_manifest))
    assert rc == 1 and {"CKD302", "CKD304", "CKD113"} <= set(_codes(report))
    (it / "integrity.json").write_text('{"algorithm": "md5", "files": {}}')
    rc, report = _json(capsys, "--select", "CKD3", str(with_manifest))
    assert _codes(report) == ["CKD303"] and "'md5'" in report["findings"][0]["message"]


def _overwrite_range(iteration_dir: Path, key: str, blob_for) -> None:
    (location,) = _storage_of(iteration_dir, key)[:1]
    path = iteration_dir / location.relative_path
    data = bytearray(path.read_bytes())
    data[location.offset : location.offset + location.length] = blob_for(location.length)
    path.write_bytes(bytes(data))


def test_deep_undecodable_chunk(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    _overwrite_range(save / ITER, f"{QKV}.weight", lambda n: b"PK\x03\x04" + os.urandom(n - 4))
    rc, report = _json(capsys, str(save))
    assert rc == 0  # metadata-only: byte ranges still fit their files
    rc, report = _json(capsys, "--deep", str(save))
    assert rc == 1 and _codes(report) == ["CKD310"]
    assert report["findings"][0]["message"].startswith(f"{QKV}.weight chunk at [")


@pytest.mark.parametrize("corrupt", [False, True])
def test_deep_zipfile_fallback_checks_crc(capsys, copy_fixture, corrupt):
    """A blob the lean zip reader leaves to zipfile (here: an archive comment): its data record's CRC-32 is
    verified as every other's (CKD314), read from zipfile's directory."""
    save = copy_fixture("core019_tp2")
    it = save / ITER
    key = "embedding.word_embeddings.weight"
    location = _storage_of(it, key)[0]
    blob = bytearray((it / location.relative_path).read_bytes()[location.offset : location.offset + location.length])
    if corrupt:
        with zipfile.ZipFile(io.BytesIO(bytes(blob))) as archive:
            record = next(i for i in archive.infolist() if "/data/" in i.filename)
        header = blob[record.header_offset : record.header_offset + 30]  # name and extra lengths at 26
        start = (
            record.header_offset
            + 30
            + int.from_bytes(header[26:28], "little")
            + int.from_bytes(header[28:30], "little")
        )
        blob[start + 8] ^= 0x55  # bit rot inside the tensor bytes
    comment = b"saved by a tool that adds a comment"
    blob[-2:] = len(comment).to_bytes(2, "little")
    _append_blob(it, key, bytes(blob) + comment)
    rc, report = _json(capsys, "--deep", str(save))
    if not corrupt:
        assert rc == 0, report
        return
    assert rc == 1 and _codes(report) == ["CKD314"] and "fails its CRC-32" in report["findings"][0]["message"]


def test_deep_storage_size_mismatch(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    it = save / ITER
    key = "decoder.final_layernorm.weight"
    (location,) = _storage_of(it, key)
    blob = (it / location.relative_path).read_bytes()[location.offset : location.offset + location.length]
    ref = load_torch_zip(blob, key)
    ref.storage.set_data(ref.storage.data()[:-4])  # one float32 short of its element count
    _append_blob(it, key, dump_torch_zip(ref))
    rc, report = _json(capsys, "--deep", str(save))
    assert rc == 1 and _codes(report) == ["CKD311"] and "storage record has" in report["findings"][0]["message"]


def test_deep_undecodable_item(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    _overwrite_range(save / ITER, f"{QKV}._extra_state/shard_0_2", lambda n: b"PK\x03\x04" + os.urandom(n - 4))
    rc, report = _json(capsys, "--deep", str(save))
    assert rc == 1 and _codes(report) == ["CKD312"] and f"item {QKV}._extra_state" in report["findings"][0]["message"]


# --- safety ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("deep", [False, True])
def test_malicious_common_pt_reported_never_executed(capsys, copy_fixture, tmp_path, deep):
    marker = tmp_path / "marker"
    save = copy_fixture("core016_tp1")
    (save / ITER / "common.pt").write_bytes(_malicious_zip(marker))
    rc, report = _json(capsys, *(["--deep"] if deep else []), str(save))
    assert rc == 1 and _codes(report) == ["CKD401"]
    finding = report["findings"][0]
    assert finding["path"] == str(save / ITER / "common.pt") and "os.system" in finding["message"]
    assert not marker.exists()


def test_malicious_metadata_reported_never_executed(capsys, copy_fixture, tmp_path):
    marker = tmp_path / "marker"
    save = copy_fixture("core019_tp1")
    (save / ITER / ".metadata").write_bytes(f"cos\nsystem\n(S'touch {marker}'\ntR.".encode())
    rc, report = _json(capsys, str(save))
    assert rc == 1 and "CKD401" in _codes(report)
    assert str(save / ITER / ".metadata") in [f["path"] for f in report["findings"] if f["code"] == "CKD401"]
    assert not marker.exists()


def test_malicious_bytes_item_with_and_without_deep(capsys, copy_fixture, tmp_path):
    """The gate reads every bytes item's pickle in plain check (a ShardedObject is what megatron-core's load
    unpickles); --deep reports the same finding once."""
    marker = tmp_path / "marker"
    save = copy_fixture("core019_tp2")
    _append_blob(save / ITER, f"{QKV}._extra_state/shard_0_2", _malicious_zip(marker))
    for extra in ((), ("--deep",)):
        rc, report = _json(capsys, *extra, str(save))
        assert rc == 1 and _codes(report) == ["CKD401"] and "os.system" in report["findings"][0]["message"]
        assert report["safe_for_loaders"] is False and report["findings"][0]["subject"] == "os.system"
    assert not marker.exists()


# --- the streaming reader behind --deep ------------------------------------------------------------------


def test_read_ranges_matches_read_range(copy_fixture):
    """Every chunk of a real checkpoint, through windows smaller and larger than chunks, equals read_range;
    a file cut short yields one error; a stream can be stopped early."""
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.formats.torch_dist import read_range
    from ckptdoctor.storage.stream import read_ranges

    save = copy_fixture("core019_tp2")
    ckpt = open_checkpoint(save)
    by_file: dict[str, list] = {}
    for entry in ckpt.entries.values():
        for chunk in entry.chunks:
            by_file.setdefault(chunk.storage.relative_path, []).append(
                (chunk.storage.offset, chunk.storage.length, chunk.storage)
            )
    files = [
        (ckpt.iteration_dir / name, sorted(ranges, key=lambda r: r[0])) for name, ranges in sorted(by_file.items())
    ]
    for window in (4096, 1 << 20):
        seen = 0
        for _, storage, view in read_ranges(files, window=window):
            assert bytes(view) == read_range(ckpt.iteration_dir, storage)
            seen += 1
        assert seen == sum(len(r) for _, r in files)
    stream = read_ranges(files, window=4096)
    next(stream)
    stream.close()
    with open(ckpt.iteration_dir / "__1_0.distcp", "r+b") as f:
        f.truncate(5000)
    results = list(read_ranges(files, window=4096))
    errors = [item for item in results if item[1] is None]
    assert len(errors) == 1 and "__1_0.distcp: truncated" in str(errors[0][2])


def test_coverage_shortcut_for_one_chunk_per_cell_agrees_with_the_cell_mapping(monkeypatch):
    """coverage_problem answers a grid of one chunk per cell without mapping cells; on random layouts (tilings,
    overlaps, gaps, chunks spanning cells, duplicates) it says what the full mapping says."""
    from ckptdoctor import coverage
    from ckptdoctor.checkpoint import Entry
    from ckptdoctor.formats.torch_dist import DcpChunk

    def layouts(rng: random.Random):
        for _ in range(3000):
            shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
            cuts = [sorted({0, d, *rng.sample(range(1, d + 1), rng.randint(0, d - 1))}) for d in shape]
            grid = [[(a[i], a[i + 1] - a[i]) for i in range(len(a) - 1)] for a in cuts]
            chunks = [tuple(zip(*cell)) for cell in __import__("itertools").product(*grid)]
            for _ in range(rng.choice((0, 0, 1, 2))):  # damage: drop, duplicate, widen or shift a chunk
                i = rng.randrange(len(chunks))
                offsets, sizes = chunks[i]
                kind = rng.randrange(4)
                if kind == 0:
                    chunks.pop(i)
                elif kind == 1:
                    chunks.append(chunks[i])
                elif kind == 2:
                    chunks[i] = (offsets, tuple(s + 1 if o + s < d else s for o, s, d in zip(offsets, sizes, shape)))
                else:
                    chunks[i] = (tuple(max(0, o - 1) for o in offsets), sizes)
                if not chunks:
                    chunks = [((0,) * len(shape), shape)]
            yield Entry("k", "tensor", "torch.float32", shape, [DcpChunk(o, s, None) for o, s in chunks])

    entries = list(layouts(random.Random(7)))
    fast = [coverage.coverage_problem(e) for e in entries]
    monkeypatch.setattr(coverage, "_one_chunk_per_cell", lambda chunks, cuts: False)
    assert fast == [coverage.coverage_problem(e) for e in entries]
    assert sum(p is None for p in fast) > 500 and sum(p is not None for p in fast) > 500


def _plan_item_with_state(iteration_dir: Path, state: object) -> None:
    """Rewrite .metadata with its first plan's first write item pickled with ``state`` as its BUILD state (a
    crafted file: ckptdoctor's own writer refuses to write it, so the unchecked pickler is used)."""
    from ckptdoctor.formats.torch_dist import record_attr
    from ckptdoctor.pickle import unpickler
    from ckptdoctor.pickle.stand_ins import stand_in_class

    path = iteration_dir / ".metadata"
    metadata = load_metadata_object(path)
    cls = stand_in_class("torch.distributed.checkpoint.planner", "WriteItem")
    item = cls.__new__(cls)  # NEWOBJ, as DCP pickles it
    item.__setstate__(state)  # a generic stand-in keeps any state as it is and pickles it back
    record_attr(record_attr(metadata, "all_local_plans")[0], "items")[0] = item
    path.write_bytes(unpickler._pickled(metadata, None))


def test_a_save_plan_part_torch_cannot_build_is_corrupt_metadata(capsys, copy_fixture):
    """megatron-core's load reads .metadata with torch's plain pickle.load, which refuses a write item built with
    anything but a dict: check reports it (CKD111) although the index never reads the plans, and edit refuses it."""
    save = copy_fixture("core019_tp2")
    _plan_item_with_state(save / ITER, [1, 2, 3])
    rc, out, _ = _check(capsys, str(save))
    assert rc == 1 and "CKD111" in out and "state is not a dictionary" in out, out
    assert main(["edit", str(save), "--remove", "^optimizer\\.", "-o", str(save.parent / "edited")]) == 2
    assert "state is not a dictionary" in capsys.readouterr().err
    fine = copy_fixture("core019_tp1")
    _plan_item_with_state(fine / ITER, {"type": None})  # a dict: what torch accepts
    assert _check(capsys, str(fine))[0] == 0


@pytest.mark.mcore
def test_torch_refuses_the_plan_part_check_refuses(copy_fixture):
    """The premise of the test above, checked against torch's own reader."""
    pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader

    save = copy_fixture("core019_tp2")
    FileSystemReader(str(save / ITER)).read_metadata()  # the fixture itself reads
    _plan_item_with_state(save / ITER, [1, 2, 3])
    with pytest.raises(Exception, match="state is not a dictionary"):
        FileSystemReader(str(save / ITER)).read_metadata()


def _plan_index_with_state(iteration_dir: Path, state: object) -> None:
    """Rewrite .metadata with the index record (MetadataIndex) of its first plan's first write item pickled with
    ``state`` as its BUILD state: a record inside a plan part, which the index never reads."""
    from ckptdoctor.formats.torch_dist import record_attr
    from ckptdoctor.pickle import unpickler
    from ckptdoctor.pickle.stand_ins import stand_in_class

    path = iteration_dir / ".metadata"
    metadata = load_metadata_object(path)
    cls = stand_in_class("torch.distributed.checkpoint.metadata", "MetadataIndex")
    index = cls.__new__(cls)
    index.__setstate__(state)
    record_attr(record_attr(metadata, "all_local_plans")[0], "items")[0].__dict__["index"] = index
    path.write_bytes(unpickler._pickled(metadata, None))


@pytest.mark.parametrize("state", [[1, 2, 3], ({"fqn": "x"}, None)])
def test_a_record_inside_a_save_plan_part_torch_cannot_build_is_corrupt_metadata(capsys, copy_fixture, state):
    """The records inside a plan part (a write item's MetadataIndex) are built by torch's loader too, which refuses a
    BUILD with anything but a dict (and a (dict, None) pair): check reports CKD111, edit refuses to rewrite it."""
    save = copy_fixture("core019_tp2")
    _plan_index_with_state(save / ITER, state)
    rc, out, _ = _check(capsys, str(save))
    assert rc == 1 and "CKD111" in out and "is not a dictionary" in out, out
    assert main(["edit", str(save), "--remove", "^optimizer\\.", "-o", str(save.parent / "edited")]) == 2
    assert "is not a dictionary" in capsys.readouterr().err
    fine = copy_fixture("core019_tp1")
    _plan_index_with_state(fine / ITER, {"fqn": "x", "offset": None, "index": None})  # a dict: what torch accepts
    assert _check(capsys, str(fine))[0] == 0


@pytest.mark.mcore
@pytest.mark.parametrize("state", [[1, 2, 3], ({"fqn": "x"}, None)])
def test_torch_refuses_the_record_inside_a_plan_part_check_refuses(copy_fixture, state):
    """The premise of the test above, checked against torch's own reader."""
    pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader

    save = copy_fixture("core019_tp2")
    _plan_index_with_state(save / ITER, state)
    with pytest.raises(Exception, match="is not a dictionary"):
        FileSystemReader(str(save / ITER)).read_metadata()


def _metadata_part_with_state(iteration_dir: Path, part: str, state: object) -> None:
    """Rewrite .metadata with its ``storage_meta`` (a StorageMeta) or one tensor's ``properties`` (a TensorProperties)
    pickled with ``state`` as its BUILD state (set on the object directly: the readers refuse to build either)."""
    from ckptdoctor.formats.torch_dist import record_attr
    from ckptdoctor.pickle import unpickler
    from ckptdoctor.pickle.stand_ins import stand_in_class

    path = iteration_dir / ".metadata"
    metadata = load_metadata_object(path)
    if part == "storage_meta":
        cls = stand_in_class("torch.distributed.checkpoint.metadata", "StorageMeta")
        meta = cls.__new__(cls)
        meta.__dict__.update(_ckd_state=state, _ckd_state_kind="raw")  # pickled back as this BUILD state
        metadata.__dict__["storage_meta"] = meta
    elif part == "plan_size":  # the first write item's tensor size: torch.Size(state), which no read builds
        from ckptdoctor.pickle.torch_stand_ins import Size

        item = record_attr(record_attr(metadata, "all_local_plans")[0], "items")[0]
        record_attr(item, "tensor_data").__dict__["size"] = tuple.__new__(Size, state)
    elif part == "write_item_type":  # the first write item's type: WriteItemType(state), which no read builds
        from ckptdoctor.pickle.torch_values import WriteItemTypeCode

        item = record_attr(record_attr(metadata, "all_local_plans")[0], "items")[0]
        item.__dict__["type"] = int.__new__(WriteItemTypeCode, state)
    else:
        tensor = next(m for m in record_attr(metadata, "state_dict_metadata").values() if "properties" in m.__dict__)
        properties = tensor.__dict__["properties"].__dict__
        if part == "memory_format":  # the fourth value: _MEM_FORMAT_ENCODING(state), which no read builds
            from ckptdoctor.pickle.torch_values import MemoryFormatCode

            old = properties["_ckd_state"]
            state = (*old[:3], int.__new__(MemoryFormatCode, state), *old[4:])
        properties["_ckd_state"] = state
    path.write_bytes(unpickler._pickled(metadata, None))


_BAD_METADATA_PARTS = [
    ("storage_meta", [1, 2], "state is not a dictionary"),
    ("storage_meta", ({"save_id": "x"}, None), "slot state is not a dictionary"),
    ("properties", (1,), "is not 5 values"),
    ("properties", 7, "is not 5 values"),
    ("memory_format", 3, "is not a valid _MEM_FORMAT_ENCODING"),
    ("write_item_type", 4, "is not a valid WriteItemType"),
    ("plan_size", (4, 1.5), "item 1 is 'float'"),
]


@pytest.mark.parametrize("part,state,error", _BAD_METADATA_PARTS)
def test_metadata_parts_torch_cannot_build_are_corrupt_metadata(capsys, copy_fixture, part, state, error):
    """A StorageMeta built with a state torch's BUILD refuses, a TensorProperties state its __setstate__ cannot
    unpack, a memory format or write item type the enum does not have: megatron-core cannot load the file; check
    reports CKD111 and edit refuses to rewrite it."""
    save = copy_fixture("core019_tp2")
    _metadata_part_with_state(save / ITER, part, state)
    rc, out, _ = _check(capsys, str(save))
    assert rc == 1 and "CKD111" in out and error in out, out
    assert main(["edit", str(save), "--remove", "^optimizer\\.", "-o", str(save.parent / "edited")]) == 2
    assert error in capsys.readouterr().err


@pytest.mark.mcore
@pytest.mark.parametrize("part,state,error", _BAD_METADATA_PARTS)
def test_torch_refuses_the_metadata_parts_check_refuses(copy_fixture, part, state, error):
    """The premise of the test above, checked against torch's own reader."""
    pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader

    save = copy_fixture("core019_tp2")
    _metadata_part_with_state(save / ITER, part, state)
    with pytest.raises(Exception):  # noqa: B017 - UnpicklingError, ValueError or TypeError, as torch raises them
        FileSystemReader(str(save / ITER)).read_metadata()


@pytest.mark.parametrize(
    "name,label,held",
    [
        ("core015_tp2", "zarr", "a DCP .metadata and no zarr array"),  # common.pt: the zarr reading found 0 keys
        ("core019_tp2", "zarr", "a DCP .metadata and no zarr array"),
        ("core014_zarr_tp2", "torch_dist", "zarr arrays and no .metadata"),
    ],
)
def test_a_backend_the_files_are_not_is_an_error(capsys, copy_fixture, name, label, held):
    """metadata.json picks Megatron's loader: a backend the files contradict stops the load. It passed check when
    the zarr reading of a DCP dir with common.pt found nothing to check (found by scripts/fuzz_semantic.py)."""
    save = copy_fixture(name)
    (save / ITER / "metadata.json").write_text(json.dumps({"sharded_backend": label}))
    rc, found = _json(capsys, str(save))
    assert rc == 1 and [f["code"] for f in found["findings"]] == ["CKD102"], found
    assert f"sharded_backend '{label}', but the dir holds {held}" in found["findings"][0]["message"]
    assert main(["inspect", str(save)]) == 2
    assert held in capsys.readouterr().err


def test_an_index_without_model_tensors_is_an_error(capsys, copy_fixture):
    """A .metadata that lists no model tensor (emptied, or another save's) left only unreferenced-file warnings,
    and latest-good took the iteration as good: CKD116 makes it an error."""
    save = copy_fixture("core016_tp1")
    metadata = load_metadata_object(save / ITER / ".metadata")
    state_dict = record_attr(metadata, "state_dict_metadata")
    for key in [k for k in state_dict if not k.startswith(("optimizer.", "rng_state"))]:
        del state_dict[key]
    storage = storage_items(metadata)
    for index in [i for i in storage if index_fqn(i) not in state_dict]:
        del storage[index]
    (save / ITER / ".metadata").write_bytes(dump_metadata_object(metadata))
    rc, found = _json(capsys, str(save))
    assert rc == 1 and "CKD116" in _codes(found), found
    message = next(f["message"] for f in found["findings"] if f["code"] == "CKD116")
    assert f"no model tensor among its {len(state_dict)} keys" in message
    assert main(["latest-good", str(save)]) == 1
    capsys.readouterr()
    for name in NAMES:  # every real save holds model tensors
        rc, found = _json(capsys, str(FIXTURES / name))
        assert "CKD116" not in _codes(found), name
