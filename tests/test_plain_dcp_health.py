"""``check --health`` on plain PyTorch DCP saves: the health rules read each flavour's key naming (FSDP2's
``model.``/``optimizer.state.<fqn>.<moment>``, Megatron-LM torch_dcp's ``optimizer.state.<index>.<moment>``,
Megatron-FSDP's ``model.module.``/``optimizer.state.module.module.module.`` and its SwiGLU ``weight_w``/``weight_v``
halves). The real saves have no findings; damaged copies written by torch's own ``dcp.save`` (tensors loaded with
``dcp.load``, the bytes items carried over as saved, never unpickled) have the expected ones."""

from __future__ import annotations

import io
import json
import re
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


# Megatron-FSDP's per-expert keys of the MoE fixture (convert --to fsdp_dtensor of core019_moe_ep2: 2 layers, 4
# experts, SwiGLU: fc1 cut into _w/_v halves)
_EXPERT = "model.module.decoder.layers.{layer}.mlp.experts.local_experts.{expert}."
_EXPERT_TENSORS = ("linear_fc1.weight_w", "linear_fc1.weight_v", "linear_fc2.weight")


def _fsdp_dtensor(capsys, source: Path, target: Path) -> Path:
    rc, _, err = run_main(capsys, "convert", source, "--to", "fsdp_dtensor", "-o", target)
    assert rc == 0, err
    return target / "iter_0000010"


def _experts_named(finding: str) -> tuple[str, int, str]:
    """(code, layer, expert or experts) of an expert finding: torch_dist names a stacked key's slice
    (``layer 0 expert 1``, ``experts (layer 0): experts 0, 1``), a plain DCP save the per-layer key or module."""
    code, message = finding.split(" ", 1)
    zero = re.search(r"layer (\d+) expert (\d+)", message)
    if zero is not None:
        return code, int(zero[1]), zero[2]
    equal = re.search(r"(?:layers\.(\d+)\.\S*|\(layer (\d+)\)): experts ([\d, ]+) are equal", message)
    assert equal is not None, finding
    return code, int(equal[1] or equal[2]), equal[3]


def test_fsdp_dtensor_experts_zeroed_and_duplicated(capsys, tmp_path):
    """Megatron-FSDP keeps each expert in keys of its own: a zeroed expert is CKD501 naming layer and expert, and
    an expert overwritten by another one of its layer is CKD502, as torch_dist's stacked slices give them."""
    converted = _fsdp_dtensor(capsys, FIXTURES / "core019_moe_ep2", tmp_path / "fd")
    assert _findings(capsys, converted) == (0, [])

    def damage(state: dict) -> None:
        for tensor in _EXPERT_TENSORS:
            state[_EXPERT.format(layer=1, expert=2) + tensor].zero_()
            state[_EXPERT.format(layer=0, expert=3) + tensor].copy_(state[_EXPERT.format(layer=0, expert=0) + tensor])

    damaged = _damaged_copy(converted, tmp_path / "bad" / "iter_0000010", damage)
    rc, found = _findings(capsys, damaged)
    assert rc == 1
    assert found == sorted(
        [
            f"CKD501 {_EXPERT.format(layer=1, expert=2)}{t}: all 2048 values are zero (layer 1 expert 2)"
            for t in _EXPERT_TENSORS
        ]
        + ["CKD502 model.module.decoder.layers.0.mlp.experts: experts 0, 3 are equal in every tensor"]
    )


@pytest.mark.parametrize("fixture", ["core019_moe_zero_expert_ep2", "core019_moe_dup_expert_ep2"])
def test_fsdp_dtensor_conversion_names_the_experts_torch_dist_does(capsys, tmp_path, fixture):
    """The real damaged MoE fixtures converted to fsdp_dtensor: the same rules name the same layer and experts
    as on the torch_dist originals (a zeroed expert's fc1 halves are two keys, each its own CKD501)."""
    rc, original = _findings(capsys, FIXTURES / fixture)
    assert rc == 1 and original
    rc, converted = _findings(capsys, _fsdp_dtensor(capsys, FIXTURES / fixture, tmp_path / "fd"))
    assert rc == 1 and len(converted) >= len(original)
    assert {_experts_named(f) for f in converted} == {_experts_named(f) for f in original}


