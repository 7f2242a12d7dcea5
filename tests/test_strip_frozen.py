"""strip-frozen on the real PEFT fixtures: reference key set, bitwise values, megatron-core loads the result,
the three trainable sources agree, refusals write nothing, --in-place swaps atomically."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, free_port, manifest, require_exchange, require_mcore, run_cli, run_main

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.cli import main
from ckptdoctor.formats import torch_dist
from ckptdoctor.ops.check import check_paths
from ckptdoctor.tree_removal import remove_tree

FULL = ["core019_peft_full_tp1", "core019_peft_full_tp2", "core016_peft_full_tp1"]
REFERENCE = {
    "core019_peft_full_tp1": "core019_peft_trainable_tp1",
    "core019_peft_full_tp2": "core019_peft_trainable_tp2",
}
LOAD_SCRIPT = REPO / "tests" / "mcore_load_stripped.py"


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _strip(capsys, source, out, *extra):
    rc, stdout, err = _run(capsys, "strip-frozen", source, "--output", out, "--format", "json", *extra)
    assert rc == 0, err
    return json.loads(stdout)


def _bitwise_equal(a, b) -> bool:
    import torch

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def _tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


# --- the reference: what --save-trainable-params-only wrote -----------------------------------------------


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_strip_gives_reference_keys_and_bitwise_tensors(capsys, tmp_path, name):
    pytest.importorskip("torch")
    from ckptdoctor.values.read import read_tensor

    report = _strip(capsys, FIXTURES / name, tmp_path / "out", "--keep-args")  # byte copies: the args as saved
    assert report["plan"]["trainable_source"] == "optimizer" and report["result"]["args_changed"] == []
    out = open_checkpoint(tmp_path / "out")
    ref = open_checkpoint(FIXTURES / REFERENCE[name])
    src = open_checkpoint(FIXTURES / name)
    assert set(out.entries) == set(ref.entries)
    model_keys = {k for k, e in out.entries.items() if e.section == "model"}
    assert model_keys == set(manifest(name)["trainable_keys"])
    for key, entry in out.entries.items():
        if entry.kind == "tensor":
            assert _bitwise_equal(read_tensor(out, key), read_tensor(ref, key)), key
        else:  # bytes items are byte copies of the source's
            assert torch_dist.read_range(out.iteration_dir, entry.chunks[0].storage) == torch_dist.read_range(
                src.iteration_dir, src.entries[key].chunks[0].storage
            ), key
    # same layout, same writer ranks, same data-file names as the reference
    assert sorted(out.data_files) == sorted(ref.data_files)
    assert out.location.save_dir is not None and out.location.tracker_value == "10"
    assert (out.iteration_dir / "metadata.json").read_bytes() == (src.iteration_dir / "metadata.json").read_bytes()


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_output_size_printed_and_within_reference(capsys, tmp_path, name):
    rc, out, err = _run(capsys, "strip-frozen", FIXTURES / name, "--output", tmp_path / "out")
    assert rc == 0, err
    printed = int(re.search(r"size after .*\((\d+) bytes", out).group(1))
    assert printed == _dir_bytes(tmp_path / "out" / "iter_0000010")
    reference = _dir_bytes(FIXTURES / REFERENCE[name] / "iter_0000010")
    # + the rewritten common state (save_trainable_params_only=true): a new small file, the old item unreferenced
    common = tmp_path / "out" / "iter_0000010" / "common_state.strip-frozen.distcp"
    assert printed <= reference * 1.05 + 2 * common.stat().st_size, (printed, reference)
    assert int(re.search(r"size before .*\((\d+) bytes", out).group(1)) == _dir_bytes(FIXTURES / name / "iter_0000010")


def test_rank_files_hold_exactly_the_kept_items(capsys, tmp_path):
    """The rewritten common state goes to its own small file and its old item is not copied: every byte of the
    rank files is a kept item's (the .metadata is read once; the output is not read back to set the arg)."""
    src = open_checkpoint(FIXTURES / "core019_peft_full_tp1")
    report = _strip(capsys, FIXTURES / "core019_peft_full_tp1", tmp_path / "out")
    assert report["result"]["args_changed"] == [{"arg": "save_trainable_params_only", "old": False, "new": True}]
    out = open_checkpoint(tmp_path / "out")
    referenced: dict[str, int] = {}
    for entry in out.entries.values():
        for chunk in entry.chunks:
            referenced[chunk.storage.relative_path] = (
                referenced.get(chunk.storage.relative_path, 0) + chunk.storage.length
            )
    rank_files = {p.name: p.stat().st_size for p in out.iteration_dir.glob("__*.distcp")}
    assert {n: referenced[n] for n in rank_files} == rank_files
    common = out.entries["common_state/shard_0_1"].chunks[0].storage
    assert common.relative_path == "common_state.strip-frozen.distcp"
    assert common.length == (out.iteration_dir / common.relative_path).stat().st_size
    kept = {d["key"] for d in report["plan"]["kept"]}
    assert sum(rank_files.values()) == sum(src.entries[k].nbytes for k in kept - {"common_state/shard_0_1"})


