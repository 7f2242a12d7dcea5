"""edit on the real fixtures (no megatron-core): key changes in every part of .metadata, validation before
writing, dry run and JSON, O(metadata) hard links, --compact sizes, common state, integrity, safety."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, file_digests, run_cli
from hostile_corpus import torch_zip

from ckptdoctor.atomic import FAULT_ENV, FAULT_EXIT_CODE, FAULT_MODE_ENV
from ckptdoctor.checkpoint import open_checkpoint
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
from ckptdoctor.logical_items import logical_key
from ckptdoctor.ops.edit.presets import preset_renames

ITER = "iter_0000010"
WEIGHTS_ONLY = ["--drop-section", "optimizer", "--drop-section", "rng", "--drop-section", "rerun"]


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _edit_json(capsys, source, *args):
    rc, out, err = _run(capsys, "edit", source, *args, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


def _metadata_keys(iteration_dir: Path) -> dict[str, set[str]]:
    """Every place a .metadata names keys: state_dict_metadata, storage_data, all_local_plans, mcore_data."""
    metadata = load_metadata_object(iteration_dir / ".metadata")
    plans = record_attr(metadata, "all_local_plans") or []
    places = {
        "state_dict_metadata": set(record_attr(metadata, "state_dict_metadata")),
        "storage_data": {index_fqn(i) for i in storage_items(metadata)},
        "all_local_plans": {index_fqn(record_attr(w, "index")) for p in plans for w in record_attr(p, "items")},
    }
    mcore = [record_attr(h, "mcore_data") for h in [metadata, *plans]]
    if any(isinstance(m, dict) for m in mcore):
        places["mcore_data"] = {k for m in mcore if isinstance(m, dict) for k in m}
    return places


def _grid(iteration_dir: Path) -> dict[str, tuple]:
    """Key -> (global size, chunk offsets and sizes) of every tensor of a .metadata."""
    metadata = load_metadata_object(iteration_dir / ".metadata")
    out = {}
    for key, meta in record_attr(metadata, "state_dict_metadata").items():
        chunks = record_attr(meta, "chunks")
        if chunks is not None:
            out[key] = (
                tuple(record_attr(meta, "size")),
                tuple((tuple(record_attr(c, "offsets")), tuple(record_attr(c, "sizes"))) for c in chunks),
            )
    return out


# --- weights-only: O(metadata), common state, load flags ------------------------------------------------


def test_weights_only_edit_links_data_and_updates_common_state(capsys, tmp_path):
    src = FIXTURES / "core019_tp2"
    before = file_digests(src)
    report = _edit_json(capsys, src, *WEIGHTS_ONLY, "--output", tmp_path / "out")
    source = open_checkpoint(src)
    out = open_checkpoint(tmp_path / "out")
    expected = {k for k, e in source.entries.items() if e.section not in ("optimizer", "rng", "rerun")}
    assert set(out.entries) == expected
    places = _metadata_keys(tmp_path / "out" / ITER)
    assert all(keys == expected for keys in places.values()), places
    # O(metadata): every data file is the source's own file (same inode), nothing copied
    for name in source.data_files:
        assert os.stat(src / ITER / name).st_ino == os.stat(tmp_path / "out" / ITER / name).st_ino
    assert report["linked_files"] == len(source.data_files) and report["result"]["bytes_copied"] == 0
    common = out.common_state()
    assert not {"optimizer", "opt_param_scheduler", "rerun_state_machine"} & set(common)
    assert out.args.no_save_optim is True and out.args.no_save_rng is True
    assert common["iteration"] == source.common_state()["iteration"]
    assert report["plan"]["load_flags"] == ["--no-load-optim"]
    assert report["plan"]["dropped_sections"] == ["optimizer", "rng", "rerun"]
    assert file_digests(src) == before  # the source is untouched
    # every tensor still reads the bytes it read before (the storage entries point to the same ranges)
    for key, entry in out.entries.items():
        if entry.section == "model":
            assert entry.chunks == source.entries[key].chunks


def test_weights_only_edit_imports_no_torch(tmp_path):
    proc = run_cli("edit", str(FIXTURES / "core019_tp2"), *WEIGHTS_ONLY, "-o", str(tmp_path / "o"), block=("torch",))
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED:\n" in proc.stderr or proc.stderr.rstrip().endswith("IMPORTED:")
    assert "load flags      --no-load-optim" in proc.stdout


def test_distributed_optimizer_sharding_type_goes_with_the_optimizer(capsys, tmp_path):
    src = FIXTURES / "core019_tp2_dp2"
    assert open_checkpoint(src).common_state()["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    report = _edit_json(capsys, src, "--drop-section", "optimizer", "-o", tmp_path / "o")
    content = open_checkpoint(tmp_path / "o").common_state()["content_metadata"]
    assert "distrib_optim_sharding_type" not in content and content["chained_optim_avoid_prefix"] is True
    changes = {(c["what"], c["name"]) for c in report["plan"]["common_changes"]}
    assert ("drop-content-metadata", "distrib_optim_sharding_type") in changes


def test_common_pt_checkpoint_gets_a_new_common_pt_and_mcore_data_follows(capsys, tmp_path):
    src = FIXTURES / "core015_tp2"  # core 0.15: common.pt, MCoreMetadata with mcore_data
    _edit_json(capsys, src, "--drop-section", "optimizer", "--preset", "te-to-local", "-o", tmp_path / "o")
    out_dir = tmp_path / "o" / ITER
    assert os.stat(out_dir / "common.pt").st_ino != os.stat(src / ITER / "common.pt").st_ino
    out = open_checkpoint(tmp_path / "o")
    assert "optimizer" not in out.common_state() and out.args.no_save_optim is True
    places = _metadata_keys(out_dir)
    assert "mcore_data" in places
    assert not any(k.startswith("optimizer.") for keys in places.values() for k in keys)
    assert any(k.endswith("input_layernorm.weight") for k in places["mcore_data"])
    assert not any("layer_norm_weight" in k for keys in places.values() for k in keys)


# --- renames ----------------------------------------------------------------------------------------------


def test_rename_there_and_back_gives_the_same_key_set_and_grid(capsys, tmp_path):
    src = FIXTURES / "core019_tp2"
    there = _edit_json(capsys, src, "--preset", "te-to-local", "-o", tmp_path / "local")
    renamed = {c["key"]: c["new_key"] for c in there["plan"]["renamed"]}
    assert (
        renamed["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == "decoder.layers.input_layernorm.weight"
    )
    assert renamed["decoder.layers.mlp.linear_fc1.layer_norm_weight"] == "decoder.layers.pre_mlp_layernorm.weight"
    assert "optimizer.state.exp_avg.decoder.layers.input_layernorm.weight" in renamed.values()
    local_grid = _grid(tmp_path / "local" / ITER)
    source_grid = _grid(src / ITER)
    for old, new in renamed.items():
        assert local_grid[new] == source_grid[old]  # the chunk grid travels with the key
    _edit_json(capsys, tmp_path / "local", "--preset", "local-to-te", "-o", tmp_path / "back")
    assert _metadata_keys(tmp_path / "back" / ITER) == _metadata_keys(src / ITER)
    assert _grid(tmp_path / "back" / ITER) == source_grid


def test_rename_keeps_bytes_items_shard_suffix(capsys, tmp_path):
    src = FIXTURES / "core019_tp2"
    report = _edit_json(
        capsys, src, "--rename", r"linear_proj\._extra_state", "linear_proj._extra_state2", "-o", tmp_path / "o"
    )
    new_keys = sorted(c["new_key"] for c in report["plan"]["renamed"])
    assert new_keys == [
        "decoder.layers.self_attention.linear_proj._extra_state2/shard_0_2",
        "decoder.layers.self_attention.linear_proj._extra_state2/shard_1_2",
    ]
    out, source = open_checkpoint(tmp_path / "o"), open_checkpoint(src)
    for new in new_keys:
        old = new.replace("_extra_state2", "_extra_state")
        assert out.entries[new].chunks == source.entries[old].chunks  # same bytes, same range
        assert repr(out.read_bytes_item(new)) == repr(source.read_bytes_item(old))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--remove", "("], "--remove: invalid regex '('"),
        (["--rename", "[", "x"], "--rename: invalid regex '['"),
        (["--rename", "weight", r"\2"], "invalid replacement"),
        (["--remove", "no-such-key"], "the edit matches no key"),
        (["--rename", r"linear_proj\.weight$", "linear_qkv.weight"], "collides with an existing key that stays"),
        (["--rename", r"linear_(proj|qkv)\.weight$", "linear.weight"], "renames map two keys to"),
        (["--rename", "shard_0_2", "shard_0_3"], "changes the bytes item's shard suffix"),
        (["--rename", "^embedding", "optimizer.embedding"], "from the model section to the optimizer section"),
        (["--rename", "^common_state", "common_state2"], "the common state keeps its key"),
        (["--remove", "common_state"], "would remove the common state"),
        (["--remove", "^(embedding|decoder|output_layer)"], "removes every model key"),
        (["--preset", "local-to-te"], "the edit matches no key"),  # a TE-named checkpoint: nothing to rename
    ],
)
def test_bad_edits_are_refused_before_writing(capsys, tmp_path, args, message):
    rc, out, err = _run(capsys, "edit", FIXTURES / "core019_tp2", *args, "-o", tmp_path / "o")
    assert rc == 2 and message in err, err
    assert "Traceback" not in err and "internal error" not in err and out == ""
    assert not (tmp_path / "o").exists()


def test_usage_errors(capsys, tmp_path):
    src = FIXTURES / "core019_tp2"
    rc, _, err = _run(capsys, "edit", src, "-o", tmp_path / "o")
    assert rc == 2 and "nothing to do" in err
    rc, _, err = _run(capsys, "edit", src, "--remove", "x", "-o", tmp_path / "o", "--in-place")
    assert rc == 2 and "not both" in err
    rc, _, err = _run(capsys, "edit", src, "--drop-section", "model", "--dry-run")
    assert rc == 2 and "model" in err
    rc, _, err = _run(capsys, "edit", src, *WEIGHTS_ONLY, "-o", src / ITER / "inside")
    assert rc == 2 and "inside the source checkpoint" in err
    assert not (src / ITER / "inside").exists()
    rc, _, err = _run(capsys, "edit", FIXTURES / "core014_zarr_tp2", "--drop-extra-state", "-o", tmp_path / "z")
    assert rc == 2 and "not a torch_dist checkpoint" in err and not (tmp_path / "z").exists()


# --- dry run, JSON ----------------------------------------------------------------------------------------


def test_dry_run_lists_every_change_in_text_and_json(capsys, tmp_path):
    src = FIXTURES / "core019_tp2"
    before = file_digests(src)
    args = ["--drop-extra-state", "--remove", "^output_layer", "--preset", "te-to-local", "--dry-run", "--keys"]
    rc, text, err = _run(capsys, "edit", src, *args)
    assert rc == 0, err
    report = _edit_json(capsys, src, *args)
    assert report["dry_run"] is True and report["result"] is None
    source = open_checkpoint(src)
    extra = {k for k in source.entries if "_extra_state" in k}
    removed = {c["key"] for c in report["plan"]["removed"]}
    assert removed == extra | {"output_layer.weight"}
    assert {c["reason"] for c in report["plan"]["removed"] if c["key"] in extra} == {"--drop-extra-state"}
    renamed = report["plan"]["renamed"]
    assert len(renamed) == 6 and all(c["reason"] == "--preset te-to-local" for c in renamed)
    for change in report["plan"]["removed"] + renamed:
        assert change["key"] in text
    for change in renamed:
        assert change["new_key"] in text
    assert "dry run         nothing written" in text
    assert report["plan"]["kept_entries"] == len(source.entries) - len(removed)
    kept = {logical_key(k, e.kind) for k, e in source.entries.items() if k not in removed}
    assert report["plan"]["kept_keys"] == len(kept) < report["plan"]["kept_entries"]  # shards are one key
    assert report["plan"]["load_flags"] == []
    assert any("model keys removed" in n for n in report["plan"]["load_notes"])
    assert file_digests(src) == before


# --- --compact --------------------------------------------------------------------------------------------


def test_compact_holds_exactly_the_kept_bytes(capsys, tmp_path):
    src = FIXTURES / "core019_tp2"
    report = _edit_json(capsys, src, *WEIGHTS_ONLY, "--drop-extra-state", "--compact", "-o", tmp_path / "o")
    out_dir = tmp_path / "o" / ITER
    source = open_checkpoint(src)
    removed = {c["key"] for c in report["plan"]["removed"]}
    kept_bytes = sum(e.nbytes for k, e in source.entries.items() if k not in removed)
    assert report["plan"]["bytes_kept"] == kept_bytes
    distcp = {p.name: p.stat().st_size for p in out_dir.glob("__*.distcp")}
    out = open_checkpoint(tmp_path / "o")
    referenced = {}
    for entry in out.entries.values():
        for chunk in entry.chunks:
            referenced[chunk.storage.relative_path] = (
                referenced.get(chunk.storage.relative_path, 0) + chunk.storage.length
            )
    # the rank files hold exactly the kept items (the common state is rewritten into its own small file)
    common_len = out.entries["common_state/shard_0_1"].nbytes
    assert sum(distcp.values()) == kept_bytes - source.entries["common_state/shard_0_1"].nbytes
    assert {n: referenced[n] for n in distcp} == distcp
    assert referenced["common_state.edit.distcp"] == common_len == (out_dir / "common_state.edit.distcp").stat().st_size
    assert report["copied_files"] == len(distcp) and report["linked_files"] == 0
    for key, entry in out.entries.items():  # the same bytes as in the source, item by item
        if entry.kind == "tensor":
            a, b = entry.chunks[0].storage, source.entries[key].chunks[0].storage
            assert (out_dir / a.relative_path).read_bytes()[a.offset : a.offset + a.length] == (
                src / ITER / b.relative_path
            ).read_bytes()[b.offset : b.offset + b.length]


# --- safety: in place, integrity, unsafe pickles, interrupts, lock ---------------------------------------


def test_in_place_keeps_a_backup(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    before = file_digests(save / ITER)
    report = _edit_json(capsys, save, "--drop-extra-state", "--in-place")
    backup = Path(report["result"]["backup"])
    assert backup.parent == save and file_digests(backup) == before
    assert not any("_extra_state" in k for k in open_checkpoint(save).entries)
    rc, _, err = _run(capsys, "check", save)
    assert rc == 0, err


@pytest.mark.parametrize("compact", [False, True])
def test_integrity_manifest_stays_consistent(capsys, copy_fixture, tmp_path, compact):
    save = copy_fixture("core019_tp2")
    rc, _, err = _run(capsys, "seal", save)
    assert rc == 0, err
    extra = ["--compact"] if compact else []
    report = _edit_json(capsys, save, *WEIGHTS_ONLY, *extra, "-o", tmp_path / "o")
    assert report["result"]["resealed"] is True
    out_dir = tmp_path / "o" / ITER
    listed = json.loads((out_dir / "integrity.json").read_text())["files"]
    actual = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out_dir.iterdir() if p.name != "integrity.json"
    }
    assert listed == actual
    rc, _, err = _run(capsys, "check", tmp_path / "o")
    assert rc == 0, err


def test_unsafe_pickle_is_refused_unless_the_edit_removes_it(capsys, copy_fixture, tmp_path):
    save = copy_fixture("core019_tp1")
    it = save / ITER
    path = it / ".metadata"
    metadata = load_metadata_object(path)
    info = next(info for index, info in storage_items(metadata).items() if index_fqn(index).startswith("rng_state"))
    blob = torch_zip(b"\x80\x02ctorch\nos.system\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.")
    data_file = it / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)
    set_storage(info, StorageLocation(info.relative_path, offset, len(blob)))
    path.write_bytes(dump_metadata_object(metadata))
    rc, _, err = _run(capsys, "edit", save, "--drop-extra-state", "-o", tmp_path / "o")
    assert rc == 1 and "refusing" in err and "rng_state" in err and "CKD401" in err, err  # the gate: exit 1
    assert not (tmp_path / "o").exists()
    # removing the unsafe item is what the user may want: only the items the output keeps are gated
    for extra in ([], ["--compact"]):
        out = tmp_path / f"no-rng{len(extra)}"
        rc, _, err = _run(capsys, "edit", save, "--drop-section", "rng", *extra, "-o", out)
        assert rc == 0, err
        assert not any(k.startswith("rng_state") for k in open_checkpoint(out).entries)


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptdoctor", *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize(
    "step", ["edit:staging-created", "edit:data-written", "edit:before-swap", "edit:before-exchange"]
)
def test_killed_in_place_edit_leaves_the_source_loadable(copy_fixture, step):
    save = copy_fixture("core019_tp2")
    before = file_digests(save / ITER)
    proc = _cli("edit", save, *WEIGHTS_ONLY, "--in-place", env=dict(os.environ, **{FAULT_ENV: step}))
    assert proc.returncode == FAULT_EXIT_CODE, proc.stderr
    assert file_digests(save / ITER) == before  # the original is still under its name, byte for byte
    check = _cli("check", save)
    assert "CKD" in check.stdout  # the leftover staging dir is reported, with what to do about it
    again = _cli("edit", save, *WEIGHTS_ONLY, "--in-place")
    assert again.returncode == 2 and "interrupted" in again.stderr.lower(), again.stderr


def test_ctrl_c_before_swap_removes_the_staging_dir(copy_fixture, tmp_path):
    save = copy_fixture("core019_tp2")
    env = dict(os.environ, **{FAULT_ENV: "edit:before-swap", FAULT_MODE_ENV: "sigint"})
    proc = _cli("edit", save, "--drop-extra-state", "-o", tmp_path / "o", env=env)
    assert proc.returncode == 130, proc.stderr
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".o")]


def test_second_writer_fails_at_once(copy_fixture):
    save = copy_fixture("core019_tp2")
    env = dict(os.environ, **{FAULT_ENV: "edit:before-swap", FAULT_MODE_ENV: "sleep", "CKPTDOCTOR_FAULT_SLEEP": "4"})
    first = subprocess.Popen(
        [sys.executable, "-m", "ckptdoctor", "edit", str(save), "--drop-extra-state", "--in-place"],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert "fault point edit:before-swap" in first.stderr.readline()
        second = _cli("edit", save, "--drop-section", "rng", "--in-place")
        assert second.returncode == 2 and "holds the lock" in second.stderr, second.stderr
    finally:
        first.communicate(timeout=60)
    assert first.returncode == 0
    assert not any("_extra_state" in k for k in open_checkpoint(save).entries)


def _renamed(preset: str, keys: list[str]) -> list[str]:
    renames = preset_renames(preset, keys)
    return [renames.get(k, k) for k in keys]


def test_presets_are_inverse_in_dense_layers():
    te = [
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.self_attention.linear_qkv.weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_bias",
        "decoder.layers.mlp.linear_fc1.weight",
        "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.layer_norm_bias",
    ]
    local = _renamed("te-to-local", te)
    assert local == [
        "decoder.layers.input_layernorm.weight",
        "decoder.layers.self_attention.linear_qkv.weight",
        "decoder.layers.pre_mlp_layernorm.bias",
        "decoder.layers.mlp.linear_fc1.weight",
        "optimizer.state.exp_avg.decoder.layers.pre_mlp_layernorm.bias",  # follows its model key
    ]
    assert _renamed("local-to-te", local) == te
    assert preset_renames("te-to-local", local) == {} and preset_renames("local-to-te", te) == {}


def test_local_to_te_names_each_layers_norms_as_the_te_spec_does():
    """The TE spec keeps a MoE layer's pre-MLP norm as a module (pre_mlp_layernorm.*), fuses a dense layer's into
    linear_fc1, and fuses the input norm only into a linear_qkv (tests/test_edit_mcore.py checks the rule against
    megatron-core's TE spec itself)."""
    keys = [
        # a dense layer and a MoE layer of one per-layer model, with module names (te-to-local's output)
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.1.pre_mlp_layernorm.weight",
        "decoder.layers.1.mlp.router.weight",
        # a MoE layer saved by the local spec's keys map: its pre-MLP norm under the fused name
        "decoder.layers.2.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.2.mlp.router.weight",
        # an MLA layer: no linear_qkv, its input norm stays a module
        "decoder.layers.3.input_layernorm.weight",
        "decoder.layers.3.self_attention.linear_q_proj.weight",
        # optimizer states follow their model keys, whether or not the layer's other states are there
        "optimizer.state.exp_avg.decoder.layers.1.pre_mlp_layernorm.weight",
        "optimizer.state.exp_avg.decoder.layers.0.pre_mlp_layernorm.weight",
        # a norm of no known layer is left alone
        "encoder.pre_mlp_layernorm.weight",
    ]
    assert preset_renames("local-to-te", keys) == {
        "decoder.layers.0.input_layernorm.weight": "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.1.input_layernorm.weight": "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.2.mlp.linear_fc1.layer_norm_weight": "decoder.layers.2.pre_mlp_layernorm.weight",
        "optimizer.state.exp_avg.decoder.layers.0.pre_mlp_layernorm.weight": (
            "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
        ),
    }


def test_release_checkpoint_needs_no_load_flag_for_dropped_optimizer(capsys, tmp_path):
    """load_checkpoint restores neither the optimizer nor the rng state of a release checkpoint: no flag needed."""
    import shutil

    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "core019_tp1" / "iter_0000010", save / "release")
    (save / "latest_checkpointed_iteration.txt").write_text("release")
    report = _edit_json(capsys, save, "--drop-section", "optimizer", "--drop-section", "rng", "--dry-run")
    assert report["plan"]["load_flags"] == []
    assert any("release checkpoint" in note for note in report["plan"]["load_notes"])


def test_removed_model_keys_do_not_claim_a_plain_load_works(capsys, tmp_path):
    """No Megatron-LM flag makes a model that requests removed keys load: the report says so, not 'a plain load'."""
    rc, out, err = _run(capsys, "edit", FIXTURES / "core019_tp1", "--remove", "_extra_state", "--dry-run")
    assert rc == 0, err
    assert "a plain load works" not in out and "model keys removed" in out
    assert "load flags      none certain: see below" in out  # not "none" beside a note that a load fails
    rc, out, err = _run(capsys, "edit", FIXTURES / "core019_tp1", "--drop-section", "optimizer", "--dry-run")
    assert rc == 0 and "load flags      --no-load-optim" in out