def test_fsdp_dtensor_experts_equal_in_one_layer_and_in_every_layer(capsys, tmp_path):
    """Every expert of layer 1 a copy of its expert 0 while layer 0's differ: CKD504; then layer 0's too: CKD503
    for each layer (upcycled, never trained)."""
    converted = _fsdp_dtensor(capsys, FIXTURES / "core019_moe_ep2", tmp_path / "fd")

    def copies_of_expert_0(layers: tuple[int, ...]) -> Callable[[dict], None]:
        def damage(state: dict) -> None:
            for layer in layers:
                for expert in (1, 2, 3):
                    for tensor in _EXPERT_TENSORS:
                        first = state[_EXPERT.format(layer=layer, expert=0) + tensor]
                        state[_EXPERT.format(layer=layer, expert=expert) + tensor].copy_(first)

        return damage

    one = _damaged_copy(converted, tmp_path / "one" / "iter_0000010", copies_of_expert_0((1,)))
    assert _findings(capsys, one) == (
        1,
        [
            "CKD504 model.module.decoder.layers.1.mlp.experts: all 4 experts are equal in every tensor while other "
            "layers' experts differ"
        ],
    )
    every = _damaged_copy(converted, tmp_path / "every" / "iter_0000010", copies_of_expert_0((0, 1)))
    assert _findings(capsys, every) == (
        1,
        [
            f"CKD503 model.module.decoder.layers.{layer}.mlp.experts: all 4 experts are equal in every tensor "
            "(upcycled or never trained?)"
            for layer in (0, 1)
        ],
    )


def test_fsdp_dtensor_grouped_experts_weight_index(capsys, tmp_path):
    """Megatron-FSDP with TEGroupedMLP names experts ``linear_fc1.weight<E>_w``, ``linear_fc2.weight<E>``
    (megatron-core's get_expert_index_from_key): the expert index read from there."""
    converted = _fsdp_dtensor(capsys, FIXTURES / "core019_moe_ep2", tmp_path / "fd")
    sequential = re.compile(r"local_experts\.(\d+)\.(linear_fc\d\.weight)")

    def grouped(state: dict) -> None:
        renamed = {sequential.sub(r"\2\1", key): value for key, value in state.items()}
        state.clear()
        state.update(renamed)

    def damage(state: dict) -> None:
        grouped(state)
        for suffix in ("1.weight2_w", "1.weight2_v", "2.weight2"):
            state[f"model.module.decoder.layers.1.mlp.experts.linear_fc{suffix}"].zero_()
        for first, copy in (("1.weight0_w", "1.weight3_w"), ("1.weight0_v", "1.weight3_v"), ("2.weight0", "2.weight3")):
            layer0 = "model.module.decoder.layers.0.mlp.experts.linear_fc"
            state[layer0 + copy].copy_(state[layer0 + first])

    clean = _damaged_copy(converted, tmp_path / "grouped" / "iter_0000010", grouped)
    keys = json.loads(run_main(capsys, "inspect", clean, "--keys", "--format", "json")[1])["keys"]
    assert "model.module.decoder.layers.0.mlp.experts.linear_fc1.weight3_w" in {k["key"] for k in keys}
    assert not any("local_experts" in k["key"] for k in keys)
    assert _findings(capsys, clean) == (0, [])
    damaged = _damaged_copy(converted, tmp_path / "bad" / "iter_0000010", damage)
    rc, found = _findings(capsys, damaged)
    assert rc == 1
    zeroed = "CKD501 model.module.decoder.layers.1.mlp.experts.linear_{}: all 2048 values are zero (layer 1 expert 2)"
    assert found == [zeroed.format(t) for t in ("fc1.weight2_v", "fc1.weight2_w", "fc2.weight2")] + [
        "CKD502 model.module.decoder.layers.0.mlp.experts: experts 0, 3 are equal in every tensor"
    ]