def test_megatron_extras_list_only_kept_keys(capsys, tmp_path):
    """mcore_data (core 0.14-0.15) is edited with the other places a key appears, as edit edits it."""
    source = FIXTURES / "core015_tp2"
    assert "decoder.layers.mlp.linear_fc2.weight" in torch_dist.record_attr(
        torch_dist.load_metadata_object(source / "iter_0000010" / ".metadata"), "mcore_data"
    )
    _strip(capsys, source, tmp_path / "out", "--trainable", "linear_qkv")
    metadata = torch_dist.load_metadata_object(tmp_path / "out" / "iter_0000010" / ".metadata")
    mcore_data = torch_dist.record_attr(metadata, "mcore_data")
    keys = set(torch_dist.record_attr(metadata, "state_dict_metadata"))
    assert mcore_data and set(mcore_data) <= keys
    assert "decoder.layers.mlp.linear_fc2.weight" not in keys | set(mcore_data)


@pytest.mark.parametrize("name", ["core019_peft_full_tp1", "core016_peft_full_tp1"])
def test_the_write_lets_the_source_index_go_before_pickling(tmp_path, monkeypatch, name):
    """The source's index is released before the new .metadata is pickled (not held beside the records that are);
    the common state the write changes was made from it before."""
    from ckptdoctor.checkpoint import open_for_rewrite
    from ckptdoctor.ops.rewrite import metadata as metadata_write
    from ckptdoctor.ops.strip.write import strip_frozen

    source, metadata = open_for_rewrite(FIXTURES / name)
    assert source.entries
    seen: list[int] = []
    pickle_metadata = metadata_write._new_metadata

    def spy(held, edit, stage):
        seen.append(len(source.entries))
        return pickle_metadata(held, edit, stage)

    monkeypatch.setattr(metadata_write, "_new_metadata", spy)
    report = strip_frozen(source, output=tmp_path / "out", metadata=metadata)
    assert seen == [0] and report.result is not None
    stripped = open_checkpoint(tmp_path / "out")
    assert stripped.args.save_trainable_params_only is True
    assert {k for k, e in stripped.entries.items() if e.section == "model"} == {
        d.key for d in report.plan.kept if d.section == "model"
    }


@pytest.mark.parametrize("name", ["core019_peft_full_tp1", "core016_peft_full_tp1"])
def test_saved_args_say_trainable_params_only(capsys, tmp_path, name):
    """The output's args say what Megatron's --save-trainable-params-only run saves; --keep-args opts out."""
    src = open_checkpoint(FIXTURES / name)
    assert src.args.save_trainable_params_only is False
    rc, out, err = _run(capsys, "strip-frozen", FIXTURES / name, "--output", tmp_path / "out")
    assert rc == 0, err
    assert "args            save_trainable_params_only: false -> true" in out
    stripped = open_checkpoint(tmp_path / "out")
    assert stripped.args.save_trainable_params_only is True
    changed = {
        k
        for k in set(vars(src.args)) | set(vars(stripped.args))
        if getattr(src.args, k, None) != getattr(stripped.args, k, None)
    }
    assert changed == {"save_trainable_params_only"}
    assert stripped.common_state()["iteration"] == src.common_state()["iteration"]
    report = _strip(capsys, FIXTURES / name, tmp_path / "kept", "--keep-args")
    assert report["result"]["args_changed"] == []
    assert open_checkpoint(tmp_path / "kept").args.save_trainable_params_only is False
    ref = REFERENCE.get(name)
    if ref:  # what Megatron itself wrote
        assert open_checkpoint(FIXTURES / ref).args.save_trainable_params_only is True


def test_zarr_refused_before_any_plan(capsys, tmp_path):
    """A legacy zarr save has no .metadata to rewrite: the dry run refuses it as the write does, not with a plan."""
    src = FIXTURES / "core014_zarr_tp2"
    for extra in (["--dry-run"], ["-o", str(tmp_path / "out"), "--force"]):
        rc, out, err = _run(capsys, "strip-frozen", src, *extra)
        assert rc == 2 and out == "" and "not a torch_dist checkpoint" in err, extra
    assert not (tmp_path / "out").exists()


