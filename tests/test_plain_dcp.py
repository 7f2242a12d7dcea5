"""Plain PyTorch DCP checkpoints (no metadata.json) are read as the ``dcp`` backend, their flavour named:
Megatron-LM ``--ckpt-format torch_dcp`` (fixtures/generate.py --backend torch_dcp), FSDP2 / TorchTitan
(fixtures/make_plain_dcp.py: ``fully_shard`` on 2 gloo ranks, ``step-N`` dirs, and the same state saved from one
rank). They are never taken for an interrupted torch_dist save whose metadata.json repair would write (Megatron-LM
would then read the dir as torch_dist): the write commands refuse them in one line."""

from __future__ import annotations

import json
import os
import shutil

import jsonschema
import pytest
from conftest import FIXTURES, file_digests, run_cli, run_main, shipped_schema

from ckptdoctor.ops.check import check_paths

DCP = FIXTURES / "dcp"
TORCH_DCP = DCP / "core019_mlm_torch_dcp_tp1"
ITER = "iter_0000010"
TITAN = DCP / "fsdp2_titan_ws2"  # step-5 and step-10, world size 2
TITAN_WS1 = DCP / "fsdp2_titan_ws1" / "step-10"  # the step-10 state saved from one rank
# megatron-core's GPT under Megatron's torch-FSDP2 wrapper at DP=2, saved as Megatron-LM's torch_dcp saves it
MLM_FSDP2 = DCP / "core019_mlm_torch_dcp_fsdp2_dp2"


def _json(capsys, *args: object) -> dict:
    rc, out, err = run_main(capsys, *args, "--format", "json")
    assert rc in (0, 1), err
    doc = json.loads(out)
    jsonschema.Draft202012Validator(shipped_schema(args[0])).validate(doc)
    return doc


def test_inspect_names_the_fsdp2_flavour_and_its_uneven_shards(capsys):
    rc, out, _ = run_main(capsys, "inspect", TITAN)
    assert rc == 0
    assert "format          FSDP2 / TorchTitan (plain PyTorch DCP, no metadata.json)" in out
    assert f"checkpoint      {TITAN / 'step-10'}" in out  # the newest step of the save dir
    assert "saved layout    world size 2: 27 tensors sharded on dim 0, 9 whole; 12 uneven (model.norm.bias 3+2" in out
    doc = _json(capsys, "inspect", TITAN)
    assert doc["format"]["backend"] == "dcp" and doc["format"]["flavour"] == "fsdp2"
    assert doc["iteration"] == 10 and doc["layout"]["writer_ranks"] == [0, 1]
    sharding = doc["layout"]["sharding"]
    assert sharding["world_size"] == 2 and sharding["shard_dims"] == {"0": 27}
    assert {"key": "model.proj.weight", "dim": 0, "sizes": [3, 2]} in sharding["uneven"]
    assert {"key": "model.layers.0.weight", "dim": 0, "sizes": [4, 4]} not in sharding["uneven"]
    sections = doc["sections"]
    assert sections["model"]["tensors"] == 9 and sections["optimizer"]["keys"] == 40
    assert sections["other"]["keys"] == 11  # train_state, lr_scheduler, one dataloader entry per rank


def test_inspect_of_one_rank_and_of_megatron_torch_dcp(capsys):
    doc = _json(capsys, "inspect", TITAN_WS1)
    assert doc["layout"]["sharding"] == {"world_size": 1, "sharded": 0, "whole": 36, "shard_dims": {}, "uneven": []}
    rc, out, _ = run_main(capsys, "inspect", TORCH_DCP)
    assert rc == 0 and "format          Megatron-LM torch_dcp (plain PyTorch DCP, no metadata.json)" in out
    assert "tensor_model_parallel_size=1" in out and "ckpt_format=torch_dcp" in out  # args read from the state dict
    doc = _json(capsys, "inspect", TORCH_DCP)
    assert doc["format"]["flavour"] == "torch_dcp" and doc["format"]["common_source"] == "args"
    assert doc["iteration"] == 10 and doc["format"]["checkpoint_version"] == 3.0
    assert doc["sections"]["rng"]["keys"] == 7 and doc["sections"]["model"]["tensors"] == 15


