"""``check --health`` on plain PyTorch DCP saves: the health rules read each flavour's key naming (FSDP2's
``model.``/``optimizer.state.<fqn>.<moment>``, Megatron-LM torch_dcp's ``optimizer.state.<index>.<moment>``,
Megatron-FSDP's ``model.module.``/``optimizer.state.module.module.module.`` and its SwiGLU ``weight_w``/``weight_v``
halves). The real saves have no findings; damaged copies written by torch's own ``dcp.save`` (tensors loaded with
``dcp.load``, the bytes items carried over as saved, never unpickled) have the expected ones."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FIXTURES, run_main

DCP = FIXTURES / "dcp"
TITAN_STEP10 = DCP / "fsdp2_titan_ws2" / "step-10"
TORCH_DCP = DCP / "core019_mlm_torch_dcp_tp1" / "iter_0000010"
MLM_FSDP2 = DCP / "core019_mlm_torch_dcp_fsdp2_dp2"


def _findings(capsys, path: Path, *options: str) -> tuple[int, list[str]]:
    rc, out, err = run_main(capsys, "check", "--health", *options, path, "--format", "json")
    assert rc in (0, 1), err
    doc = json.loads(out)
    return rc, sorted(f"{f['code']} {f['message']}" for f in doc["findings"])


def _damaged_copy(source: Path, target: Path, damage: Callable[[dict], None]) -> Path:
    """``source``'s state read with torch's ``dcp.load`` (tensors whole; bytes items kept as their saved bytes),
    changed by ``damage``, and written with ``dcp.save`` from one process to ``target``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ckptdoctor.checkpoint import open_checkpoint

    class RawBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # DCP writes a BytesIO value verbatim
            self.state_dict[read_item.dest_index.fqn] = io.BytesIO(value.read())

    state: dict[str, object] = {}
    for key, entry in open_checkpoint(source).entries.items():
        if entry.kind == "tensor":
            state[key] = torch.empty(tuple(entry.shape or ()), dtype=getattr(torch, entry.dtype.split(".")[-1]))
        else:
            state[key] = None
    dcp.load(state, checkpoint_id=str(source), planner=RawBytes(flatten_state_dict=False), no_dist=True)
    damage(state)
    dcp.save(state, checkpoint_id=str(target), no_dist=True)
    return target


@pytest.mark.parametrize("path", [TITAN_STEP10, TORCH_DCP, MLM_FSDP2])
def test_real_plain_dcp_saves_have_no_health_findings(capsys, path):
    rc, found = _findings(capsys, path)
    assert rc == 0 and found == []
    doc = json.loads(run_main(capsys, "check", "--health", path, "--format", "json")[1])
    keys = {k["key"] for k in doc["health"][0]["keys"]}
    assert any(k.startswith("optimizer.state.") and k.endswith(".exp_avg_sq") for k in keys)  # moments measured


def test_fsdp2_zeroed_weight_and_reinitialised_adam(capsys, tmp_path):
    """FSDP2's optimizer state is keyed by parameter FQN with the moment last; the iteration of a TorchTitan save
    is its step-<N> dir."""

    def damage(state: dict) -> None:
        state["model.layers.1.weight"].zero_()
        for key, value in state.items():
            if key.endswith((".exp_avg", ".exp_avg_sq")):
                value.zero_()

    damaged = _damaged_copy(TITAN_STEP10, tmp_path / "titan" / "step-10", damage)
    rc, found = _findings(capsys, tmp_path / "titan")
    assert rc == 1
    assert found == [
        "CKD501 model.layers.1.weight: all 64 values are zero",
        "CKD510 all 18 exp_avg/exp_avg_sq tensors are zero at iteration 10 (optimizer re-initialised?)",
    ]
    rc, out, _ = run_main(capsys, "check", "--deep", damaged)
    assert rc == 0  # the health rules run only with --health


def test_megatron_torch_dcp_moments_by_parameter_index(capsys, tmp_path):
    """Megatron-LM's torch_dcp saves the optimizer's state_dict: moments keyed by parameter index."""

    def damage(state: dict) -> None:
        state["optimizer.state.3.exp_avg_sq"].view(-1)[0] = -1.0
        del state["optimizer.state.5.exp_avg_sq"]

    damaged = _damaged_copy(TORCH_DCP, tmp_path / "mlm" / "iter_0000010", damage)
    rc, found = _findings(capsys, damaged)
    assert rc == 1
    assert found == [
        "CKD511 optimizer.state.3.exp_avg_sq: negative values (smallest -1)",
        "CKD512 5: optimizer.state.5.exp_avg without exp_avg_sq",
    ]


def test_megatron_fsdp_swiglu_halves_are_weights(capsys, tmp_path):
    """Megatron-FSDP (``convert --to fsdp_dtensor`` of a real torch_dist save): a zeroed SwiGLU half
    ``linear_fc1.weight_w`` is a weight; moments under ``optimizer.state.module.module.module.``."""
    rc, _, err = run_main(capsys, "convert", FIXTURES / "core019_tp1", "--to", "fsdp_dtensor", "-o", tmp_path / "fd")
    assert rc == 0, err
    converted = tmp_path / "fd" / "iter_0000010"
    assert _findings(capsys, converted) == (0, [])
    half = "model.module.decoder.layers.1.mlp.linear_fc1.weight_w"

    def damage(state: dict) -> None:
        state[half].zero_()
        for key, value in state.items():
            if key.startswith("optimizer.state.module.module.module.") and key.endswith((".exp_avg", ".exp_avg_sq")):
                value.zero_()

    damaged = _damaged_copy(converted, tmp_path / "bad" / "iter_0000010", damage)
    doc = json.loads(run_main(capsys, "inspect", damaged, "--format", "json")[1])
    assert doc["format"]["flavour"] == "fsdp_dtensor"
    rc, found = _findings(capsys, damaged)
    assert rc == 1 and f"CKD501 {half}: all 2048 values are zero" in found
    assert any(f.startswith("CKD510 all ") and f.endswith("at iteration 10 (optimizer re-initialised?)") for f in found)


def test_generic_save_weight_against_bias(capsys, tmp_path):
    """A generic ``dcp.save`` (no ``model.`` prefix: every key is the model's): a zero weight is flagged, a zero
    bias is not."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"encoder": {"weight": torch.zeros(3, 2), "bias": torch.zeros(3)}, "head": {"weight": torch.ones(2, 3)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    doc = json.loads(run_main(capsys, "inspect", tmp_path / "ckpt", "--format", "json")[1])
    assert doc["format"]["flavour"] == "generic"
    assert _findings(capsys, tmp_path / "ckpt") == (1, ["CKD501 encoder.weight: all 6 values are zero"])