def test_no_frozen_parameters_refused_unless_force(capsys, tmp_path):
    src = FIXTURES / "core019_peft_full_tp1"
    rc, out, _ = _run(capsys, "strip-frozen", src, "--trainable", ".", "-o", tmp_path / "out")
    assert rc == 1
    assert "no frozen parameters" in out and "nothing written" in out
    assert not (tmp_path / "out").exists()
    rc, out, _ = _run(capsys, "strip-frozen", src, "--trainable", ".", "--dry-run", "--format", "json")
    assert rc == 1 and json.loads(out)["nothing_frozen"] is True
    dropped = json.loads(out)["plan"]["dropped"]
    assert dropped and all("_extra_state" in d["key"] for d in dropped)  # what --force drops, and only that
    rc, out, _ = _run(capsys, "strip-frozen", src, "--trainable", ".", "--dry-run")
    said = " ".join(out.split())
    assert "nothing to strip; --force writes a copy without the model _extra_state (the plan below)" in said
    assert "of model _extra_state dropped with --force" in said and "frozen params" not in said
    # a trainable-params-only save: no _extra_state either, so --force would write what is there
    rc, out, _ = _run(capsys, "strip-frozen", FIXTURES / "core019_peft_trainable_tp1", "-o", tmp_path / "t")
    said = " ".join(out.split())
    assert rc == 1 and "there is no model _extra_state to drop either" in said and "none dropped" in said
    assert "--force" not in said and not (tmp_path / "t").exists()
    rc, out, _ = _run(capsys, "strip-frozen", src, "--trainable", ".", "-o", tmp_path / "out", "--force")
    assert rc == 0 and "no frozen parameters" in out and (tmp_path / "out" / "iter_0000010" / ".metadata").is_file()
    report = _strip(capsys, src, tmp_path / "normal")
    assert report["nothing_frozen"] is False


def test_dry_run_and_write_report_the_same_size_before(capsys, tmp_path):
    src = FIXTURES / "core019_peft_full_tp2"
    rc, dry, _ = _run(capsys, "strip-frozen", src, "--dry-run")
    assert rc == 0
    rc, wrote, _ = _run(capsys, "strip-frozen", src, "-o", tmp_path / "out")
    assert rc == 0
    line = re.compile(r"^size before .*$", re.M)
    assert line.search(dry).group(0) == line.search(wrote).group(0)
    plan = _strip(capsys, src, tmp_path / "json")
    assert plan["plan"]["bytes_before"] == plan["result"]["source_bytes"] == _dir_bytes(src / "iter_0000010")
    estimate, written = plan["plan"]["bytes_after"], plan["result"]["output_bytes"]
    assert abs(estimate - written) <= 0.1 * written, (estimate, written)


def test_common_pt_era(capsys, tmp_path):
    name = "core016_peft_full_tp1"
    _strip(capsys, FIXTURES / name, tmp_path / "out", "--keep-args")
    out = open_checkpoint(tmp_path / "out")
    src_dir = FIXTURES / name / "iter_0000010"
    assert out.common_source == "common.pt"
    assert (out.iteration_dir / "common.pt").read_bytes() == (src_dir / "common.pt").read_bytes()
    model = {k for k, e in out.entries.items() if e.section == "model"}
    assert model == set(manifest(name)["trainable_keys"])
    src = open_checkpoint(FIXTURES / name)
    assert {k for k, e in out.entries.items() if e.section != "model"} == {
        k for k, e in src.entries.items() if e.section != "model"
    }
    assert not any(e.is_extra_state for e in out.entries.values())


# --- real megatron-core loads the result onto a fresh base model ------------------------------------------


def _load_with_mcore(stripped: Path, name: str, nproc: int) -> str:
    require_mcore()
    args = [str(LOAD_SCRIPT), str(stripped), str(FIXTURES / name)]
    if name in REFERENCE:
        args.append(str(FIXTURES / REFERENCE[name]))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if nproc == 1:
        cmd = [sys.executable, *args]
        env.pop("RANK", None)
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            *args,
        ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.mcore
@pytest.mark.parametrize(
    "name,nproc", [("core019_peft_full_tp1", 1), ("core016_peft_full_tp1", 1), ("core019_peft_full_tp2", 2)]
)
def test_megatron_loads_stripped_onto_fresh_base(capsys, tmp_path, name, nproc):
    pytest.importorskip("torch")
    _strip(capsys, FIXTURES / name, tmp_path / "out")
    stdout = _load_with_mcore(tmp_path / "out", name, nproc)
    assert stdout.count("OK rank") == nproc, stdout


# --- the three trainable sources agree --------------------------------------------------------------------