def test_megatron_torch_fsdp2_save_at_dp2(capsys):
    """Megatron-LM's torch_dcp save of a DP=2 torch-FSDP2 run: every parameter (and its Adam moments) a DTensor
    sharded on dim 0 over the 2 ranks; the args say so; it reads back at world size 1; against the TP=1 one-rank
    save of the same seed the keys and global shapes are equal and only the layout and the trained values differ
    (each DP rank trained on its own micro-batch)."""
    rc, out, _ = run_main(capsys, "inspect", MLM_FSDP2)
    assert rc == 0 and "format          Megatron-LM torch_dcp (plain PyTorch DCP, no metadata.json)" in out
    assert "saved layout    world size 2: 45 tensors sharded on dim 0, 20 whole" in out
    assert "data_parallel_size=2" in out and "ckpt_format=torch_dcp" in out
    doc = _json(capsys, "inspect", MLM_FSDP2)
    assert doc["format"]["flavour"] == "torch_dcp" and doc["iteration"] == 10
    sharding = doc["layout"]["sharding"]
    assert sharding["world_size"] == 2 and sharding["shard_dims"] == {"0": 45} and sharding["uneven"] == []
    assert doc["layout"]["writer_ranks"] == [0, 1]
    rc, out, _ = run_main(capsys, "check", "--deep", MLM_FSDP2)
    assert rc == 0 and "All checks passed" in out, out
    doc = _json(capsys, "diff", "--values", TORCH_DCP, MLM_FSDP2)
    assert all(not keys["only_a"]["count"] and not keys["only_b"]["count"] for keys in doc["keys"].values())
    assert doc["values"]["different"] > 0 and doc["values"]["not_compared"] == 0
    rc, out, _ = run_main(capsys, "diff", TORCH_DCP, MLM_FSDP2)
    assert "model.decoder.layers.0.mlp.linear_fc1.weight: 1 chunk of [128, 32] -> 2 chunks of [64, 32]" in out
    assert "data_parallel_size: 1 -> 2" in out and "use_torch_fsdp2: true (only in B)" in out
    doc = _json(capsys, "can-load", MLM_FSDP2, "--target", "world=1")
    assert doc["will_load"] and doc["saved"]["world"] == 2 and doc["target"]["world"] == 1
    assert {s["section"]: s["verdict"] for s in doc["sections"]}["model"] == "reshards"


@pytest.mark.parametrize("path", [TITAN, TITAN / "step-5", TITAN_WS1, TORCH_DCP, MLM_FSDP2])
def test_check_passes_clean_saves(capsys, path):
    rc, out, _ = run_main(capsys, "check", "--deep", path)
    assert rc == 0 and "All checks passed" in out, out


def test_check_all_steps_and_no_tracker_finding(capsys):
    rc, out, _ = run_main(capsys, "check", "--all-iterations", TITAN)
    assert rc == 0 and "All checks passed (2 checkpoints)" in out  # TorchTitan keeps no tracker: no CKD122


@pytest.mark.parametrize(
    ("damage", "code"),
    [("missing", "CKD113"), ("truncated", "CKD114")],
)
def test_check_finds_a_lost_data_file(capsys, tmp_path, damage, code):
    save = tmp_path / "titan"
    shutil.copytree(TITAN, save)
    data = save / "step-10" / "__1_0.distcp"
    if damage == "missing":
        data.unlink()
    else:
        os.truncate(data, data.stat().st_size - 4096)
    findings = check_paths([str(save)]).findings
    assert code in [f.code for f in findings]
    assert any(f.code == code and "__1_0.distcp" in f"{f.path} {f.message}" for f in findings)
    rc, out, _ = run_main(capsys, "check", save)
    assert rc == 1 and code in out


def test_diff_across_world_sizes(capsys):
    rc, out, _ = run_main(capsys, "diff", TITAN, TITAN_WS1)
    assert rc == 1
    assert "only in A  dataloader.dp_rank_1" in out  # TorchTitan's per-rank dataloader state
    assert "model.proj.weight: 2 chunks -> 1 chunk of [5, 8]" in out
    assert "layout  A: world size 2: 27 tensors sharded on dim 0" in out
    doc = _json(capsys, "diff", "--values", TITAN, TITAN_WS1)
    values = doc["values"]
    assert values["compared"] > 0 and values["different"] == 0 and values["equal"] == values["compared"]


