"""Inputs found by a mutation fuzz campaign (real fixtures, one file mutated), run through the real CLI in a
child process: each must end as one clean error line naming the file (or a `check` finding), never as an
"internal error" or a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import FIXTURES, run_ckptdoctor

ZARR = "core014_zarr_tp2"
ITER = "iter_0000010"
MEMORY_LIMIT = 1536 << 20


def run_limited(*args: str) -> subprocess.CompletedProcess:
    return run_ckptdoctor(*args, timeout=120, memory_headroom=MEMORY_LIMIT)


def assert_one_line_error(proc: subprocess.CompletedProcess, names: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptdoctor: error: "), proc.stderr
    assert names in lines[0], lines[0]
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture
def zarr_save(tmp_path) -> Path:
    dest = tmp_path / ZARR
    shutil.copytree(FIXTURES / ZARR, dest)
    return dest


GOOD_ZARRAY = {"chunks": [64, 32], "compressor": None, "dtype": "<f4", "fill_value": None, "filters": None,
               "order": "C", "shape": [128, 32], "zarr_format": 2}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        {"chunks": None},  # found by the fuzzer: TypeError 'NoneType' object is not iterable
        {"shape": None},
        {"shape": [128, "x"]},
        {"shape": [-1, 32]},
        {"chunks": [0, 32]},
        {"chunks": [64]},
        {"dtype": {"a": 1}},
        {"dtype": ">f4"},  # big-endian: `show`/`diff --values` hit "refusing to register the global"
        {"dtype": "<U10"},
        {"dimension_separator": 5},
        None,  # a JSON list, not an object
    ],
    ids=repr,
)
def test_a_malformed_zarray_is_one_line_and_a_finding(zarr_save, change):
    zarray = zarr_save / ITER / "output_layer.weight" / ".zarray"
    zarray.write_text(json.dumps([1, 2] if change is None else {**GOOD_ZARRAY, **change}))
    for command in (["inspect"], ["show", "output_layer.weight"], ["diff", "--values", str(FIXTURES / ZARR)]):
        proc = run_limited(command[0], str(zarr_save), *command[1:])
        assert_one_line_error(proc, ".zarray")
    proc = run_limited("check", "--isolated", "--deep", "--format", "json", str(zarr_save))
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr
    findings = json.loads(proc.stdout)["findings"]
    assert any(".zarray" in f["message"] for f in findings), findings


def test_a_legitimate_zarray_dtype_spelling_still_reads(zarr_save):
    zarray = zarr_save / ITER / "output_layer.weight" / ".zarray"
    zarray.write_text(json.dumps({**GOOD_ZARRAY, "dtype": "float32"}))  # a torch name, as for bfloat16
    proc = run_limited("show", str(zarr_save), "output_layer.weight", "--stats")
    assert proc.returncode == 0 and "torch.float32" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    "text, why",
    [
        ("num_layers: " + "9" * 5000 + "\n", "4300 digits"),  # PyYAML's int(): ValueError, not YAMLError
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),  # RecursionError in PyYAML's composer
        ("".join("  " * i + f"k{i}:\n" for i in range(3000)), "nested too deeply"),
        ("- 1\n- 2\n", "not a mapping"),  # the error named no file
    ],
    ids=["huge int", "deep flow list", "deep block mapping", "a list"],
)
def test_a_hostile_args_from_yaml_is_one_line_naming_it(tmp_path, text, why):
    pytest.importorskip("yaml")
    config = tmp_path / "run_config.yaml"
    config.write_text(text)
    proc = run_limited("can-load", str(FIXTURES / "core019_tp1"), "--target", "tp=1", "--args-from", str(config))
    assert_one_line_error(proc, str(config))
    assert why in proc.stderr, proc.stderr


@pytest.mark.parametrize("blob", [b"hello world", b""], ids=["text", "empty"])
@pytest.mark.parametrize("key", ["rng_state/shard_0.0_1.2", "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"])
def test_a_bytes_item_that_is_no_torch_save_archive_fails_check_deep(tmp_path, key, blob):
    """DCP torch.load()s every bytes item; one replaced by raw bytes passed `check --deep` (it was shown as raw)."""
    from ckptdoctor.formats.torch_dist import (
        StorageLocation,
        dump_metadata_object,
        index_fqn,
        load_metadata_object,
        set_storage,
        storage_items,
    )

    save = tmp_path / "core019_tp2"
    shutil.copytree(FIXTURES / "core019_tp2", save)
    metadata_path = save / ITER / ".metadata"
    metadata = load_metadata_object(metadata_path)
    info = next(info for index, info in storage_items(metadata).items() if index_fqn(index) == key)
    data_file = save / ITER / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)
    set_storage(info, StorageLocation(info.relative_path, offset, len(blob)))
    metadata_path.write_bytes(dump_metadata_object(metadata))
    proc = run_limited("check", "--isolated", "--deep", "--format", "json", str(save))
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr
    found = [f for f in json.loads(proc.stdout)["findings"] if f["code"] == "CKD312"]
    assert found and key in found[0]["message"] and "not a torch.save archive" in found[0]["message"], found


@pytest.mark.parametrize("change", ["truncate", "grow"])
def test_a_zarr_chunk_of_the_wrong_size_is_a_check_finding(zarr_save, change):
    """A legacy zarr chunk file is the raw elements; a truncated or grown one passed `check --deep` (its storage
    length was the file's own size) while show/diff --values refused it."""
    chunk = zarr_save / ITER / "output_layer.weight" / "0.0"
    data = chunk.read_bytes()
    chunk.write_bytes(data[:100] if change == "truncate" else data + b"xxxx")
    proc = run_limited("check", "--isolated", "--deep", "--format", "json", str(zarr_save))
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr
    found = [f for f in json.loads(proc.stdout)["findings"] if f["code"] == "CKD114"]
    assert len(found) == 1 and found[0]["path"].endswith("output_layer.weight/0.0"), found
    assert "needs 8192" in found[0]["message"], found
    proc = run_limited("latest-good", "--deep", str(zarr_save))
    assert proc.returncode == 1 and "CKD114" in proc.stderr, proc.stderr


def test_check_deep_decodes_legacy_zarr_objects(zarr_save, tmp_path):
    """`check --deep` decoded nothing of a legacy zarr checkpoint: an os.system pickle in a ShardedObject's .pt
    passed it (and latest-good --deep picked the dir). Now the .pt objects go through the safe unpickler."""
    from hostile_corpus import call, torch_zip

    marker = tmp_path / "PWNED"
    item = zarr_save / ITER / "rng_state" / "shard_0.0_1.2.pt"
    item.write_bytes(torch_zip(call("os", "system", f"touch {marker}")))
    proc = run_limited("check", "--isolated", "--deep", "--format", "json", str(zarr_save))
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr
    found = json.loads(proc.stdout)["findings"]
    assert [f["code"] for f in found] == ["CKD401"] and found[0]["path"].endswith("rng_state/shard_0.0_1.2.pt"), found
    proc = run_limited("latest-good", "--deep", str(zarr_save))
    assert proc.returncode == 1 and "CKD401" in proc.stderr, proc.stderr
    item.write_bytes(b"hello world")
    proc = run_limited("check", "--isolated", "--deep", "--format", "json", str(zarr_save))
    assert [f["code"] for f in json.loads(proc.stdout)["findings"]] == ["CKD312"], proc.stdout
    assert not marker.exists()


@pytest.mark.parametrize(
    "field, value", [("offsets", ()), ("sizes", (64,)), ("size", (128, 32, 1))], ids=["offsets", "sizes", "size"]
)
def test_a_chunk_of_the_wrong_rank_is_one_error_in_show_and_diff_values(tmp_path, field, value):
    """Chunk offsets/sizes with another number of dims than the tensor (ints, so the index takes them): show
    and diff --values indexed them by the tensor's axes (IndexError: internal error)."""
    from ckptdoctor.formats.torch_dist import dump_metadata_object, load_metadata_object, record_attr

    save = tmp_path / "core019_tp2"
    shutil.copytree(FIXTURES / "core019_tp2", save)
    path = save / ITER / ".metadata"
    metadata = load_metadata_object(path)
    item = vars(record_attr(metadata, "state_dict_metadata")["embedding.word_embeddings.weight"])
    (item if field == "size" else vars(item["chunks"][0]))[field] = value
    path.write_bytes(dump_metadata_object(metadata))
    commands = [["show", str(save), "embedding.word_embeddings.weight", "--stats"]]
    if field != "size":  # a changed global shape is a shape difference: no values compared
        commands.append(["diff", "--values", str(save), str(FIXTURES / "core019_tp2")])
    for command in commands:
        assert_one_line_error(run_limited(*command), ".metadata")
    proc = run_limited("check", "--isolated", "--format", "json", str(save))
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("kind", ["dir", "fifo", "device", "dangling"])
def test_an_integrity_json_that_is_no_regular_file_is_a_finding(tmp_path, kind):
    """integrity.json as a directory, FIFO, /dev/zero link or dangling link was silently ignored (check passed);
    Megatron's --verify-integrity load cannot read it."""
    save = tmp_path / "core019_tp1"
    shutil.copytree(FIXTURES / "core019_tp1", save)
    manifest = save / ITER / "integrity.json"
    if kind == "dir":
        manifest.mkdir()
    elif kind == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.symlink_to("/dev/zero" if kind == "device" else "nowhere")
    proc = run_limited("check", "--isolated", "--verify-integrity", "--format", "json", str(save))
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr
    found = json.loads(proc.stdout)["findings"]
    assert [f["code"] for f in found] == ["CKD303"] and "not a regular file" in found[0]["message"], found
    proc = run_limited("seal", "--force", str(save))
    assert proc.returncode == 0 and manifest.is_file() and not manifest.is_symlink(), proc.stderr
    (kept,) = save.glob(f"{ITER}.quarantine-*/integrity.json.bak-*")  # what was there is moved aside, not lost
    assert {"dir": kept.is_dir, "fifo": kept.is_fifo}.get(kind, kept.is_symlink)()


def test_a_malformed_cached_write_item_does_not_break_edit_or_strip(tmp_path):
    """A .metadata whose all_local_plans write item names a dict as its fqn (found by mutating one memo byte)
    passes check; edit and strip-frozen then failed with an internal TypeError (unhashable type: 'dict')."""
    from ckptdoctor.formats.torch_dist import dump_metadata_object, load_metadata_object, record_attr

    save = tmp_path / "core019_tp2"
    shutil.copytree(FIXTURES / "core019_tp2", save)
    path = save / ITER / ".metadata"
    metadata = load_metadata_object(path)
    item = record_attr(record_attr(metadata, "all_local_plans")[0], "items")[0]
    vars(record_attr(item, "index"))["fqn"] = {"not": "a key"}
    path.write_bytes(dump_metadata_object(metadata))
    commands = [
        ["edit", str(save), "--drop-section", "optimizer", "--compact", "-o", str(tmp_path / "compact")],
        ["edit", str(save), "--rename", "output_layer", "out_layer", "-o", str(tmp_path / "renamed")],
        ["strip-frozen", str(save), "--trainable", "embedding", "-o", str(tmp_path / "stripped")],
    ]
    for command in commands:
        proc = run_limited(*command)
        assert proc.returncode == 0 and "internal error" not in proc.stderr, proc.stderr
        out = run_limited("check", "--isolated", command[-1])
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name,key", [("core016_tp1", "decoder.layers.mlp.linear_fc1.weight")])
def test_a_chunk_without_its_tensors_dims_is_a_finding_not_an_internal_error(tmp_path, name, key):
    """A stacked layer key whose chunk has no sizes (a semantic fuzz of the stand-ins, then pickled back): the
    layout inference of inspect, check and diff indexed its sizes by the layer axis (IndexError)."""
    from ckptdoctor.formats.torch_dist import dump_metadata_object, load_metadata_object, record_attr
    from ckptdoctor.pickle.torch_stand_ins import Size

    save = tmp_path / name
    shutil.copytree(FIXTURES / name, save)
    path = save / ITER / ".metadata"
    metadata = load_metadata_object(path)
    chunk = record_attr(record_attr(metadata, "state_dict_metadata")[key], "chunks")[0]
    vars(chunk)["sizes"] = Size(())
    path.write_bytes(dump_metadata_object(metadata))
    for command in (["inspect", str(save)], ["diff", str(save), str(FIXTURES / name)]):
        proc = run_limited(*command)
        assert proc.returncode in (0, 1) and "internal error" not in proc.stderr, proc.stderr
    proc = run_limited("check", "--isolated", "--format", "json", str(save))
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr
    found = json.loads(proc.stdout)["findings"]
    assert any(f["code"] == "CKD220" and key in f["message"] for f in found), found


def test_a_zero_dim_stacked_tensor_is_no_internal_error_in_can_load(tmp_path):
    """A stacked layer key saved with an empty global shape (a semantic fuzz): can-load's target shape indexed its
    layer axis (IndexError); check reports the key's chunks as not fitting it."""
    from ckptdoctor.formats.torch_dist import dump_metadata_object, load_metadata_object, record_attr
    from ckptdoctor.pickle.torch_stand_ins import Size

    save = tmp_path / "core019_tp1"
    shutil.copytree(FIXTURES / "core019_tp1", save)
    path = save / ITER / ".metadata"
    metadata = load_metadata_object(path)
    vars(record_attr(metadata, "state_dict_metadata")["decoder.layers.mlp.linear_fc1.weight"])["size"] = Size(())
    path.write_bytes(dump_metadata_object(metadata))
    for target in ("tp=1,pp=1", "tp=2,pp=1"):
        proc = run_limited("can-load", str(save), "--target", target)
        assert proc.returncode in (0, 1) and "internal error" not in proc.stderr, proc.stderr
    proc = run_limited("check", "--isolated", str(save))
    assert proc.returncode == 1 and "CKD220" in proc.stdout, proc.stdout + proc.stderr