def _make_base(full: Path, out: Path) -> None:
    """A base checkpoint derived from the fixture with PyTorch DCP: frozen model weights only, one chunk per
    tensor (a different chunk layout from the TP=2 fixture's), no adapters, no optimizer."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    src = full / "iter_0000010"
    reader = dcp.FileSystemReader(str(src))
    # Only the tensors are loaded: the pickled objects (common state) would need megatron-core to unpickle.
    items = reader.read_metadata().state_dict_metadata.items()
    base = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in items
        if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.") and ".adapter." not in k
    }
    dcp.load(base, storage_reader=reader, no_dist=True)
    torch.save(base, out.parent / "base.pt")
    (out / "iter_0000010").mkdir(parents=True)
    torch_save_to_dcp(str(out.parent / "base.pt"), str(out / "iter_0000010"))
    shutil.copy(src / "metadata.json", out / "iter_0000010" / "metadata.json")
    (out / "latest_checkpointed_iteration.txt").write_text("10")


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_preset_and_base_give_the_same_result(capsys, tmp_path, name):
    pytest.importorskip("torch")
    inferred = _strip(capsys, FIXTURES / name, tmp_path / "optimizer")
    preset = _strip(capsys, FIXTURES / name, tmp_path / "preset", "--preset", "lora")
    _make_base(FIXTURES / name, tmp_path / "base")
    based = _strip(capsys, FIXTURES / name, tmp_path / "based", "--base", tmp_path / "base")
    assert preset["plan"]["trainable_source"] == "preset:lora"
    assert based["plan"]["trainable_source"] == "base"
    keys = [sorted(d["key"] for d in r["plan"]["kept"]) for r in (inferred, preset, based)]
    assert keys[0] == keys[1] == keys[2]
    digests = [_tree_digest(tmp_path / d / "iter_0000010") for d in ("optimizer", "preset", "based")]
    # byte-identical data files, whichever source chose the keys (the rewritten common state: equal args)
    data = [
        {k: v for k, v in d.items() if k.endswith(".distcp") and not k.startswith("common_state.")} for d in digests
    ]
    assert data[0] == data[1] == data[2]
    args = [vars(open_checkpoint(tmp_path / d).args) for d in ("optimizer", "preset", "based")]
    assert args[0] == args[1] == args[2]


def test_base_equal_everywhere_keeps_nothing(capsys, tmp_path):
    name = "core019_peft_full_tp1"
    rc, _, err = _run(capsys, "strip-frozen", FIXTURES / name, "-o", tmp_path / "out", "--base", FIXTURES / name)
    assert rc == 2 and "keeps no model parameter" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_base_compare_is_bitwise(tmp_path):
    """A one-ulp change in one base chunk makes that tensor 'trainable'; same-layout path, no torch needed."""
    from ckptdoctor.ops.strip.plan import trainable_from_base

    base = tmp_path / "base"
    shutil.copytree(FIXTURES / "core019_peft_full_tp2", base)
    ckpt = open_checkpoint(base)
    key = "decoder.layers.self_attention.linear_proj.weight"
    loc = ckpt.entries[key].chunks[1].storage
    path = base / "iter_0000010" / loc.relative_path
    data = bytearray(path.read_bytes())
    data[loc.offset : loc.offset + loc.length] = _flip_first_bit(bytes(data[loc.offset : loc.offset + loc.length]))
    path.write_bytes(bytes(data))
    selection = trainable_from_base(open_checkpoint(FIXTURES / "core019_peft_full_tp2"), open_checkpoint(base))
    assert key in selection.keys and selection.compared[key] == "differs"
    assert not [k for k in selection.keys if ".adapter." not in k and k != key]


def _flip_first_bit(blob: bytes) -> bytes:
    """The same torch.save blob with the lowest bit of its first storage byte flipped (CRC-32 kept valid)."""
    import io
    import zipfile
    import zlib

    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename)
    header = blob[info.header_offset : info.header_offset + 30]
    start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    end = start + info.compress_size
    payload = bytearray(blob[start:end])
    payload[0] ^= 1
    old_crc, new_crc = info.CRC.to_bytes(4, "little"), zlib.crc32(payload).to_bytes(4, "little")
    head, tail = blob[:start].replace(old_crc, new_crc), blob[end:].replace(old_crc, new_crc)
    return head + bytes(payload) + tail


# --- dry run, refusals, layouts ---------------------------------------------------------------------------


def test_dry_run_lists_keys_and_sizes_and_writes_nothing(capsys, tmp_path):
    rc, out, err = _run(
        capsys, "strip-frozen", FIXTURES / "core019_peft_full_tp2", "--dry-run", "--keys", "--output", tmp_path / "out"
    )
    assert rc == 0, err
    assert re.search(r"^keep\s+decoder\.layers\.mlp\.linear_fc1\.adapter\.linear_in\.weight", out, re.M)
    assert re.search(r"^drop\s+decoder\.layers\.mlp\.linear_fc1\.weight\s.*frozen", out, re.M)
    assert re.search(r"^drop\s+decoder\.layers\.mlp\.linear_fc1\._extra_state/shard_0_2\s.*_extra_state", out, re.M)
    assert re.search(r"^keep\s+optimizer\.state\.exp_avg\.", out, re.M)
    assert "size before" in out and "size after" in out and "nothing written" in out
    assert not (tmp_path / "out").exists()


def test_metadata_only_run_needs_no_torch_or_megatron(tmp_path):
    result = run_cli(
        "strip-frozen",
        str(FIXTURES / "core019_peft_full_tp2"),
        "-o",
        str(tmp_path / "out"),
        block=("torch", "megatron"),
    )
    assert result.returncode == 0, result.stderr
    assert "IMPORTED:\n" in result.stderr
    assert (tmp_path / "out" / "iter_0000010" / ".metadata").is_file()


def test_iteration_dir_input_writes_an_iteration_dir(capsys, tmp_path):
    _strip(capsys, FIXTURES / "core019_peft_full_tp1" / "iter_0000010", tmp_path / "out")
    assert (tmp_path / "out" / ".metadata").is_file()
    assert not (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()
    assert open_checkpoint(tmp_path / "out").section_entries("model")


def test_refuses_selection_without_model_parameter(capsys, tmp_path):
    rc, _, err = _run(
        capsys,
        "strip-frozen",
        FIXTURES / "core019_peft_full_tp1",
        "-o",
        tmp_path / "out",
        "--trainable",
        r"^no\.such\.key$",
    )
    assert rc == 2 and "keeps no model parameter" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_refuses_non_empty_output_unless_force(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = _run(capsys, "strip-frozen", FIXTURES / "core019_peft_full_tp1", "-o", out)
    assert rc == 2 and "not empty" in err and err.count("\n") == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    rc, _, err = _run(capsys, "strip-frozen", FIXTURES / "core019_peft_full_tp1", "-o", out, "--force")
    assert rc == 0, err
    assert not (out / "keep.txt").exists() and (out / "iter_0000010" / "metadata.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging or old dir left


def test_refuses_output_inside_source(capsys, copy_fixture):
    src = copy_fixture("core019_peft_full_tp1")
    before = _tree_digest(src)
    rc, _, err = _run(capsys, "strip-frozen", src, "-o", src / "stripped")
    assert rc == 2 and "--in-place" in err
    assert _tree_digest(src) == before


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_refuses_structurally_damaged_source(capsys, tmp_path, copy_fixture, damage):
    src = copy_fixture("core019_peft_full_tp2")
    data_file = src / "iter_0000010" / "__1_0.distcp"
    if damage == "missing":
        data_file.unlink()
    else:
        data_file.write_bytes(data_file.read_bytes()[:-100])
    rc, _, err = _run(capsys, "strip-frozen", src, "-o", tmp_path / "out")
    assert rc == 2 and err.count("\n") == 1 and "__1_0.distcp" in err
    assert ("CKD113" if damage == "missing" else "CKD114 truncated") in err and "refusing to strip" in err
    assert not (tmp_path / "out").exists()


def _rename_optimizer_keys(iteration_dir: Path) -> None:
    """Make the optimizer section look like the distributed optimizer's dp_reshardable buckets."""
    path = iteration_dir / ".metadata"
    metadata = torch_dist.load_metadata_object(path)
    sdm = metadata.__dict__["state_dict_metadata"]

    def new_name(key: str) -> str:
        return key.replace("optimizer.state.", "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.", 1)

    for key in [k for k in sdm if k.startswith("optimizer.state.")]:
        sdm[new_name(key)] = sdm.pop(key)
    storage = torch_dist.storage_items(metadata)
    for index in list(storage):
        if torch_dist.index_fqn(index).startswith("optimizer.state."):
            info = storage.pop(index)
            index.__dict__["fqn"] = new_name(index.__dict__["fqn"])
            storage[index] = info
    path.write_bytes(torch_dist.dump_metadata_object(metadata))