def _titan_moe_state(seed: int = 0) -> dict:
    """A TorchTitan MoE model's state (its GroupedExperts keep every expert of a layer in one [E, ...] parameter:
    w1, w2, w3), with its train state."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    model: dict[str, object] = {"tok_embeddings.weight": normal(32, 8), "norm.weight": normal(8)}
    for layer in (0, 1):
        prefix = f"layers.{layer}."
        model[prefix + "attention.wq.weight"] = normal(8, 8)
        model[prefix + "attention_norm.weight"] = normal(8)
        model[prefix + "moe.router.gate.weight"] = normal(4, 8)
        model[prefix + "moe.experts.w1"] = normal(4, 12, 8)
        model[prefix + "moe.experts.w2"] = normal(4, 8, 12)
        model[prefix + "moe.experts.w3"] = normal(4, 12, 8)
        model[prefix + "moe.shared_experts.w1.weight"] = normal(12, 8)
    return {"model": model, "train_state": {"step": torch.tensor(10)}}


def test_fsdp2_titan_stacked_experts(capsys, tmp_path):
    """TorchTitan's experts are one [E, ...] tensor per layer and weight: its statistics kept per expert (dim 0),
    compared as torch_dist's stacked experts are."""
    import torch.distributed.checkpoint as dcp

    clean = _titan_moe_state()
    dcp.save(clean, checkpoint_id=str(tmp_path / "clean"), no_dist=True)
    doc = json.loads(run_main(capsys, "inspect", tmp_path / "clean", "--format", "json")[1])
    assert doc["format"]["flavour"] == "fsdp2"
    assert _findings(capsys, tmp_path / "clean") == (0, [])

    damaged = _titan_moe_state()
    for weight in ("w1", "w2", "w3"):
        damaged["model"][f"layers.0.moe.experts.{weight}"][2].zero_()
        stacked = damaged["model"][f"layers.1.moe.experts.{weight}"]
        stacked[3].copy_(stacked[1])
    dcp.save(damaged, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    rc, found = _findings(capsys, tmp_path / "bad")
    assert rc == 1
    assert found == [
        f"CKD501 model.layers.0.moe.experts.{weight}: expert 2 all zero (1 of 4 slices)"
        for weight in ("w1", "w2", "w3")
    ] + ["CKD502 model.layers.1.moe.experts: experts 1, 3 are equal in every tensor"]

    upcycled = _titan_moe_state()
    for layer in (0, 1):
        for weight in ("w1", "w2", "w3"):
            stacked = upcycled["model"][f"layers.{layer}.moe.experts.{weight}"]
            stacked[1:].copy_(stacked[0].expand_as(stacked[1:]))
    dcp.save(upcycled, checkpoint_id=str(tmp_path / "upcycled"), no_dist=True)
    assert _findings(capsys, tmp_path / "upcycled") == (
        1,
        [
            f"CKD503 model.layers.{layer}.moe.experts: all 4 experts are equal in every tensor "
            "(upcycled or never trained?)"
            for layer in (0, 1)
        ],
    )


def test_megatron_torch_dcp_grouped_experts(capsys, tmp_path):
    """Megatron-LM torch_dcp saves Transformer Engine's GroupedLinear experts as ``linear_fc1.weight<E>``: a
    zeroed ``weight2`` is a weight (named with its layer and expert) and two equal experts are CKD502. The real
    torch_dcp save with grouped experts' keys added to each layer."""
    import torch

    generator = torch.Generator().manual_seed(0)

    def damage(state: dict) -> None:
        for layer in (0, 1):
            experts = f"model.decoder.layers.{layer}.mlp.experts."
            for expert in range(4):
                state[f"{experts}linear_fc1.weight{expert}"] = torch.randn(128, 32, generator=generator)
                state[f"{experts}linear_fc2.weight{expert}"] = torch.randn(32, 64, generator=generator)
        for fc in ("fc1", "fc2"):
            state[f"model.decoder.layers.1.mlp.experts.linear_{fc}.weight2"].zero_()
            layer0 = f"model.decoder.layers.0.mlp.experts.linear_{fc}.weight"
            state[layer0 + "3"].copy_(state[layer0 + "1"])

    damaged = _damaged_copy(TORCH_DCP, tmp_path / "mlm" / "iter_0000010", damage)
    doc = json.loads(run_main(capsys, "inspect", damaged, "--format", "json")[1])
    assert doc["format"]["flavour"] == "torch_dcp"
    rc, found = _findings(capsys, damaged)
    assert rc == 1
    assert found == [
        "CKD501 model.decoder.layers.1.mlp.experts.linear_fc1.weight2: all 4096 values are zero (layer 1 expert 2)",
        "CKD501 model.decoder.layers.1.mlp.experts.linear_fc2.weight2: all 2048 values are zero (layer 1 expert 2)",
        "CKD502 model.decoder.layers.0.mlp.experts: experts 1, 3 are equal in every tensor",
    ]


TITAN_FLAT = DCP / "fsdp2_titan_flat"  # TorchTitan since v0.2.0: model keys at the top level; step-10 model-only


@pytest.mark.parametrize("step", ["step-5", "step-10"])
def test_torchtitan_flattened_and_model_only_saves_have_no_findings(capsys, step):
    assert _findings(capsys, TITAN_FLAT / step) == (0, [])
    doc = json.loads(run_main(capsys, "check", "--health", TITAN_FLAT / step, "--format", "json")[1])
    keys = {k["key"] for k in doc["health"][0]["keys"]}
    assert "proj.weight" in keys  # the top-level model keys are measured as the model's


def test_torchtitan_flattened_zeroed_weight_and_reinitialised_adam(capsys, tmp_path):
    """Model keys at the top level: a zeroed one is a model weight; the moments (optimizer.state.<fqn>.<moment>)
    all zero at step 5 is a re-initialised optimizer."""

    def damage(state: dict) -> None:
        state["layers.1.weight"].zero_()
        for key, value in state.items():
            if key.endswith((".exp_avg", ".exp_avg_sq")):
                value.zero_()

    _damaged_copy(TITAN_FLAT / "step-5", tmp_path / "titan" / "step-5", damage)
    rc, found = _findings(capsys, tmp_path / "titan")
    assert rc == 1
    assert found == [
        "CKD501 layers.1.weight: all 64 values are zero",
        "CKD510 all 18 exp_avg/exp_avg_sq tensors are zero at iteration 5 (optimizer re-initialised?)",
    ]


def test_torchtitan_model_only_zeroed_weight(capsys, tmp_path):
    """The model-only last step (bfloat16, no optimizer): a zeroed weight is found, a zeroed bias is not."""

    def damage(state: dict) -> None:
        state["proj.weight"].zero_()
        state["proj.bias"].zero_()

    _damaged_copy(TITAN_FLAT / "step-10", tmp_path / "titan" / "step-10", damage)
    assert _findings(capsys, tmp_path / "titan") == (1, ["CKD501 proj.weight: all 40 values are zero"])


def test_torchtitan_flattened_stacked_experts(capsys, tmp_path):
    """TorchTitan since v0.2.0 saves the MoE model's keys at the top level: the stacked experts are still the
    model's, measured per expert."""
    import torch.distributed.checkpoint as dcp

    state = _titan_moe_state()
    flat = {**state.pop("model"), **state}
    for weight in ("w1", "w2", "w3"):
        flat[f"layers.0.moe.experts.{weight}"][2].zero_()
        stacked = flat[f"layers.1.moe.experts.{weight}"]
        stacked[3].copy_(stacked[1])
    dcp.save(flat, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    doc = json.loads(run_main(capsys, "inspect", tmp_path / "bad", "--format", "json")[1])
    assert doc["format"]["flavour"] == "fsdp2" and doc["sections"]["other"]["keys"] == 1  # train_state.step
    rc, found = _findings(capsys, tmp_path / "bad")
    assert rc == 1
    assert found == [
        f"CKD501 layers.0.moe.experts.{weight}: expert 2 all zero (1 of 4 slices)" for weight in ("w1", "w2", "w3")
    ] + ["CKD502 layers.1.moe.experts: experts 1, 3 are equal in every tensor"]