def test_show_a_sharded_key_and_a_saved_arg(capsys):
    rc, out, _ = run_main(capsys, "show", TITAN, "model.proj.weight")
    assert rc == 0 and "global shape    5x8" in out and "chunk grid      2 x 1" in out
    assert "(3, 0)     2x8      __1_0.distcp" in out
    rc, out, _ = run_main(capsys, "show", TORCH_DCP, "args.lr")
    assert rc == 0 and "value           0.001" in out


def test_latest_good_and_history_over_step_dirs(capsys, tmp_path):
    rc, out, _ = run_main(capsys, "latest-good", TITAN)
    assert rc == 0 and out.strip() == str(TITAN / "step-10")
    rc, out, _ = run_main(capsys, "history", TITAN)
    assert rc == 0 and "2 iteration dirs: 2 good" in out and "latest good: 10" in out
    save = tmp_path / "titan"
    shutil.copytree(TITAN, save)
    (save / "step-10" / "__0_0.distcp").unlink()
    rc, out, _ = run_main(capsys, "latest-good", save)
    assert rc == 0 and out.strip() == str(save / "step-5")
    doc = _json(capsys, "history", save)
    assert [(row["iteration"], row["status"]) for row in doc["iterations"]] == [(10, "broken"), (5, "good")]


def test_iteration_option_picks_a_step_dir(capsys):
    doc = _json(capsys, "inspect", TITAN, "--iteration", "5")
    assert doc["iteration_dir"] == str(TITAN / "step-5") and doc["iteration"] == 5