def test_dp_reshardable_optimizer_asks_for_a_selection(capsys, tmp_path, copy_fixture):
    src = copy_fixture("core019_peft_full_tp1")
    _rename_optimizer_keys(src / "iter_0000010")
    rc, _, err = _run(capsys, "strip-frozen", src, "-o", tmp_path / "out")
    assert rc == 2 and "dp_reshardable" in err and "--preset" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    report = _strip(capsys, src, tmp_path / "out", "--preset", "lora")  # the suggested way out works
    assert report["plan"]["trainable_source"] == "preset:lora"


def test_no_optimizer_asks_for_a_selection(capsys, tmp_path):
    rc, _, err = _run(capsys, "strip-frozen", FIXTURES / "core019_convert_tp4", "-o", tmp_path / "out")
    assert rc == 2 and "no optimizer state" in err and "--trainable" in err


# --- in place ---------------------------------------------------------------------------------------------


def test_in_place_swaps_and_keeps_backup(capsys, copy_fixture):
    src = copy_fixture("core019_peft_full_tp2")
    before = _tree_digest(src / "iter_0000010")
    rc, out, err = _run(capsys, "strip-frozen", src, "--in-place")
    assert rc == 0, err
    backups = [p for p in src.iterdir() if p.name.startswith("iter_0000010.bak-")]
    assert len(backups) == 1 and _tree_digest(backups[0]) == before
    stripped = open_checkpoint(src)
    assert set(stripped.entries) == set(open_checkpoint(FIXTURES / "core019_peft_trainable_tp2").entries)
    assert not [p for p in src.iterdir() if p.name.startswith(".")]


