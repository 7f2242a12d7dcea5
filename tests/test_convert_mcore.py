"""convert --to torch_dist of a converted fsdp_dtensor save, loaded by real megatron-core 0.19.2 on CPU
(``dist_checkpointing.load`` of the model section, through tests/mcore_load_edited.py): every parameter equals
what the source fixture loads. The round trip drops Transformer Engine ``_extra_state`` (Megatron-FSDP keeps
none), so the loading model keeps no extra state either."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import FIXTURES, REPO, free_port, require_mcore

from ckptdoctor.cli import main

SCRIPT = REPO / "tests" / "mcore_load_edited.py"
pytestmark = pytest.mark.mcore


def _convert(capsys, source, out, target):
    rc = main(["convert", str(source), "--to", target, "-o", str(out)])
    _stdout, err = capsys.readouterr()
    assert rc == 0, err


@pytest.mark.parametrize(("fixture", "nproc"), [("core019_tp1", 1), ("core019_tp2", 2)])
def test_round_trip_torch_dist_loads_in_megatron_core(capsys, tmp_path, fixture, nproc):
    require_mcore()
    _convert(capsys, FIXTURES / fixture, tmp_path / "fsdp", "fsdp_dtensor")
    _convert(capsys, tmp_path / "fsdp", tmp_path / "back", "torch_dist")
    case = dict(
        name="back",
        via="dist",
        ckpt=str(tmp_path / "back"),
        reference=str(FIXTURES / fixture),
        flags=[],
        expect="ok",
        no_extra_state=True,
    )
    command = [str(SCRIPT), json.dumps([case]), "--dp", "1"]
    if nproc > 1:
        command = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
        command += [str(SCRIPT), json.dumps([case]), "--dp", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("CASE back OK ") == nproc, proc.stdout[-3000:]


def test_deepseek_round_trip_torch_dist_loads_in_megatron_core(capsys, tmp_path):
    """The DeepSeek-style fixture (MLA, a dense and a MoE layer with shared expert and expert bias, one MTP layer)
    through fsdp_dtensor and back: megatron-core loads the result's model section into the same model, every
    parameter equal to what the source loads."""
    require_mcore()
    fixture = "core019_deepseek_mtp"
    _convert(capsys, FIXTURES / fixture, tmp_path / "fsdp", "fsdp_dtensor")
    _convert(capsys, tmp_path / "fsdp", tmp_path / "back", "torch_dist")
    case = dict(
        name="back",
        via="dist",
        ckpt=str(tmp_path / "back"),
        reference=str(FIXTURES / fixture),
        flags=[],
        expect="ok",
        no_extra_state=True,
    )
    layout = {"num_experts": 4, "moe_layer_freq": [0, 1], "moe_shared_expert": 64, "mla": True, "mtp_layers": 1}
    command = [str(SCRIPT), json.dumps([case]), "--layout", json.dumps(layout)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "CASE back OK " in proc.stdout, proc.stdout[-3000:]


BF16_SCRIPT = REPO / "tests" / "mcore_load_bf16.py"


def test_bf16_round_trip_loads_in_megatron_core_with_its_fp32_main_params(capsys, tmp_path):
    """The bf16 fixture (fp32 main params in a fully_reshardable distributed optimizer) through fsdp_dtensor (the
    main params as model.module) and back: megatron-core loads the result, model and optimizer, at DP=2 on two
    gloo ranks, and each rank's bf16 parameters, fp32 main params and Adam moments equal what the source loads."""
    require_mcore()
    fixture = FIXTURES / "core019_bf16_dp2_fully_reshardable"
    _convert(capsys, fixture, tmp_path / "fsdp", "fsdp_dtensor")
    _convert(capsys, tmp_path / "fsdp", tmp_path / "back", "torch_dist")
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    command += [str(BF16_SCRIPT), str(fixture), str(tmp_path / "back")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("BF16 OK ") == 2 and "torch.bfloat16, torch.float32" in proc.stdout, proc.stdout[-3000:]


NATIVE_SCRIPT = REPO / "tests" / "fsdp_native_groups.py"


def test_megatron_fsdp_param_to_group_meta_becomes_torch_dist_param_groups(capsys, tmp_path):
    """A save with the optimizer section Megatron-FSDP itself writes (``{"state", "param_to_group_meta"}``, built
    with megatron-core's own state-dict functions on CPU by tests/fsdp_native_groups.py, not by a Megatron-FSDP run)
    converts to a torch_dist save whose param groups megatron-core loads: at DP=2 every rank's bf16 parameters,
    fp32 main params, Adam moments and param group fields (lr, step, ...) equal what the source fixture loads.
    The save's content metadata (none, as Megatron-FSDP saves it) says fully_reshardable, and its RNG state is
    listed as not carried, not left in common.pt."""
    require_mcore()
    fixture = FIXTURES / "core019_bf16_dp2_fully_reshardable"
    _convert(capsys, fixture, tmp_path / "fsdp", "fsdp_dtensor")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port())]
    command += [str(NATIVE_SCRIPT), str(tmp_path / "fsdp" / "iter_0000010"), str(tmp_path / "native")]
    proc = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0 and "NATIVE OK 2 groups" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert main(["convert", str(tmp_path / "native"), "--to", "torch_dist", "-o", str(tmp_path / "back")]) == 0
    out = capsys.readouterr().out
    assert "rng_state.(0, 0).0.torch_rng_state: per-rank RNG state" in out, out
    assert main(["show", str(tmp_path / "back"), "common"]) == 0
    common = capsys.readouterr().out
    assert "param_to_group_meta" not in common and "rng_state" not in common, common
    for line in ("optimizer.param_state_sharding_type", "content_metadata.distrib_optim_sharding_type"):
        assert re.search(rf"^  {re.escape(line)} +fully_reshardable$", common, re.M), common
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    command += [str(BF16_SCRIPT), str(fixture), str(tmp_path / "back")]
    proc = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("2 param groups equal") == 2, proc.stdout[-3000:]