@pytest.mark.parametrize("path", [TORCH_DCP, TITAN])
def test_write_commands_refuse_in_one_line(capsys, tmp_path, path):
    save = tmp_path / "save"
    shutil.copytree(path, save)
    before = file_digests(save)
    for command in (
        ["strip-frozen", "--dry-run"],
        ["fix-args", "--in-place"],
        ["seal"],
        ["repair", "--in-place"],
        ["can-load", "--suggest"],
    ):
        rc, out, err = run_main(capsys, command[0], save, *command[1:])
        assert rc == 2 and "(plain PyTorch DCP, no metadata.json)" in err, (command, out, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert file_digests(save) == before and not list(save.rglob("metadata.json"))


@pytest.mark.parametrize("name", ["core019_tp2", "core016_tp2"])
def test_an_interrupted_torch_dist_save_stays_one(tmp_path, name):
    """Without metadata.json a torch_dist save (common state in a common_state item or common.pt) is still CKD101."""
    save = tmp_path / name
    shutil.copytree(FIXTURES / name, save)
    (save / ITER / "metadata.json").unlink()
    assert [f.code for f in check_paths([str(save)]).findings] == ["CKD101"]


def test_read_without_torch():
    for path in (TORCH_DCP, TITAN):
        result = run_cli("check", str(path), block=("torch", "megatron"))
        assert result.returncode == 0 and "All checks passed" in result.stdout and "IMPORTED:\n" in result.stderr


def test_check_names_the_tensors_a_local_tensor_save_lost(capsys):
    """TP=2 torch_dcp of per-rank local tensors (fixtures/generate.py past Megatron-LM's refusal): each split model
    tensor keeps one rank's shard; the saved args say what the whole tensor is (CKD222)."""
    local = DCP / "core019_mlm_torch_dcp_tp2_local"
    findings = check_paths([str(local)]).findings
    assert {f.code for f in findings} == {"CKD222"}
    lost = sorted(f.message.split(":", 1)[0] for f in findings)
    assert lost == sorted(
        [
            "model.embedding.word_embeddings.weight",
            "model.output_layer.weight",
            *(
                f"model.decoder.layers.{i}.{name}.weight"
                for i in (0, 1)
                for name in (
                    "self_attention.linear_qkv",
                    "self_attention.linear_proj",
                    "mlp.linear_fc1",
                    "mlp.linear_fc2",
                )
            ),
        ]
    )
    qkv = next(f for f in findings if f.message.startswith("model.decoder.layers.0.self_attention.linear_qkv.weight"))
    assert "saved shape [48, 32], the args imply [96, 32] (dim 0: 48 of 96)" in qkv.message
    rc, out, _ = run_main(capsys, "check", local)
    assert rc == 1 and "CKD222" in out
    assert [f.code for f in check_paths([str(TORCH_DCP)]).findings] == []  # the TP=1 save holds whole tensors


def _dcp_save(directory, state: dict) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` from one process (the writer every flavour uses)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def test_fsdp_dtensor_flavour_from_its_swiglu_split_keys_and_from_its_args(capsys, tmp_path):
    """Megatron-FSDP's fsdp_dtensor (megatron-core's fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict splits
    SwiGLU fc1 into ``<name>_w``/``<name>_v``); Megatron-FSDP needs CUDA, so the state dict follows its key
    conventions and is saved by torch's own DCP writer."""
    import argparse

    import torch

    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    model = {
        f"{fc1}_w": torch.ones(4, 8),
        f"{fc1}_v": torch.ones(4, 8),
        "decoder.layers.0.mlp.linear_fc2.weight": torch.ones(8, 4),
    }
    args = argparse.Namespace(hidden_size=8, swiglu=True, ckpt_format="torch_dist")
    _dcp_save(tmp_path / "split" / ITER, {"args": args, "iteration": 10, "model": model})
    doc = _json(capsys, "inspect", tmp_path / "split" / ITER)
    assert doc["format"]["flavour"] == "fsdp_dtensor" and doc["iteration"] == 10
    assert "Megatron-FSDP fsdp_dtensor" in doc["format"]["era"] and doc["sections"]["model"]["tensors"] == 3
    args = argparse.Namespace(hidden_size=8, swiglu=False, ckpt_format="fsdp_dtensor")
    plain = {"decoder.layers.0.mlp.linear_fc1.weight": torch.ones(4, 8)}
    _dcp_save(tmp_path / "args" / ITER, {"args": args, "iteration": 10, "model": plain})
    assert _json(capsys, "inspect", tmp_path / "args" / ITER)["format"]["flavour"] == "fsdp_dtensor"


def test_a_generic_dcp_save(capsys, tmp_path):
    import torch

    _dcp_save(tmp_path / "ckpt", {"encoder": {"weight": torch.ones(3, 2)}, "epoch": 4})
    doc = _json(capsys, "inspect", tmp_path / "ckpt")
    assert doc["format"]["flavour"] == "generic" and doc["format"]["backend"] == "dcp"
    assert doc["sections"]["model"]["keys"] == 2  # no model. prefix: every key is the model's
    rc, out, _ = run_main(capsys, "check", "--deep", tmp_path / "ckpt")
    assert rc == 0, out


def test_can_load_at_another_world_size_follows_dcp_resharding(capsys):
    """DCP reads any world size by global shape (the uneven 3 + 2 shards too); TorchTitan's per-rank dataloader
    entries do not reshard."""
    doc = _json(capsys, "can-load", TITAN, "--target", "world=4")
    assert doc["will_load"] and doc["backend"] == "dcp" and doc["saved"]["world"] == 2 and doc["target"]["world"] == 4
    verdicts = {s["section"]: s["verdict"] for s in doc["sections"]}
    assert verdicts == {"model": "reshards", "optimizer": "reshards", "other": "skipped"}
    assert any("ranks 2..3 find no entry" in w for w in doc["warnings"])
    doc = _json(capsys, "can-load", TITAN, "--target", "world=2")
    assert {s["verdict"] for s in doc["sections"]} == {"loads"} and not doc["warnings"]
    rc, out, _ = run_main(capsys, "can-load", TITAN_WS1, "--target", "world=2")
    assert rc == 0 and "model      reshards" in out and "verdict: LOADS" in out
    rc, _, err = run_main(capsys, "can-load", TITAN, "--target", "tp=2")
    assert rc == 2 and "a plain DCP save takes world=N" in err


def test_can_load_fails_where_the_chunks_lost_a_part(capsys, tmp_path):
    """A chunk dropped from .metadata (one rank's plan lost) leaves a tensor no world size can read whole."""
    from ckptdoctor.formats.torch_dist import dump_metadata_object, load_metadata_object, record_attr

    save = tmp_path / "titan"
    shutil.copytree(TITAN, save)
    metadata_path = save / "step-10" / ".metadata"
    metadata = load_metadata_object(metadata_path)
    proj = record_attr(metadata, "state_dict_metadata")["model.proj.weight"]
    record_attr(proj, "chunks").pop()
    metadata_path.write_bytes(dump_metadata_object(metadata))
    doc = _json(capsys, "can-load", save, "--target", "world=1")
    assert not doc["will_load"] and doc["failing_sections"] == ["model"]
    model = next(s for s in doc["sections"] if s["section"] == "model")
    assert model["why"].startswith("model.proj.weight:")


def test_edit_writes_plain_dcp_that_torch_loads(capsys, tmp_path):
    """edit on a plain DCP save: O(metadata), no metadata.json and no tracker written (Megatron would read the dir
    as torch_dist; TorchTitan keeps none), renamed keys unflatten to their new path, and torch's own DCP reads it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    rc, out, err = run_main(capsys, "edit", TITAN, "--drop-section", "optimizer", "-o", tmp_path / "noopt")
    assert rc == 0, err
    written = tmp_path / "noopt" / "step-10"
    assert sorted(p.name for p in (tmp_path / "noopt").iterdir()) == ["step-10"]
    assert not (written / "metadata.json").exists() and "load flags      none" in out
    doc = _json(capsys, "inspect", written)
    assert doc["format"]["flavour"] == "fsdp2" and doc["sections"]["optimizer"]["keys"] == 0
    assert doc["layout"]["sharding"]["world_size"] == 2
    # torch reads the edited 2-rank save from one process (resharded) and finds the 1-rank save's values
    model = {k: torch.empty(v) for k, v in _shapes(TITAN_WS1).items() if k.startswith("model.")}
    state = {"model": {k.removeprefix("model."): v for k, v in model.items()}}
    dcp.load(state, checkpoint_id=str(written), no_dist=True)
    whole = _torch_save(dcp_to_torch_save, TITAN_WS1, tmp_path / "ws1.pt")
    assert all(torch.equal(state["model"][k], v) for k, v in whole["model"].items())

    rc, _, err = run_main(
        capsys, "edit", TITAN_WS1, "--rename", r"^model\.proj\.", "model.head.", "-o", tmp_path / "ren"
    )
    assert rc == 0, err
    renamed = _torch_save(dcp_to_torch_save, tmp_path / "ren", tmp_path / "ren.pt")
    assert torch.equal(renamed["model"]["head.weight"], whole["model"]["proj.weight"])
    assert "proj.weight" not in renamed["model"]


def _shapes(path) -> dict:
    from ckptdoctor.checkpoint import open_checkpoint

    return {k: tuple(e.shape) for k, e in open_checkpoint(path).entries.items() if e.kind == "tensor" and e.shape}


def _torch_save(convert, source, target) -> dict:
    """torch's own ``dcp_to_torch_save`` of a save ckptdoctor wrote or read, loaded back (values only)."""
    import torch

    convert(str(source), str(target))
    return torch.load(target, weights_only=True)


_TORCH_DCP_LOAD = """
import sys, torch, torch.distributed.checkpoint as dcp
source, edited = sys.argv[1], sys.argv[2]
heads = []
for path in (source, edited):  # Megatron-LM's torch_dcp load: args and iteration first
    head = {"args": None, "iteration": None}
    dcp.load(head, checkpoint_id=path, no_dist=True)
    heads.append(head)
(a, b) = (vars(h["args"]) for h in heads)
assert heads[1]["iteration"] == heads[0]["iteration"] == 10
assert b["no_save_optim"] is True and b["no_save_rng"] is True and a["no_save_optim"] is False
assert {k: v for k, v in a.items() if k not in ("no_save_optim", "no_save_rng")} == {
    k: v for k, v in b.items() if k not in ("no_save_optim", "no_save_rng")
}
reader = dcp.FileSystemReader(edited)
meta = reader.read_metadata().state_dict_metadata
tensors = {k: m for k, m in meta.items() if k.startswith("model.") and hasattr(m, "size")}
model = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in tensors.items()}
dcp.load(model, checkpoint_id=edited, no_dist=True)
whole = {k: torch.empty_like(v) for k, v in model.items()}
dcp.load(whole, checkpoint_id=source, no_dist=True)
assert all(torch.equal(model[k], whole[k]) for k in model)
assert not any(k.startswith(("optimizer.", "opt_param_scheduler.", "rng_state.")) for k in meta)
print("loaded", len(model), "model tensors")
"""


@pytest.mark.mcore
def test_edit_of_a_megatron_torch_dcp_save_rewrites_its_args(capsys, tmp_path):
    """Dropping the optimizer and rng sections of a Megatron-LM torch_dcp save rewrites the state dict's ``args``
    item (the one pickle writer fix-args uses) as a --no-save-optim --no-save-rng run saves it, and removes the
    scheduler with the optimizer; torch's own DCP load reads the new args and the unchanged model."""
    import subprocess
    import sys

    out_dir = tmp_path / "out"
    rc, out, err = run_main(
        capsys, "edit", TORCH_DCP, "--drop-section", "optimizer", "--drop-section", "rng", "-o", out_dir
    )
    assert rc == 0, err
    assert "args.no_save_optim: false -> true" in out and "args.no_save_rng: false -> true" in out
    assert "torch_dcp load asks DCP for optimizer, opt_param_scheduler and rng_state" in out
    for arg in ("no_save_optim", "no_save_rng"):  # read back through the safe unpickler
        rc, shown, _ = run_main(capsys, "show", out_dir, f"args.{arg}")
        assert rc == 0 and "value           true" in shown
    doc = _json(capsys, "inspect", out_dir)
    assert doc["format"]["flavour"] == "torch_dcp" and doc["sections"]["optimizer"]["keys"] == 0
    rc, checked, _ = run_main(capsys, "check", "--deep", out_dir)
    assert rc == 0, checked
    child = subprocess.run(
        [sys.executable, "-c", _TORCH_DCP_LOAD, str(TORCH_DCP / ITER), str(out_dir / ITER)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    assert "loaded 15 model tensors" in child.stdout
    # the source is untouched
    rc, shown, _ = run_main(capsys, "show", TORCH_DCP, "args.no_save_optim")
    assert "value           false" in shown


# TorchTitan since v0.2.0: the model's keys at the top level beside optimizer.state.<fqn>.<state>, lr_scheduler,
# dataloader and train_state (step-5); its last step saved model-only in export_dtype bfloat16 (step-10)
TITAN_FLAT = DCP / "fsdp2_titan_flat"


def test_torchtitan_flattened_model_keys_are_the_model_section(capsys):
    doc = _json(capsys, "inspect", TITAN_FLAT / "step-5")
    assert doc["format"]["flavour"] == "fsdp2" and doc["iteration"] == 5
    sections = doc["sections"]
    assert sections["model"]["keys"] == 9 and sections["model"]["tensors"] == 9
    assert sections["optimizer"]["tensors"] == 18 + 9  # exp_avg, exp_avg_sq per parameter, and each one's step
    assert sections["other"]["keys"] == 12 and sections["other"]["tensors"] == 0  # lr_scheduler, train_state, ...
    assert {"key": "proj.weight", "dim": 0, "sizes": [3, 2]} in doc["layout"]["sharding"]["uneven"]
    rc, out, _ = run_main(capsys, "inspect", TITAN_FLAT / "step-5")
    assert rc == 0 and "format          FSDP2 / TorchTitan (plain PyTorch DCP, no metadata.json)" in out


def test_torchtitan_model_only_last_step_is_a_generic_save_of_the_model(capsys):
    """Nothing in a model-only save's keys names its writer: it is read as generic, every key the model's."""
    doc = _json(capsys, "inspect", TITAN_FLAT)  # the save dir: its newest step
    assert doc["iteration"] == 10 and doc["format"]["flavour"] == "generic"
    assert {name for name, section in doc["sections"].items() if section["keys"]} == {"model"}
    assert doc["sections"]["model"]["keys"] == 9
    rc, out, _ = run_main(capsys, "check", "--deep", "--all-iterations", TITAN_FLAT)
    assert rc == 0 and "All checks passed (2 checkpoints)" in out, out
    doc = _json(capsys, "diff", TITAN_FLAT / "step-5", TITAN_FLAT / "step-10", "--section", "model")
    changes = {c["key"]: (c["a"]["dtype"], c["b"]["dtype"]) for c in doc["changed"]}
    assert len(changes) == 9 and changes["proj.weight"] == ("torch.float32", "torch.bfloat16")
    assert doc["keys"]["model"]["common"] == 9
    assert doc["era"] == [
        "A is FSDP2 / TorchTitan (plain PyTorch DCP, no metadata.json), B is plain PyTorch DCP (plain PyTorch DCP, "
        "no metadata.json); keys and values are compared by key"
    ]


def test_torchtitan_flattened_save_loads_at_another_world_size(capsys):
    """The per-rank entries are dataloader.dp_rank_<r>; dataloader.world_size beside them is one replicated item."""
    doc = _json(capsys, "can-load", TITAN_FLAT / "step-5", "--target", "world=3")
    verdicts = {s["section"]: s["verdict"] for s in doc["sections"]}
    assert doc["will_load"] and verdicts == {"model": "reshards", "optimizer": "reshards", "other": "skipped"}
    assert any(w.startswith("2 per-rank dataloader entries") and "ranks 2..2" in w for w in doc["warnings"])
    doc = _json(capsys, "can-load", TITAN_FLAT / "step-10", "--target", "world=1")
    assert doc["will_load"] and [s["verdict"] for s in doc["sections"]] == ["reshards"]


def test_diff_across_torchtitans_two_layouts(capsys):
    """The same run saved as TorchTitan up to v0.1.0 (``model.`` prefix) and since v0.2.0 (model at the top level):
    the model keys are matched without the prefix, and model and moments hold equal values."""
    doc = _json(capsys, "diff", TITAN / "step-5", TITAN_FLAT / "step-5", "--values", "--stats")
    assert doc["keys"]["model"] == {"only_a": {"count": 0, "keys": []}, "only_b": {"count": 0, "keys": []}, "common": 9}
    assert doc["values"]["compared"] == 47 and doc["values"]["different"] == 0  # model 9, optimizer 27, other 11
    assert {row["key"] for row in doc["stats"]["rows"]} >= {"proj.weight", "tok_embeddings.weight"}
    assert any(note.startswith("A keeps the model under model. (TorchTitan up to v0.1.0)") for note in doc["era"])
    assert doc["keys"]["other"]["only_b"]["keys"] == ["dataloader.world_size"]


def test_edit_moves_a_model_prefixed_save_to_torchtitans_flattened_layout(capsys, tmp_path):
    """``edit --rename '^model\\.' ''`` turns a TorchTitan <= v0.1.0 full save into the layout v0.2.0 on loads:
    equal to the run's own flattened save, and torch's ``dcp.load`` reads the model's top-level keys from it."""
    import torch
    import torch.distributed.checkpoint as dcp

    moved = tmp_path / "titan" / "step-5"
    rc, _, err = run_main(capsys, "edit", TITAN / "step-5", "--rename", r"^model\.", "", "-o", moved)
    assert rc == 0, err
    doc = _json(capsys, "diff", moved, TITAN_FLAT / "step-5", "--values", "--section", "model")
    assert doc["identical"] and doc["values"]["compared"] == 9 and doc["era"] == []
    state = {"proj.weight": torch.empty(5, 8), "tok_embeddings.weight": torch.empty(16, 8)}
    dcp.load(state, checkpoint_id=str(moved), no_dist=True)
    reference = {key: torch.empty_like(value) for key, value in state.items()}
    dcp.load(reference, checkpoint_id=str(TITAN_FLAT / "step-5"), no_dist=True)
    assert all(torch.equal(state[key], reference[key]) for key in state)