def test_in_place_no_backup(capsys, copy_fixture):
    src = copy_fixture("core019_peft_full_tp1")
    rc, _, err = _run(capsys, "strip-frozen", src, "--in-place", "--no-backup")
    assert rc == 0, err
    assert sorted(p.name for p in src.iterdir()) == ["iter_0000010", "latest_checkpointed_iteration.txt"]
    assert not any(e.is_extra_state for e in open_checkpoint(src).entries.values())


@pytest.mark.parametrize("step", ["strip-frozen:data-written", "strip-frozen:before-swap"])
def test_killed_in_place_run_leaves_source_intact(copy_fixture, step):
    src = copy_fixture("core019_peft_full_tp1")
    before = _tree_digest(src / "iter_0000010")
    result = run_cli("strip-frozen", str(src), "--in-place", env=dict(os.environ, CKPTDOCTOR_FAULT_AT=step))
    assert result.returncode == 97, result.stderr
    assert _tree_digest(src / "iter_0000010") == before
    assert len(open_checkpoint(src).section_entries("model")) == 29  # still the full checkpoint


def test_corrupt_base_chunk_is_one_line_error(capsys, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(FIXTURES / "core019_peft_full_tp1", base)
    loc = open_checkpoint(base).entries["decoder.layers.self_attention.linear_proj.weight"].chunks[0].storage
    path = base / "iter_0000010" / loc.relative_path
    data = bytearray(path.read_bytes())
    blob = _flip_first_bit(bytes(data[loc.offset : loc.offset + loc.length]))
    original = bytes(data[loc.offset : loc.offset + loc.length])
    # flip the payload bit but keep the old CRC: the record no longer matches its checksum
    diff = next(i for i in range(len(blob)) if blob[i] != original[i])
    data[loc.offset + diff] ^= 1
    path.write_bytes(bytes(data))
    rc, _, err = _run(
        capsys, "strip-frozen", FIXTURES / "core019_peft_full_tp1", "-o", tmp_path / "out", "--base", base
    )
    assert rc == 2 and err.count("\n") == 1 and "linear_proj.weight" in err, err
    assert not (tmp_path / "out").exists()


def test_in_place_swap_is_one_atomic_exchange(copy_fixture):
    """A kill right after the exchange leaves the stripped checkpoint under the iteration dir's own name and
    the complete original beside it: no moment without a checkpoint under that name."""
    import os as _os
    import subprocess as _subprocess
    import sys as _sys

    from ckptdoctor.atomic import FAULT_ENV, FAULT_EXIT_CODE
    from ckptdoctor.checkpoint import open_checkpoint as _open

    save = copy_fixture("core019_peft_full_tp1")
    require_exchange(save)  # elsewhere strip-frozen falls back to two renames and never reaches this step
    before = _open(save)
    env = dict(_os.environ, **{FAULT_ENV: "strip-frozen:after-exchange"})
    result = _subprocess.run(
        [_sys.executable, "-m", "ckptdoctor", "strip-frozen", str(save), "--in-place"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == FAULT_EXIT_CODE, result.stderr
    stripped = _open(save)
    assert set(stripped.entries) < set(before.entries)  # the stripped checkpoint is in place
    leftovers = [p for p in save.iterdir() if p.name.startswith(".") and p.is_dir()]
    assert len(leftovers) == 1  # the original, complete, under the staging name
    original = _open(leftovers[0])
    assert set(original.entries) == set(before.entries)


def _copy_case(tmp_path: Path, files: int = 3) -> tuple[Path, Path, dict]:
    """Source files of 100 distinct bytes each and kept items (SimpleNamespace records, as stand-ins are read)."""
    from types import SimpleNamespace

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    by_file = {}
    for n in range(files):
        name = f"__{n}_0.distcp"
        (src / name).write_bytes(bytes((n * 7 + i) % 256 for i in range(100)))
        spans = [(0, 10), (10, 5), (20, 10), (30, 0), (30, 5), (60, 40)]
        by_file[name] = [
            (SimpleNamespace(fqn=f"k{n}.{i}"), SimpleNamespace(relative_path=name, offset=o, length=ln))
            for i, (o, ln) in enumerate(spans)
        ]
    return src, dst, by_file


@pytest.mark.parametrize(("jobs", "process"), [(1, True), (3, True), (1, False), (3, False)])
def test_compact_copy_merges_adjacent_ranges_same_bytes(tmp_path, jobs, process):
    from ckptdoctor.formats import dcp_writer

    src, dst, by_file = _copy_case(tmp_path)
    copies = dcp_writer.plan_copies(by_file)
    assert [c.ranges for c in copies] == [[(0, 15), (20, 15), (60, 40)]] * 3  # 6 items, 3 kernel copies
    seen = []
    with dcp_writer.BackgroundCopy(src, dst, copies, seen.append, jobs, process) as copy:
        written = copy.result()
    assert sum(seen) == 3 * 70  # progress: every copied byte, from the helper process too
    assert [(f.name, f.items, f.bytes) for f in written] == [(n, 6, 70) for n in by_file]
    for name, items in by_file.items():
        data = (src / name).read_bytes()
        assert (dst / name).read_bytes() == data[0:15] + data[20:35] + data[60:100]
        # every item repointed to where its bytes now are, in the new file of the same name
        assert [(i.relative_path, i.offset, i.length) for _, i in items] == [
            (name, 0, 10),
            (name, 10, 5),
            (name, 15, 10),
            (name, 25, 0),
            (name, 25, 5),
            (name, 30, 40),
        ]


@pytest.mark.parametrize("process", [True, False])
def test_compact_copy_stops_and_joins_when_the_caller_fails(tmp_path, process):
    """An error (or Ctrl-C) in the caller while the copy runs: the helper process is killed (or every thread
    has stopped) before the exception goes on, so the caller's removal of the staging dir never races a
    writer."""
    import threading
    import time

    from ckptdoctor.formats import dcp_writer

    src, dst, by_file = _copy_case(tmp_path, files=40)
    copies = dcp_writer.plan_copies(by_file)
    started = threading.Event()

    def slow(n: int) -> None:
        started.set()
        time.sleep(0.01)

    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt), dcp_writer.BackgroundCopy(src, dst, copies, slow, 2, process) as copy:
        started.wait(5)
        raise KeyboardInterrupt
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
    if process:
        assert copy._proc is not None and copy._proc.returncode is not None  # the helper is gone
    left = sorted(p.name for p in dst.iterdir())
    if not process:
        assert len(left) < 40  # the threads stopped early (the helper may have finished 40 tiny files first)
    time.sleep(0.1)
    assert sorted(p.name for p in dst.iterdir()) == left


@pytest.mark.parametrize("process", [True, False])
def test_compact_copy_short_source_is_one_error(tmp_path, process):
    from ckptdoctor.errors import CkptError
    from ckptdoctor.formats import dcp_writer

    src, dst, by_file = _copy_case(tmp_path, files=3)
    for name in sorted(by_file)[1:]:
        (src / name).write_bytes(b"x" * 50)  # the last kept range (60+40) is past the end now
    first = sorted(by_file)[1]  # the first failure in file order is the one reported
    copies = dcp_writer.plan_copies(by_file)
    with (
        pytest.raises(CkptError, match="^" + re.escape(str(src / first)) + r": range 60\+40 ends past the file's end$"),
        dcp_writer.BackgroundCopy(src, dst, copies, None, 2, process) as copy,
    ):
        copy.result()


def test_compact_copy_helper_crash_is_one_error(tmp_path, monkeypatch):
    """A helper process that dies without its error line (a bug, a kill): one error naming its last output."""
    from ckptdoctor.errors import CkptError
    from ckptdoctor.formats import copy_worker, dcp_writer

    fake = tmp_path / "fake_worker.py"
    fake.write_text("import sys\nsys.stdin.read()\nraise RuntimeError('boom')\n")
    monkeypatch.setattr(copy_worker, "__file__", str(fake))
    src, dst, by_file = _copy_case(tmp_path, files=2)
    copies = dcp_writer.plan_copies(by_file)
    with (
        pytest.raises(CkptError, match=r"^copying the kept items failed \(RuntimeError: boom\)$"),
        dcp_writer.BackgroundCopy(src, dst, copies, None, 1) as copy,
    ):
        copy.result()


def test_compact_copy_progress_failure_raised_after_the_copy(tmp_path):
    """A failing progress callback does not stall the helper (its output is still drained) and is raised."""
    from ckptdoctor.formats import dcp_writer

    src, dst, by_file = _copy_case(tmp_path, files=5)

    def broken(n: int) -> None:
        raise ValueError("bar broke")

    with (
        pytest.raises(ValueError, match="bar broke"),
        dcp_writer.BackgroundCopy(src, dst, dcp_writer.plan_copies(by_file), broken, 2) as copy,
    ):
        copy.result()
    assert len(list(dst.iterdir())) == 5  # the copy itself completed


ITER = "iter_0000010"


@pytest.mark.parametrize("in_place", [False, True])
def test_subdirs_of_the_iteration_dir_are_carried(capsys, copy_fixture, tmp_path, in_place):
    """ModelOpt's nested modelopt_state checkpoint and Megatron-Bridge's tokenizer dir go along, file by file
    (hard links), a symlink inside as the same link; in place with --no-backup nothing of them is lost."""
    save = copy_fixture("core019_peft_full_tp1")
    src = save / ITER
    shutil.copytree(FIXTURES / "core019_tp1" / ITER, src / "modelopt_state")
    (src / "tokenizer").mkdir()
    (src / "tokenizer" / "tokenizer.json").write_text('{"model": "bpe"}')
    (src / "tokenizer" / "vocab").symlink_to("../../../shared/vocab.json")  # dangling here: carried as is
    (src / ".hydra").mkdir()  # hidden names are the user's too (only ckptdoctor's own temp and lock names are not)
    (src / ".hydra" / "config.yaml").write_text("model: gpt\n")
    (src / ".gitattributes").write_text("*.distcp filter=lfs\n")
    nested = _nested_files(src)
    assert len(nested) == 5  # modelopt_state: .metadata, metadata.json, __0_0.distcp; tokenizer.json; config.yaml
    target = ["--in-place", "--no-backup"] if in_place else ["-o", tmp_path / "out"]
    rc, out, err = run_main(capsys, "strip-frozen", save, "--preset", "lora", *target)
    assert rc == 0, out + err
    result = src if in_place else tmp_path / "out" / ITER
    assert {
        p.relative_to(result): p.read_bytes() for p in result.rglob("*") if p.is_file() and p.parent != result
    } == nested
    assert os.readlink(result / "tokenizer" / "vocab") == "../../../shared/vocab.json"
    assert (result / ".gitattributes").read_text() == "*.distcp filter=lfs\n"
    assert "not carried" not in out
    assert [f.code for f in check_paths([str(result.parent)]).findings] == []


def _nested_files(iteration_dir: Path) -> dict[Path, bytes]:
    return {p.relative_to(iteration_dir): p.read_bytes() for p in iteration_dir.rglob("*/*") if p.is_file()}


def test_a_dir_nested_deeper_than_the_recursion_limit_is_carried(capsys, copy_fixture, tmp_path):
    try:
        _deep_dir_is_carried(capsys, copy_fixture, tmp_path)
    finally:  # pytest's own clean-up of old tmp dirs uses shutil.rmtree, which recurses: leave no deep tree
        for child in tmp_path.iterdir():
            remove_tree(child, ignore_errors=True)


def _deep_dir_is_carried(capsys, copy_fixture, tmp_path):
    save = copy_fixture("core019_tp1")
    deep = save / ITER / "d"
    parts = ["a"] * (sys.getrecursionlimit() + 200)
    fd = os.open(save / ITER, os.O_RDONLY)
    try:  # made relative to a dir fd: the absolute path is past what one syscall takes
        os.mkdir("d", dir_fd=fd)
        for depth in range(1, len(parts) + 1):
            os.mkdir(os.path.join("d", *parts[:depth]), dir_fd=fd)
    finally:
        os.close(fd)
    rc, out, err = run_main(capsys, "edit", save, "--drop-section", "optimizer", "-o", tmp_path / "out")
    assert rc == 0 and "Traceback" not in err, out + err
    found = subprocess.run(["find", str(tmp_path / "out" / ITER / "d"), "-type", "d"], capture_output=True, text=True)
    assert deep.is_dir() and len(found.stdout.splitlines()) == len(parts) + 1  # every level carried
    rc, out, err = run_main(capsys, "edit", save, "--drop-section", "optimizer", "--in-place", "--no-backup")
    assert rc == 0 and "error" not in err, out + err  # the old dir, deep tree and all, is deleted without recursion
    assert sorted(p.name for p in save.iterdir()) == [ITER, "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize(
    "name, trainable",
    [("core019_tp2_dp2", "final_layernorm"), ("core019_moe_ep2", "router"), ("core019_tp2", "layernorm")],
)
def test_an_output_of_replicated_tensors_only_passes_check(capsys, tmp_path, name, trainable):
    """Kept: only tensors Megatron never splits by TP (norms, routers), each layer's written by whichever rank DCP
    gave the write. The output shows no layout: check must not derive one (it said TP=1 at a TP=2 save, PP=2 at a
    PP=1 one, and offered fix-args "corrections" that would have broken the args), and fix-args has nothing to do."""
    source = FIXTURES / name
    assert _run(capsys, "check", "--isolated", source)[0] == 0
    out = tmp_path / "out"
    _strip(capsys, source, out, "--trainable", trainable)
    rc, stdout, err = _run(capsys, "check", "--isolated", out)
    assert rc == 0 and err == "", stdout
    rc, stdout, err = _run(capsys, "fix-args", out, "--format", "json")
    assert rc == 0 and json.loads(stdout)["changes"] == [], stdout
