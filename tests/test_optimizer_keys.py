"""A ChainedOptimizer's items (an MoE model's dense and expert optimizers): ``chained_<i>.optimizer.*`` keys are
optimizer keys everywhere, read through ckptdoctor.optimizer_keys (fixtures/core019_moe_ep2_distopt: megatron-core
0.19.2's save of an EP=2 MoE model with the distributed optimizer, whose dp_reshardable buckets carry the prefix)."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES

from ckptdoctor.checkpoint import open_checkpoint, section_of
from ckptdoctor.cli import main
from ckptdoctor.optimizer_keys import chain_prefix, is_bucket_key, is_distributed_key, is_optimizer_key, state_of
from ckptdoctor.parallelism import infer_layout

CHAINED = FIXTURES / "core019_moe_ep2_distopt"
BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg"


@pytest.mark.parametrize(
    "key, prefix, optimizer, bucket, distributed, state",
    [
        (BUCKET, "", True, True, True, None),
        ("chained_1." + BUCKET, "chained_1.", True, True, True, None),
        (
            "chained_12.optimizer.distributed.dp_group_idx_0.per_bucket_numel/shard_0_1",
            "chained_12.",
            True,
            False,
            True,
            None,
        ),
        (
            "chained_0.optimizer.state.exp_avg.decoder.layers.mlp.router.weight",
            "chained_0.",
            True,
            False,
            False,
            ("exp_avg", "decoder.layers.mlp.router.weight"),
        ),
        (
            "optimizer.state.param.embedding.word_embeddings.weight",
            "",
            True,
            False,
            False,
            ("param", "embedding.word_embeddings.weight"),
        ),
        # not an optimizer's: a module named chained_..., a prefix without its optimizer, a bare prefix
        ("chained_0.decoder.layers.mlp.router.weight", "", False, False, False, None),
        ("chained_x.optimizer.state.exp_avg.w", "", False, False, False, None),
        ("decoder.chained_0.optimizer.state.exp_avg.w", "", False, False, False, None),
        ("optimizer.state.exp_avg", "", True, False, False, None),
    ],
)
def test_key_forms(key, prefix, optimizer, bucket, distributed, state):
    assert chain_prefix(key) == prefix
    assert is_optimizer_key(key) == optimizer == (section_of(key) == "optimizer")
    assert (is_bucket_key(key), is_distributed_key(key), state_of(key)) == (bucket, distributed, state)


def test_a_real_chained_save_is_read_as_saved():
    """Every chained_<i>. key of the real save is an optimizer item, the layout is the one it was saved at, and the
    model section holds the model: before, the buckets' flat chunks (8 and 16 per key) counted as model tensors
    split 8 ways, and check said TP=8 with three fixable warnings that fix-args would have written."""
    checkpoint = open_checkpoint(CHAINED)
    chained = [key for key in checkpoint.entries if key.startswith("chained_")]
    assert {chain_prefix(key) for key in chained} == {"chained_0.", "chained_1."}
    assert all(checkpoint.entries[key].section == "optimizer" for key in chained)
    assert not any(e.key.startswith(("chained_", "optimizer")) for e in checkpoint.section_entries("model"))
    layout = infer_layout(checkpoint)
    assert (layout.tp, layout.pp, layout.ep) == (1, 1, 2)


def test_check_and_fix_args_find_nothing_to_fix(capsys):
    assert main(["check", "--isolated", "--format", "json", str(CHAINED)]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []
    assert main(["fix-args", str(CHAINED)]) == 0
    assert "args are consistent with the checkpoint's parallelism" in capsys.readouterr().out


def test_edit_drop_section_optimizer_drops_the_chained_buckets(capsys, tmp_path):
    out = tmp_path / "weights"
    assert main(["edit", str(CHAINED), "--drop-section", "optimizer", "--output", str(out)]) == 0
    capsys.readouterr()
    kept = open_checkpoint(out).entries
    assert kept and not [key for key in kept if is_optimizer_key(key)]
    assert set(kept) == {e.key for e in open_checkpoint(CHAINED).section_entries("model")} | {
        key for key in kept if section_of(key) in ("rng", "rerun", "common")
    }


def test_convert_lists_the_chained_buckets_as_not_converted(capsys, tmp_path):
    """The dp_reshardable buckets have no parameter-to-offset map: not converted, as the unprefixed ones (before,
    they were renamed into the model as model.module.chained_0.optimizer...)."""
    rc = main(["convert", str(CHAINED), "--to", "fsdp_dtensor", "--output", str(tmp_path / "out"), "--format", "json"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    text = json.dumps(report)
    assert "model.module.chained_" not in text
    not_converted = {item["key"] for item in report["plan"]["not_carried"]}
    assert {key for key in open_checkpoint(CHAINED).entries if is_bucket_key(key)} <= not_converted