MOE_LAYOUTS = {
    "core019_moe_ep2": {"dp": 2, "ep": 2, "num_experts": 4},
    # the distributed optimizer's chained_0./chained_1. buckets (dp_reshardable): not carried, the model is
    "core019_moe_ep2_distopt": {"dp": 2, "ep": 2, "num_experts": 4},
    # each expert's weights cut over 2 ranks (ETP=2 at TP=1): joined whole per expert in fsdp_dtensor
    "core019_moe_etp2": {"dp": 2, "etp": 2, "num_experts": 4},
    "core019_moe_mixed_shared_ep2": {
        "dp": 2,
        "ep": 2,
        "num_experts": 4,
        "moe_layer_freq": [0, 1],
        "moe_shared_expert": 32,
    },
}


@pytest.mark.parametrize("fixture", sorted(MOE_LAYOUTS))
def test_moe_round_trip_torch_dist_loads_in_megatron_core_at_ep2(capsys, tmp_path, fixture):
    """The MoE fixtures (SequentialMLP experts, EP=2 or ETP=2) through fsdp_dtensor (one key per expert, global expert
    index) and back: two gloo ranks, one expert-parallel rank each, load the result's model section and every
    parameter equals what the source loads."""
    require_mcore()
    _convert(capsys, FIXTURES / fixture, tmp_path / "fsdp", "fsdp_dtensor")
    _convert(capsys, tmp_path / "fsdp", tmp_path / "back", "torch_dist")
    case = dict(
        name="back",
        via="dist",
        ckpt=str(tmp_path / "back"),
        reference=str(FIXTURES / fixture),
        flags=[],
        expect="ok",
        no_extra_state=True,
    )
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    command += [str(SCRIPT), json.dumps([case]), "--layout", json.dumps(MOE_LAYOUTS[fixture])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("CASE back OK ") == 2, proc.stdout[-3000:]


MTP_SCRIPT = REPO / "tests" / "mcore_save_mtp.py"


def _mtp(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(MTP_SCRIPT), *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_mtp_layers_convert_by_megatron_fsdp_names_and_back(capsys, tmp_path):
    """A GPT with one multi-token prediction layer, saved by real megatron-core 0.19.2: its MTP keys keep their
    index (not stacked with the decoder's layers), the transformer layer inside is named as the module names it
    (``mtp_model_layer``; torch_dist saves it as ``transformer_layer``); the round trip is bit-identical and
    megatron-core loads it into a fresh model, every parameter (MTP's included) equal to the source's."""
    require_mcore()
    import torch.distributed.checkpoint as dcp

    stdout = _mtp("save", tmp_path / "src")
    params = stdout.split("MTP-PARAMS ", 1)[1].split()
    _convert(capsys, tmp_path / "src", tmp_path / "fsdp", "fsdp_dtensor")
    keys = set(dcp.FileSystemReader(str(tmp_path / "fsdp")).read_metadata().state_dict_metadata)
    mtp_keys = {k for k in keys if ".mtp." in k}
    assert "model.module.mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight_w" in mtp_keys
    assert not any("transformer_layer" in k or "mtp.layers.0.0" in k for k in mtp_keys)
    # each model MTP parameter has its key (the local spec's layer norms are saved under their fused names)
    fused = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
    fused["pre_mlp_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"
    for name in params:
        for local, saved in fused.items():
            name = name.replace(local, saved)
        if name.endswith("linear_fc1.weight"):
            assert f"model.module.{name}_w" in keys and f"model.module.{name}_v" in keys
        else:
            assert f"model.module.{name}" in keys, name
    _convert(capsys, tmp_path / "fsdp", tmp_path / "back", "torch_dist")
    rc = main(["diff", str(tmp_path / "src"), str(tmp_path / "back"), "--values", "--exclude", "_extra_state"])
    text, err = capsys.readouterr()
    assert rc == 0 and "no differences" in text, text + err
    assert "MTP" in _mtp("load", tmp_path / "back", tmp_path / "src")
