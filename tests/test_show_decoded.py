"""``ckptdoctor show CKPT args[.NAME]``, ``common[.PATH]`` and ``KEY --decode`` (issue #37 points 1 and 2): every
saved arg, one arg, the common state and bytes items decoded through the safe unpickler, without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import FIXTURES, run_cli, run_cli_each, run_main

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.formats.torch_zip import dump_torch_zip

CKPT = FIXTURES / "core019_tp2"  # core 0.19: the common state is the DCP item common_state/shard_0_1
OLD = FIXTURES / "core016_tp1"  # core 0.16: common.pt


def _json(capsys, *args: object) -> dict:
    rc, out, err = run_main(capsys, "show", *args, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


def test_every_saved_arg_is_listed_without_torch():
    commands = [["show", str(c), "args", *fmt] for c in (CKPT, OLD) for fmt in ([], ["--format", "json"])]
    results, imported = run_cli_each(commands, block=("torch", "megatron"))
    assert imported == []
    for (rc_text, text, err_text), (rc_json, out, err_json) in zip(results[::2], results[1::2]):
        assert rc_text == rc_json == 0, (err_text, err_json)
        doc = json.loads(out)
        assert doc["kind"] == "args" and doc["path"] == "args" and doc["type"] == "Namespace"
        names = list(doc["value"])
        # inspect shows the args of its groups (35 or so); show lists every one the checkpoint saved
        assert len(names) > 80 and f"{len(names)} saved args" in doc["notes"]
        listed = {line.split()[0] for line in text.splitlines() if line.startswith("  ")}
        assert listed == set(names)
        assert {"lr", "min_lr", "seed", "train_iters", "optimizer", "adam_beta2", "clip_grad"} <= set(names)


def test_inspect_shows_fewer_args_than_show(capsys):
    rc, out, _ = run_main(capsys, "inspect", CKPT, "--format", "json")
    assert rc == 0
    inspected = {name for group in json.loads(out)["args"].values() for name in group}
    shown = set(_json(capsys, CKPT, "args")["value"])
    assert inspected < shown


def test_one_arg_in_text_and_json(capsys):
    doc = _json(capsys, CKPT, "args.lr")
    assert doc["path"] == "args.lr" and doc["type"] == "float" and doc["source"] == "common_state/shard_0_1"
    # Megatron's scheduler starts from args.lr: two places of the common state that must agree
    assert doc["value"] == _json(capsys, CKPT, "common.opt_param_scheduler.max_lr")["value"]
    every = _json(capsys, CKPT, "args")["value"]
    for name in ("seed", "num_layers", "normalization", "vocab_size", "sequence_parallel"):
        assert _json(capsys, CKPT, f"args.{name}")["value"] == every[name]
    rc, out, _ = run_main(capsys, "show", OLD, "args.lr")
    assert rc == 0 and "source          common.pt" in out and "path            args.lr   (float)" in out
    assert f"value           {every['lr']}" in out


def test_an_unknown_arg_suggests_close_names_and_exits_2(capsys):
    rc, out, err = run_main(capsys, "show", CKPT, "args.lrr")
    assert rc == 2 and out == ""
    assert "no saved arg 'lrr' in args; did you mean 'lr'" in err and "ckptdoctor show CKPT args" in err
    rc, _, err = run_main(capsys, "show", CKPT, "args.num_layer")
    assert rc == 2 and "'num_layers'" in err
    rc, out, _ = run_main(capsys, "show", CKPT, "args.no_such_arg_at_all", "--format", "json")
    doc = json.loads(out)
    assert rc == 2 and doc["schema"] == "ckptdoctor.error/1" and doc["exit_code"] == 2
    rc, _, err = run_main(capsys, "show", CKPT, "args.lr.x")
    assert rc == 2 and "args.lr has no fields" in err
    rc, _, err = run_main(capsys, "show", CKPT, "arg")  # not a path: an unknown key that suggests args
    assert rc == 2 and "'args'" in err


def test_stand_ins_are_shown_readably_never_built(capsys):
    doc = _json(capsys, CKPT, "args.model_type")
    assert doc["type"] == "megatron.core.enums.ModelType" and doc["value"] == "ModelType(1)"
    doc = _json(capsys, CKPT, "args.params_dtype")
    assert doc["type"] == "torch.dtype" and doc["value"] == "torch.float32"
    doc = _json(capsys, CKPT, "args.cuda_graph_modules")
    assert doc["type"] == "list" and doc["value"] == ["CudaGraphModule(1)"]
    rc, out, _ = run_main(capsys, "show", CKPT, "args")
    assert rc == 0 and "Signals.SIGTERM" in out and "ModelType(1)" in out


def test_common_state_by_path(capsys):
    doc = _json(capsys, CKPT, "common.opt_param_scheduler")
    assert doc["kind"] == "common" and doc["type"] == "dict" and "lr_decay_style" in doc["value"]
    rc, out, _ = run_main(capsys, "show", CKPT, "common.opt_param_scheduler")
    assert rc == 0 and f"  lr_decay_style   {doc['value']['lr_decay_style']}" in out
    groups = _json(capsys, CKPT, "common.optimizer.param_groups")["value"]
    doc = _json(capsys, CKPT, "common.optimizer.param_groups[1].weight_decay")
    assert doc["path"] == "common.optimizer.param_groups[1].weight_decay" and doc["value"] == groups[1]["weight_decay"]
    rc, out, _ = run_main(capsys, "show", CKPT, "common.optimizer")
    assert rc == 0 and re.search(rf"^  param_groups\[0\]\.lr +{re.escape(str(groups[0]['lr']))}$", out, re.M)
    doc = _json(capsys, CKPT, "common.rerun_state_machine.mode")
    assert doc["value"] == "RerunMode('validate_results')"
    rc, _, err = run_main(capsys, "show", CKPT, "common.optimizer.param_group")
    assert rc == 2 and "no field 'param_group' in common.optimizer; did you mean 'param_groups'" in err
    rc, _, err = run_main(capsys, "show", CKPT, "common.optimizer.param_groups[7]")
    assert rc == 2 and "no field '[7]' in common.optimizer.param_groups" in err
    rc, _, err = run_main(capsys, "show", CKPT, "args.lr", "--stats")
    assert rc == 2 and "no tensor" in err


def test_bytes_items_decoded(capsys):
    doc = _json(capsys, CKPT, "rng_state", "--decode", "--no-stats")
    shards = doc["decoded"]
    assert sorted(shards) == ["shard_0.0_1.2", "shard_0.1_1.2"]
    state = shards["shard_0.0_1.2"][0]
    assert state["np_rng_state"][0] == "MT19937" and len(state["random_rng_state"][1]) == 625
    assert state["torch_rng_state"].startswith("tensor(torch.uint8")  # a reference to the tensor, not its bytes
    rc, out, _ = run_main(capsys, "show", CKPT, "rng_state", "--decode")
    assert rc == 0 and "decoded (safe unpickler)" in out and '["shard_0.0_1.2"][0].np_rng_state[0]' in out
    doc = _json(capsys, CKPT, "common_state", "--decode")
    assert doc["decoded"]["opt_param_scheduler"] == _json(capsys, CKPT, "common.opt_param_scheduler")["value"]
    assert "decoded" not in _json(capsys, CKPT, "rng_state")  # only with --decode
    rc, _, err = run_main(capsys, "show", CKPT, "decoder.final_layernorm.weight", "--decode")
    assert rc == 2 and "nothing to decode" in err


def test_decoding_needs_no_torch():
    result = run_cli("show", str(CKPT), "rng_state", "--decode", block=("torch", "megatron"))
    assert result.returncode == 0, result.stderr
    assert "IMPORTED:\n" in result.stderr and "torch_rng_state" in result.stdout


@pytest.mark.mcore
def test_every_arg_torch_load_sees_is_shown(capsys):
    """Against the args a real torch.load of common.pt builds (megatron-core's classes imported)."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    code = (
        "import json, sys, torch\n"
        "args = vars(torch.load(sys.argv[1], weights_only=False)['args'])\n"
        "plain = (bool, int, float, str, type(None))\n"
        "print(json.dumps({k: v if type(v) in plain else None for k, v in args.items()}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(OLD / "iter_0000010" / "common.pt")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    real = json.loads(proc.stdout)
    shown = _json(capsys, OLD, "args")["value"]
    assert list(shown) == list(real)
    assert {k: v for k, v in shown.items() if real[k] is not None} == {k: v for k, v in real.items() if v is not None}


def test_diff_of_the_common_state_needs_no_torch():
    result = run_cli(
        "diff", str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_moe_ep2"), block=("torch", "megatron")
    )
    assert result.returncode == 1, result.stderr
    assert "IMPORTED:\n" in result.stderr and "opt_param_scheduler.num_steps: " in result.stdout


def test_a_value_that_expands_exponentially_is_shown_within_bounds(capsys, copy_fixture):
    save = copy_fixture("core016_tp1")
    common = open_checkpoint(save).common_state()
    node: object = [1]
    for _ in range(20):
        node = [node] * 10  # 10**20 leaves in a small pickle
    common["bomb"] = node
    (save / "iter_0000010" / "common.pt").write_bytes(dump_torch_zip(common))
    rc, out, _ = run_main(capsys, "show", save, "common.bomb")
    lines = out.splitlines()
    assert rc == 0 and lines[-1].startswith("  ... ") and lines[-1].endswith(" more field(s) (all in --format json)")
    assert len(lines) < 220
    doc = _json(capsys, save, "common.bomb")
    assert "..." in json.dumps(doc["value"])  # the JSON walk stopped where its limits are
    assert _json(capsys, save, "common.bomb" + "[9]" * 20 + "[0]")["value"] == 1
