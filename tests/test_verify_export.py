"""``ckptdoctor verify-export CKPT HF_DIR`` (issue #39): Hugging Face exports of the Megatron fixtures, written by
``transformers`` (config.json) and ``safetensors`` (the shards) in ``fixtures/make_hf_exports.py``, verify clean;
copies damaged with the ``safetensors`` library get the right finding naming the right tensor, shard, layer or
expert."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REPO, run_main, shipped_schema

HF = FIXTURES / "hf"
EXPORTS = sorted(p.name for p in HF.iterdir() if (p / "config.json").exists())
INDEX = "model.safetensors.index.json"


def _verify(capsys, ckpt: str | Path, hf: Path, *extra: str) -> tuple[int, dict, str]:
    """verify-export with --format json: exit code, the report (valid against its schema) and stderr."""
    rc, out, err = run_main(
        capsys, "verify-export", ckpt if isinstance(ckpt, Path) else FIXTURES / ckpt, hf, *extra, "--format", "json"
    )
    if rc == 2:
        return rc, {}, err
    report = json.loads(out)
    jsonschema.Draft202012Validator(shipped_schema("verify-export")).validate(report)
    return rc, report, err


def _codes(report: dict, severity: str = "error") -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for f in report["findings"]:
        if f["severity"] == severity:
            found.setdefault(f["code"], []).append(f)
    return found


@pytest.fixture
def export_copy(tmp_path):
    def _copy(name: str) -> Path:
        dest = tmp_path / f"hf_{name}"
        shutil.copytree(HF / name, dest)
        return dest

    return _copy


def _index(hf: Path) -> dict:
    return json.loads((hf / INDEX).read_text())


def _write_index(hf: Path, index: dict) -> None:
    (hf / INDEX).write_text(json.dumps(index))


def _shard_of(hf: Path, name: str) -> Path:
    if (hf / INDEX).exists():
        return hf / _index(hf)["weight_map"][name]
    return hf / "model.safetensors"


def _rewrite(hf: Path, shard: Path, change) -> None:
    """Rewrite one shard with the safetensors library after ``change(tensors)``; the index follows what it holds
    (an exporter that wrote what it had)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = safetensors_torch.load_file(str(shard))
    change(tensors)
    safetensors_torch.save_file(tensors, str(shard), metadata={"format": "pt"})
    if (hf / INDEX).exists():
        index = _index(hf)
        weight_map = {n: s for n, s in index["weight_map"].items() if s != shard.name}
        weight_map.update(dict.fromkeys(tensors, shard.name))
        index["weight_map"] = weight_map
        _write_index(hf, index)


# --- clean exports -------------------------------------------------------------------------------------------------


# the exports whose HF model has a tensor the checkpoint cannot fill (a warning; see the test below)
UNFILLED = {"core019_moe_mixed_shared_ep2": 1}


@pytest.mark.parametrize("name", EXPORTS)
def test_each_fixture_export_matches_its_checkpoint(capsys, name):
    rc, report, _ = _verify(capsys, name, HF / name)
    assert rc == 0, report["findings"]
    warnings = UNFILLED.get(name, 0)
    assert report["verdict"] == "match" and report["counts"] == {"errors": 0, "warnings": warnings, "infos": 0}
    assert [f["code"] for f in report["findings"]] == ["random-init"] * warnings
    assert report["hf_tensors"] == report["expected_tensors"] > 0
    assert all(t["megatron_key"] for t in report["tensors"])
    rc, out, _ = run_main(capsys, "verify-export", FIXTURES / name, HF / name)
    assert rc == 0 and out.splitlines()[-1].startswith("match: ")


@pytest.mark.parametrize("name", EXPORTS)
def test_values_of_each_fixture_export_equal_the_checkpoint_slices(capsys, name):
    pytest.importorskip("torch")
    rc, report, _ = _verify(capsys, name, HF / name, "--values")
    assert rc == 0, report["findings"]
    assert report["values_compared"] == report["expected_tensors"]
    assert {t["max_abs_diff"] for t in report["tensors"]} == {0.0}


def test_a_nan_on_one_side_is_named_not_an_infinite_difference(capsys):
    """core019_nan_weight_tp1 (one NaN in layer 0's linear_proj, otherwise core019_tp1's values) against
    core019_tp1's export: the finding says where the NaN is, not "max abs diff inf"."""
    pytest.importorskip("torch")
    rc, report, _ = _verify(capsys, "core019_nan_weight_tp1", HF / "core019_tp1", "--values")
    (bad,) = [f for f in report["findings"] if f["hf_name"] == "model.layers.0.self_attn.o_proj.weight"]
    assert rc == 1 and bad["code"] == "value" and "inf" not in bad["message"]
    assert bad["message"].endswith(
        "non-finite values (NaN/Inf) where the other side has finite ones: 1 in the checkpoint "
        "(decoder.layers.self_attention.linear_proj.weight layer 0)"
    )


def test_the_families_come_from_config_json(capsys):
    families = {name: _verify(capsys, name, HF / name)[1]["family"] for name in EXPORTS}
    assert families == {
        "core019_deepseek_mtp": "deepseek",  # deepseek_v3: MLA, expert bias, MTP layer
        "core019_gqa_qkln_tp2": "llama",  # qwen3: q/k norm in the dense table
        "core019_moe_ep2": "mixtral",
        "core019_moe_mixed_shared_ep2": "qwen_moe",
        "core019_moe_shared_gate_ep2": "qwen_moe",  # qwen2_moe with Megatron's shared expert gate
        "core019_tied_pp2": "llama",
        "core019_tp1": "llama",
    }


def test_the_export_of_another_checkpoint_does_not_match(capsys):
    rc, report, _ = _verify(capsys, "core019_tp1", HF / "core019_gqa_qkln_tp2")
    assert rc == 1 and report["verdict"] == "mismatch"
    found = _codes(report)
    assert {f["hf_name"] for f in found["shape"]} == {
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "kv"
    }
    assert {f["hf_name"] for f in found["extra"]} == {
        f"model.layers.{i}.self_attn.{p}_norm.weight" for i in (0, 1) for p in "qk"
    }
    assert any("num_key_value_heads = 2" in f["message"] for f in found["config"])


# --- the export's own files ----------------------------------------------------------------------------------------


def test_a_missing_shard_is_named_with_the_tensors_it_held(capsys, export_copy):
    hf = export_copy("core019_tp1")
    index = _index(hf)
    gone = "model-00002-of-00003.safetensors"
    (hf / gone).unlink()
    rc, report, _ = _verify(capsys, "core019_tp1", hf)
    assert rc == 1
    found = _codes(report)
    assert [f["shard"] for f in found["shard-missing"]] == [gone]
    held = {n for n, s in index["weight_map"].items() if s == gone}
    assert {f["hf_name"] for f in found["missing"]} == held
    rc, out, _ = run_main(capsys, "verify-export", FIXTURES / "core019_tp1", hf)
    assert rc == 1 and f"{gone}: named by the index, not in the dir" in out
    assert out.splitlines()[-1].startswith("mismatch: ")


def test_a_ghost_entry_in_the_index(capsys, export_copy):
    hf = export_copy("core019_tp1")
    index = _index(hf)
    index["weight_map"]["model.layers.7.mlp.up_proj.weight"] = "model-00001-of-00003.safetensors"
    _write_index(hf, index)
    rc, report, _ = _verify(capsys, "core019_tp1", hf)
    assert rc == 1
    assert [f["hf_name"] for f in _codes(report)["ghost"]] == ["model.layers.7.mlp.up_proj.weight"]


def test_an_orphan_tensor_in_a_shard(capsys, export_copy):
    torch = pytest.importorskip("torch")
    hf = export_copy("core019_tp1")
    index = _index(hf)
    shard = hf / "model-00003-of-00003.safetensors"
    _rewrite(hf, shard, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.ones(4, 4)}))
    _write_index(hf, index)  # the index as the exporter wrote it before: it does not list the new tensor
    rc, report, _ = _verify(capsys, "core019_tp1", hf)
    found = _codes(report)
    assert rc == 1
    assert [(f["hf_name"], f["shard"]) for f in found["orphan"]] == [
        ("model.layers.0.mlp.extra_proj.weight", shard.name)
    ]
    assert [f["hf_name"] for f in found["extra"]] == ["model.layers.0.mlp.extra_proj.weight"]


def test_a_truncated_shard_is_a_header_that_claims_more_than_the_file(capsys, export_copy):
    hf = export_copy("core019_tp1")
    shard = hf / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    rc, report, _ = _verify(capsys, "core019_tp1", hf)
    assert rc == 1
    [finding] = _codes(report)["truncated"]
    assert finding["shard"] == shard.name and "tensor(s) cut" in finding["message"]


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"{not json", "header is not JSON"),
        (b"[1, 2]", "header is a JSON list, not an object"),
        (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', "data_offsets span 4 bytes"),
        (b'{"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}', "unknown dtype 'Q7'"),
        (
            b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},'
            b' "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}',
            "overlaps",
        ),
    ],
)
def test_a_header_the_format_refuses_makes_the_shard_unreadable(capsys, export_copy, header, message):
    hf = export_copy("core019_tied_pp2")
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    rc, report, _ = _verify(capsys, "core019_tied_pp2", hf)
    assert rc == 1
    [finding] = _codes(report)["shard-unreadable"]
    assert message in finding["message"] and finding["shard"] == "model.safetensors"
    assert report["hf_tensors"] == 0 and len(_codes(report)["missing"]) == report["expected_tensors"]


def test_a_header_length_over_the_format_limit_is_refused_without_reading_it(capsys, export_copy):
    hf = export_copy("core019_tied_pp2")
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", 200_000_000) + b"{}")
    rc, report, _ = _verify(capsys, "core019_tied_pp2", hf)
    assert rc == 1
    [finding] = _codes(report)["shard-unreadable"]
    assert "header length 200000000 over the format's limit" in finding["message"]


def test_the_header_reader_agrees_with_the_safetensors_library():
    safetensors = pytest.importorskip("safetensors")
    from ckptdoctor.formats.safetensors_header import read_header

    for shard in sorted(HF.glob("*/*.safetensors")):
        header = read_header(shard)
        with safetensors.safe_open(str(shard), framework="pt") as f:
            assert sorted(header.tensors) == sorted(f.keys())
            assert header.metadata == f.metadata()
            for name in sorted(header.tensors):
                piece = f.get_slice(name)
                assert list(header.tensors[name].shape) == piece.get_shape()
                assert header.tensors[name].dtype == piece.get_dtype()
        assert header.data_bytes == header.buffer_bytes


# --- coverage: layers, experts, lm_head, dtypes ----------------------------------------------------------------------


def test_a_missing_layer_is_reported_per_layer(capsys, export_copy):
    hf = export_copy("core019_tied_pp2")
    _rewrite(hf, hf / "model.safetensors", lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.1.")])
    rc, report, _ = _verify(capsys, "core019_tied_pp2", hf)
    assert rc == 1
    missing = _codes(report)["missing"]
    assert {f["layer"] for f in missing} == {1} and len(missing) == 9
    rc, out, _ = run_main(capsys, "verify-export", FIXTURES / "core019_tied_pp2", hf)
    assert "missing by layer / expert:\n  layer 1: 9 tensors" in out


def test_a_missing_expert_is_named_by_layer_and_expert(capsys, export_copy):
    hf = export_copy("core019_moe_ep2")
    prefix = "model.layers.1.block_sparse_moe.experts.2."
    shard = _shard_of(hf, prefix + "w1.weight")
    _rewrite(hf, shard, lambda t: [t.pop(n) for n in list(t) if n.startswith(prefix)])
    rc, report, _ = _verify(capsys, "core019_moe_ep2", hf)
    assert rc == 1
    missing = _codes(report)["missing"]
    assert {(f["layer"], f["expert"]) for f in missing} == {(1, 2)}
    assert {f["megatron_key"] for f in missing} >= {"decoder.layers.mlp.experts.experts.linear_fc1.weight"}


def test_a_missing_lm_head_of_an_untied_model(capsys, export_copy):
    hf = export_copy("core019_tp1")
    _rewrite(hf, _shard_of(hf, "lm_head.weight"), lambda t: t.pop("lm_head.weight"))
    rc, report, _ = _verify(capsys, "core019_tp1", hf)
    assert rc == 1
    [finding] = _codes(report)["missing"]
    assert finding["hf_name"] == "lm_head.weight" and finding["megatron_key"] == "output_layer.weight"


def test_a_dtype_change_is_a_warning_and_a_mismatch_with_strict(capsys, export_copy):
    torch = pytest.importorskip("torch")
    hf = export_copy("core019_tied_pp2")
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(hf, hf / "model.safetensors", lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    rc, report, _ = _verify(capsys, "core019_tied_pp2", hf)
    assert rc == 0 and report["verdict"] == "match"
    [finding] = _codes(report, "warning")["dtype"]
    assert finding["hf_name"] == name and "bfloat16" in finding["message"] and "float32" in finding["message"]
    rc, report, _ = _verify(capsys, "core019_tied_pp2", hf, "--strict")
    assert rc == 1 and report["verdict"] == "mismatch"
    rc, report, _ = _verify(capsys, "core019_tied_pp2", hf, "--values")  # within bfloat16's rounding
    assert rc == 0 and "value" not in _codes(report)


def test_config_drift_names_each_field(capsys, export_copy):
    hf = export_copy("core019_gqa_qkln_tp2")
    config = json.loads((hf / "config.json").read_text())
    config.update(num_key_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=256)
    config["rope_parameters"]["rope_theta"] = 500000.0
    (hf / "config.json").write_text(json.dumps(config))
    rc, report, _ = _verify(capsys, "core019_gqa_qkln_tp2", hf)
    assert rc == 1
    messages = sorted(f["message"] for f in _codes(report)["config"])
    assert messages == [
        "config.json num_key_value_heads = 4, the saved args' num_key_value_heads = 2",
        "config.json rms_norm_eps = 1e-06, the saved args' norm_epsilon = 1e-05",
        "config.json rope_theta = 500000.0, the saved args' rotary_base = 10000",
        "config.json tie_word_embeddings = True, the saved args' tie_word_embeddings = False",
        "config.json vocab_size 256 > the checkpoint's padded_vocab_size 128",
    ]


def test_a_shared_expert_without_a_gate_leaves_qwen2_moes_gate_to_random_init(capsys):
    """Qwen2-MoE always gates its shared expert (sigmoid(shared_expert_gate(x))); the fixture's Megatron model has
    no gate (moe_shared_expert_gate off): every tensor of the export is right, yet transformers draws that gate at
    random, so the export is not the checkpoint's model (fixtures/forward_parity.py measures the difference)."""
    name = "core019_moe_mixed_shared_ep2"
    rc, report, _ = _verify(capsys, name, HF / name)
    assert rc == 0
    [finding] = report["findings"]
    assert (finding["code"], finding["severity"], finding["hf_name"], finding["layer"]) == (
        "random-init",
        "warning",
        "model.layers.1.mlp.shared_expert_gate.weight",
        1,
    )
    assert "no mlp.shared_experts.gate_weight in layer 1" in finding["message"]
    rc, report, _ = _verify(capsys, name, HF / name, "--strict")
    assert rc == 1 and report["verdict"] == "mismatch"


GATED = "core019_moe_shared_gate_ep2"  # core019_moe_mixed_shared_ep2 saved with moe_shared_expert_gate
GATE = "model.layers.1.mlp.shared_expert_gate.weight"


def test_megatrons_shared_expert_gate_is_qwen2_moes_shared_expert_gate(capsys):
    rc, report, _ = _verify(capsys, GATED, HF / GATED, "--values")
    assert rc == 0 and report["findings"] == []
    [gate] = [t for t in report["tensors"] if t["name"] == GATE]
    assert gate["megatron_key"] == "decoder.layers.1.mlp.shared_experts.gate_weight"
    assert gate["shape"] == [1, 32] and gate["max_abs_diff"] == 0.0  # nn.Linear(hidden, 1): [1, hidden] both sides


def test_a_missing_shared_expert_gate_is_named(capsys, export_copy):
    hf = export_copy(GATED)
    _rewrite(hf, _shard_of(hf, GATE), lambda t: t.pop(GATE))
    rc, report, _ = _verify(capsys, GATED, hf)
    assert rc == 1
    [finding] = _codes(report)["missing"]
    assert (finding["hf_name"], finding["megatron_key"], finding["layer"]) == (
        GATE,
        "decoder.layers.1.mlp.shared_experts.gate_weight",
        1,
    )
    assert set(_codes(report)) == {"missing"} and not _codes(report, "warning")


def test_a_transposed_shared_expert_gate_is_a_shape_error(capsys, export_copy):
    hf = export_copy(GATED)
    _rewrite(hf, _shard_of(hf, GATE), lambda t: t.update({GATE: t[GATE].t().contiguous()}))
    rc, report, _ = _verify(capsys, GATED, hf)
    assert rc == 1
    [finding] = _codes(report)["shape"]
    assert finding["hf_name"] == GATE and "[32, 1]" in finding["message"] and "[1, 32]" in finding["message"]


def test_a_zeroed_shared_expert_gate_is_named(capsys, export_copy):
    """A zero gate weight halves the shared expert (sigmoid(0) = 0.5): a wrong model with every tensor present."""
    torch = pytest.importorskip("torch")
    hf = export_copy(GATED)
    _rewrite(hf, _shard_of(hf, GATE), lambda t: t.update({GATE: torch.zeros_like(t[GATE])}))
    rc, report, _ = _verify(capsys, GATED, hf)
    assert rc == 0  # metadata only: names and shapes are right
    rc, report, _ = _verify(capsys, GATED, hf, "--values")
    assert rc == 1
    [finding] = _codes(report)["zeroed"]
    assert (finding["hf_name"], finding["layer"]) == (GATE, 1)
    assert set(_codes(report)) == {"zeroed"}


def test_a_router_that_does_not_renormalise_the_top_k_is_config_drift(capsys, export_copy):
    """Megatron's default router takes the softmax after the top-k (the chosen weights sum to one); a Qwen2-MoE
    config with norm_topk_prob false computes other weights from the same tensors."""
    hf = export_copy("core019_moe_mixed_shared_ep2")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    rc, report, _ = _verify(capsys, "core019_moe_mixed_shared_ep2", hf)
    assert rc == 1
    assert [f["message"] for f in _codes(report)["config"]] == [
        "config.json norm_topk_prob = False, the saved args' moe_topk_normalized = True"
    ]


def test_vocab_smaller_than_the_padded_rows_is_the_first_rows(capsys):
    rc, report, _ = _verify(capsys, "core019_tp1", HF / "core019_tp1")
    embed = next(t for t in report["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert rc == 0 and embed["shape"] == [100, 32]  # padded_vocab_size 128, config.json vocab_size 100


# --- values ----------------------------------------------------------------------------------------------------------


def test_swapped_k_and_v_and_gate_and_up(capsys, export_copy):
    pytest.importorskip("torch")
    hf = export_copy("core019_gqa_qkln_tp2")
    a = "model.layers.1.self_attn."
    m = "model.layers.0.mlp."

    def swap(t, x, y):
        if x in t and y in t:
            t[x], t[y] = t[y], t[x]

    assert _shard_of(hf, a + "k_proj.weight") == _shard_of(hf, a + "v_proj.weight")
    assert _shard_of(hf, m + "gate_proj.weight") == _shard_of(hf, m + "up_proj.weight")
    _rewrite(hf, _shard_of(hf, a + "k_proj.weight"), lambda t: swap(t, a + "k_proj.weight", a + "v_proj.weight"))
    _rewrite(hf, _shard_of(hf, m + "gate_proj.weight"), lambda t: swap(t, m + "gate_proj.weight", m + "up_proj.weight"))
    rc, report, _ = _verify(capsys, "core019_gqa_qkln_tp2", hf)
    assert rc == 0  # names and shapes are all right: only the values tell
    rc, report, _ = _verify(capsys, "core019_gqa_qkln_tp2", hf, "--values")
    assert rc == 1
    swapped = {f["hf_name"]: f["message"] for f in _codes(report)["swapped"]}
    assert set(swapped) == {a + "k_proj.weight", a + "v_proj.weight", m + "gate_proj.weight", m + "up_proj.weight"}
    assert "holds the v piece" in swapped[a + "k_proj.weight"]
    assert "holds the up piece" in swapped[m + "gate_proj.weight"]
    assert set(_codes(report)) == {"swapped"}


def test_a_zeroed_and_a_reinitialised_expert(capsys, export_copy):
    torch = pytest.importorskip("torch")
    hf = export_copy("core019_moe_ep2")
    zeroed = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    redrawn = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    gen = torch.Generator().manual_seed(0)
    _rewrite(hf, _shard_of(hf, zeroed), lambda t: t.update({zeroed: torch.zeros_like(t[zeroed])}))
    _rewrite(
        hf,
        _shard_of(hf, redrawn),
        lambda t: t.update({redrawn: torch.randn(t[redrawn].shape, generator=gen) * 0.02}),
    )
    rc, report, _ = _verify(capsys, "core019_moe_ep2", hf, "--values")
    assert rc == 1
    found = _codes(report)
    assert [(f["hf_name"], f["layer"], f["expert"]) for f in found["zeroed"]] == [(zeroed, 0, 1)]
    assert [(f["hf_name"], f["layer"], f["expert"]) for f in found["reinitialised"]] == [(redrawn, 1, 3)]
    assert "std 0.02" in found["reinitialised"][0]["message"]
    # the fixture's experts are at init statistics themselves: a fresh draw cannot be told from another model's
    assert "re-initialised or another model's" in found["reinitialised"][0]["message"]
    assert "value" not in found
    row = next(t for t in report["tensors"] if t["name"] == redrawn)
    assert row["max_abs_diff"] > 0


# --- DeepSeek: multi-latent attention, shared experts, expert bias, a multi-token prediction layer ------------------

DEEPSEEK = "core019_deepseek_mtp"  # 2 layers (layer 0 dense, layer 1 MoE) + MTP layer 0 = HF's model.layers.2


def test_the_deepseek_export_maps_mla_expert_bias_and_the_mtp_layer(capsys):
    rc, report, _ = _verify(capsys, DEEPSEEK, HF / DEEPSEEK)
    assert rc == 0, report["findings"]
    keys = {t["name"]: t["megatron_key"] for t in report["tensors"]}
    assert (
        keys["model.layers.1.self_attn.kv_b_proj.weight"] == "decoder.layers.1.self_attention.linear_kv_up_proj.weight"
    )
    assert keys["model.layers.0.self_attn.q_a_layernorm.weight"] == "decoder.layers.0.self_attention.q_layernorm.weight"
    assert keys["model.layers.1.mlp.gate.e_score_correction_bias"] == "decoder.layers.1.mlp.router.expert_bias"
    assert keys["model.layers.2.eh_proj.weight"] == "mtp.layers.0.eh_proj.weight"
    assert keys["model.layers.2.shared_head.norm.weight"] == "mtp.layers.0.final_layernorm.weight"
    assert keys["model.layers.2.mlp.experts.3.up_proj.weight"] == (
        "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"
    )


def test_a_missing_mtp_layer_is_named_as_layer_num_layers_plus_n(capsys, export_copy):
    hf = export_copy(DEEPSEEK)
    for shard in sorted(set(_index(hf)["weight_map"].values())):
        _rewrite(hf, hf / shard, lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.2.")])
    rc, report, out = _verify(capsys, DEEPSEEK, hf)
    assert rc == 1
    missing = _codes(report)["missing"]
    assert {f["layer"] for f in missing} == {2}
    keys = {f["megatron_key"] for f in missing}
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight"} <= keys
    assert "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight" in keys
    assert set(_codes(report)) == {"missing"}


def test_a_missing_expert_bias_is_named(capsys, export_copy):
    hf = export_copy(DEEPSEEK)
    gone = "model.layers.1.mlp.gate.e_score_correction_bias"
    _rewrite(hf, _shard_of(hf, gone), lambda t: t.pop(gone))
    rc, report, _ = _verify(capsys, DEEPSEEK, hf)
    assert rc == 1
    [finding] = _codes(report)["missing"]
    assert (finding["hf_name"], finding["megatron_key"], finding["layer"]) == (
        gone,
        "decoder.layers.1.mlp.router.expert_bias",
        1,
    )


def test_a_zeroed_and_a_reordered_kv_b_proj(capsys, export_copy):
    """kv_b_proj rows are per head [nope; v]: an exporter that writes [v; nope] keeps names and shapes."""
    torch = pytest.importorskip("torch")
    hf = export_copy(DEEPSEEK)
    zeroed = "model.layers.0.self_attn.kv_b_proj.weight"
    reordered = "model.layers.2.self_attn.kv_b_proj.weight"  # the MTP layer's
    config = json.loads((hf / "config.json").read_text())
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    assert nope == v  # the swap keeps the shape

    def per_head_v_first(w):
        per_head = w.reshape(heads, nope + v, -1)
        return torch.cat([per_head[:, nope:], per_head[:, :nope]], dim=1).reshape(w.shape).contiguous()

    _rewrite(hf, _shard_of(hf, zeroed), lambda t: t.update({zeroed: torch.zeros_like(t[zeroed])}))
    _rewrite(hf, _shard_of(hf, reordered), lambda t: t.update({reordered: per_head_v_first(t[reordered])}))
    rc, report, _ = _verify(capsys, DEEPSEEK, hf)
    assert rc == 0  # names and shapes are all right: only the values tell
    rc, report, _ = _verify(capsys, DEEPSEEK, hf, "--values")
    assert rc == 1
    found = _codes(report)
    assert [(f["hf_name"], f["layer"]) for f in found["zeroed"]] == [(zeroed, 0)]
    assert [(f["hf_name"], f["layer"], f["megatron_key"]) for f in found["value"]] == [
        (reordered, 2, "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight")
    ]
    assert set(found) == {"zeroed", "value"}


def test_deepseek_v3s_own_copies_of_embedding_and_head_in_the_mtp_layer(capsys, export_copy):
    """DeepSeek-V3's checkpoints repeat embed_tokens and the head in each MTP layer; Megatron-Bridge writes neither:
    both layouts verify, and a copy that is wrong is named."""
    torch = pytest.importorskip("torch")
    hf = export_copy(DEEPSEEK)
    embed, head = "model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"
    shard = _shard_of(hf, "model.embed_tokens.weight")

    def add_copies(t):
        source = {**_load(hf, "model.embed_tokens.weight"), **_load(hf, "lm_head.weight")}
        t[embed] = source["model.embed_tokens.weight"].clone()
        t[head] = torch.zeros_like(source["lm_head.weight"])

    _rewrite(hf, shard, add_copies)
    rc, report, _ = _verify(capsys, DEEPSEEK, hf)
    assert rc == 0, report["findings"]
    keys = {t["name"]: t["megatron_key"] for t in report["tensors"]}
    assert (keys[embed], keys[head]) == ("embedding.word_embeddings.weight", "output_layer.weight")
    rc, report, _ = _verify(capsys, DEEPSEEK, hf, "--values")
    assert rc == 1
    assert [(f["hf_name"], f["layer"]) for f in _codes(report)["zeroed"]] == [(head, 2)]
    assert set(_codes(report)) == {"zeroed"}


def _load(hf: Path, name: str) -> dict:
    return {name: pytest.importorskip("safetensors.torch").load_file(str(_shard_of(hf, name)))[name]}


def test_deepseek_config_drift_names_each_field(capsys, export_copy):
    hf = export_copy(DEEPSEEK)
    config = json.loads((hf / "config.json").read_text())
    drift = {
        "num_nextn_predict_layers": 0,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,  # Megatron renormalises the sigmoid top-k weights (top-k 2)
    }
    (hf / "config.json").write_text(json.dumps({**config, **drift}))
    rc, report, _ = _verify(capsys, DEEPSEEK, hf)
    assert rc == 1
    messages = [f["message"] for f in _codes(report)["config"]]
    assert len(messages) == len(drift)
    for field, arg in [
        ("num_nextn_predict_layers", "mtp_num_layers = 1"),
        ("n_shared_experts", "moe_shared_experts = 1"),
        ("first_k_dense_replace", "moe_first_dense_layers = 1"),
        ("kv_lora_rank", "kv_lora_rank = 16"),
        ("qk_rope_head_dim", "qk_pos_emb_head_dim = 4"),
        ("routed_scaling_factor", "moe_router_topk_scaling_factor = 2.5"),
        ("norm_topk_prob", "moe_topk_normalized = True"),
    ]:
        assert any(m.startswith(f"config.json {field} = ") and m.endswith(arg) for m in messages), (field, messages)


# DeepSeek's grouped routing against Megatron's router: the fixture routes without groups (moe_router_num_groups
# unset: one group of all experts, all chosen), with the expert bias (noaux_tc) and sigmoid scores
@pytest.mark.parametrize(
    ("field", "value", "stated"),
    [
        ("n_group", 8, "config.json n_group = 8, the saved args' moe_router_groups = 1"),
        ("topk_group", 4, "config.json topk_group = 4, the saved args' moe_router_groups_chosen = 1"),
        (
            "topk_method",
            "group_limited_greedy",
            "config.json topk_method = 'group_limited_greedy', the saved args' moe_router_topk_method = 'noaux_tc'",
        ),
        (
            "scoring_func",
            "softmax",
            "config.json scoring_func = 'softmax', the saved args' moe_router_score_function = 'sigmoid'",
        ),
    ],
)
def test_deepseek_grouped_routing_drift_is_named(capsys, export_copy, field, value, stated):
    """DeepSeek's own config.json states topk_method and scoring_func too (transformers' config class does not
    write them): where the other routing fields say what Megatron's router does, only the drifted one is named."""
    hf = export_copy(DEEPSEEK)
    config = json.loads((hf / "config.json").read_text())
    routing = {"n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    (hf / "config.json").write_text(json.dumps({**config, **routing, field: value}))
    rc, report, _ = _verify(capsys, DEEPSEEK, hf)
    assert rc == 1 and report["verdict"] == "mismatch"
    assert [f["message"] for f in report["findings"]] == [stated]


def test_a_checkpoint_with_group_limited_routing_wants_its_groups_in_config_json(capsys, export_copy, tmp_path):
    """The fixture's args given Megatron's group-limited routing (2 groups, 1 chosen; fix-args --set): the export
    that routes over one group is drift; stating 2 groups, 1 chosen matches."""
    grouped = tmp_path / "grouped"
    rc, _, err = run_main(
        capsys,
        "fix-args",
        FIXTURES / DEEPSEEK,
        "--set",
        "moe_router_num_groups=2",
        "--set",
        "moe_router_group_topk=1",
        "--force",
        "-o",
        grouped,
    )
    assert rc == 0, err
    hf = export_copy(DEEPSEEK)
    rc, report, _ = _verify(capsys, grouped, hf)
    assert rc == 1
    assert [f["message"] for f in report["findings"]] == [
        "config.json n_group = 1, the saved args' moe_router_groups = 2"
    ]
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "n_group": 2, "topk_group": 1, "topk_method": "noaux_tc"}))
    rc, report, _ = _verify(capsys, grouped, hf)
    assert rc == 0 and report["findings"] == []


def test_a_perturbed_tensor_at_init_statistics_is_a_value_difference_not_reinitialised(capsys, export_copy):
    """Noise added to the checkpoint's weights keeps init-like statistics but stays correlated with them: not a
    fresh init."""
    torch = pytest.importorskip("torch")
    hf = export_copy("core019_moe_ep2")
    nudged = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    gen = torch.Generator().manual_seed(1)
    _rewrite(
        hf,
        _shard_of(hf, nudged),
        lambda t: t.update({nudged: t[nudged] + torch.randn(t[nudged].shape, generator=gen) * 0.002}),
    )
    rc, report, _ = _verify(capsys, "core019_moe_ep2", hf, "--values")
    assert rc == 1
    assert [f["hf_name"] for f in _codes(report)["value"]] == [nudged]
    assert "reinitialised" not in _codes(report)


def test_values_give_the_same_report_at_any_jobs(capsys, export_copy):
    """--jobs forks workers over runs of slices; the findings and every tensor's difference come back in order."""
    torch = pytest.importorskip("torch")
    hf = export_copy("core019_moe_mixed_shared_ep2")
    names = json.loads((hf / INDEX).read_text())["weight_map"]
    zeroed = sorted(n for n in names if ".experts." in n)[0]
    _rewrite(hf, _shard_of(hf, zeroed), lambda t: t.update({zeroed: torch.zeros_like(t[zeroed])}))
    reports = {}
    for jobs in ("1", "2", "3"):
        rc, reports[jobs], _ = _verify(capsys, "core019_moe_mixed_shared_ep2", hf, "--values", "--jobs", jobs)
        assert rc == 1
    assert reports["1"] == reports["2"] == reports["3"]
    assert [f["hf_name"] for f in _codes(reports["2"])["zeroed"]] == [zeroed]
    assert reports["2"]["values_compared"] == reports["2"]["expected_tensors"]
    rc, text_1, _ = run_main(
        capsys, "verify-export", FIXTURES / "core019_moe_mixed_shared_ep2", hf, "--values", "-j", "1"
    )
    rc, text_2, _ = run_main(
        capsys, "verify-export", FIXTURES / "core019_moe_mixed_shared_ep2", hf, "--values", "-j", "2"
    )
    assert text_1 == text_2 and "zeroed" in text_2


# --- input the command refuses; options -------------------------------------------------------------------------------


def test_a_dir_that_is_not_an_hf_model_is_one_line(capsys, tmp_path):
    rc, out, err = run_main(capsys, "verify-export", FIXTURES / "core019_tp1", tmp_path)
    assert (
        rc == 2
        and out == ""
        and err.strip() == f"ckptdoctor: error: {tmp_path}: not a Hugging Face model dir (no config.json)"
    )


def test_a_damaged_pytorch_bin_export_is_refused_in_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04")
    rc, out, err = run_main(capsys, "verify-export", FIXTURES / "core019_tp1", tmp_path)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "pytorch_model.bin" in err and "not a readable torch.save file" in err


def test_an_unknown_family_names_the_known_ones_and_the_mapping_option(capsys, export_copy):
    hf = export_copy("core019_tied_pp2")
    config = json.loads((hf / "config.json").read_text())
    config["model_type"] = "gpt_oss"
    (hf / "config.json").write_text(json.dumps(config))
    rc, out, err = run_main(capsys, "verify-export", FIXTURES / "core019_tied_pp2", hf)
    assert rc == 2 and out == ""
    assert (
        "'gpt_oss' is not a family ckptdoctor knows (deepseek, llama, mixtral, qwen_moe)" in err and "--mapping" in err
    )
    rc, report, _ = _verify(capsys, "core019_tied_pp2", hf, "--family", "llama")
    assert rc == 0 and report["family"] == "llama"
    rc, out, err = run_main(capsys, "verify-export", FIXTURES / "core019_tied_pp2", hf, "--family", "gpt9")
    assert rc == 2 and "unknown family 'gpt9'" in err


def test_a_mapping_file_adds_a_family(capsys, export_copy, tmp_path):
    hf = export_copy("core019_tied_pp2")
    config = json.loads((hf / "config.json").read_text())
    config["model_type"] = "my_llama"
    (hf / "config.json").write_text(json.dumps(config))
    mapping = tmp_path / "mapping.toml"
    layer = "model.layers.{layer}."
    copy = '{transform = "copy", hf = '
    mapping.write_text(
        "[mine]\n"
        'model_types = ["my_llama"]\n'
        "[mine.global]\n"
        '"embedding.word_embeddings.weight" = {transform = "vocab", hf = ["model.embed_tokens.weight"]}\n'
        '"decoder.final_layernorm.weight" = {transform = "copy", hf = ["model.norm.weight"]}\n'
        "[mine.layer]\n"
        f'"self_attention.linear_qkv.layer_norm_weight" = {copy}["{layer}input_layernorm.weight"]}}\n'
        f'"self_attention.linear_qkv.weight" = {{transform = "qkv", hf = ["{layer}self_attn.q_proj.weight", '
        f'"{layer}self_attn.k_proj.weight", "{layer}self_attn.v_proj.weight"]}}\n'
        f'"self_attention.linear_proj.weight" = {{transform = "copy", hf = ["{layer}self_attn.o_proj.weight"]}}\n'
        f'"mlp.linear_fc1.layer_norm_weight" = {copy}["{layer}post_attention_layernorm.weight"]}}\n'
        f'"mlp.linear_fc1.weight" = {{transform = "gate_up", hf = ["{layer}mlp.gate_proj.weight", '
        f'"{layer}mlp.up_proj.weight"]}}\n'
        "[mine.config]\n"
        'hidden_size = "hidden_size"\n'
    )
    rc, report, _ = _verify(capsys, "core019_tied_pp2", hf, "--mapping", mapping)
    assert rc == 1 and report["family"] == "mine"
    # the file's table has no rule for linear_fc2: that checkpoint tensor is unmapped, its HF tensors extra
    assert {f["megatron_key"] for f in _codes(report, "warning")["unmapped"]} == {
        "decoder.layers.mlp.linear_fc2.weight"
    }
    assert {f["hf_name"] for f in _codes(report)["extra"]} == {f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)}
    mapping.write_text('[mine]\nmodel_types = ["my_llama"]\n[mine.layer]\n"x" = {transform = "split3", hf = ["a"]}\n')
    rc, out, err = run_main(capsys, "verify-export", FIXTURES / "core019_tied_pp2", hf, "--mapping", mapping)
    assert rc == 2 and "transform 'split3' is not one of copy, qkv, gate_up, vocab" in err


def test_name_only_and_stat(capsys, export_copy):
    hf = export_copy("core019_tp1")
    _rewrite(hf, _shard_of(hf, "lm_head.weight"), lambda t: t.pop("lm_head.weight"))
    rc, out, _ = run_main(capsys, "verify-export", FIXTURES / "core019_tp1", hf, "--name-only")
    assert rc == 1 and out == "lm_head.weight\n"
    rc, out, _ = run_main(capsys, "verify-export", FIXTURES / "core019_tp1", hf, "--stat")
    assert rc == 1 and "findings by code: missing 1" in out


def test_metadata_only_verification_imports_no_torch(export_copy):
    hf = export_copy("core019_moe_mixed_shared_ep2")
    (hf / "config.json").write_text(
        (hf / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06')
    )
    code = (
        "import sys; from ckptdoctor.cli import main; "
        f"rc = main(['verify-export', {str(FIXTURES / 'core019_moe_mixed_shared_ep2')!r}, {str(hf)!r}]); "
        "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "config.json rms_norm_eps = 1e-06, the saved args' norm_epsilon = 1e-05" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "no torch"


def test_a_tensor_in_two_shards_and_a_shard_the_index_never_names(capsys, export_copy):
    hf = export_copy("core019_tp1")
    index = _index(hf)
    first, third = hf / "model-00001-of-00003.safetensors", hf / "model-00003-of-00003.safetensors"
    name = next(n for n, s in sorted(index["weight_map"].items()) if s == first.name)
    safetensors_torch = pytest.importorskip("safetensors.torch")
    value = safetensors_torch.load_file(str(first))[name]
    _rewrite(hf, third, lambda t: t.update({name: value}))
    _write_index(hf, index)  # the index still says the first shard
    shutil.copy(first, hf / "model-extra.safetensors")
    rc, report, _ = _verify(capsys, "core019_tp1", hf)
    assert rc == 1
    found = _codes(report)
    assert [(f["hf_name"], f["shard"]) for f in found["duplicate"]] == [(name, third.name)]
    assert [(f["hf_name"], f["shard"]) for f in found["orphan"]] == [(name, third.name)]
    assert [f["shard"] for f in _codes(report, "warning")["unindexed-file"]] == ["model-extra.safetensors"]


def test_a_header_length_past_the_end_of_the_file_and_a_shard_path_outside_the_dir(capsys, export_copy):
    hf = export_copy("core019_tp1")
    shard = hf / "model-00002-of-00003.safetensors"
    shard.write_bytes(struct.pack("<Q", 4096) + b'{"a": 1}')
    index = _index(hf)
    index["weight_map"]["model.layers.0.mlp.up_proj.weight"] = "../core019_tp1/model-00001-of-00003.safetensors"
    _write_index(hf, index)
    rc, report, _ = _verify(capsys, "core019_tp1", hf)
    assert rc == 1
    unreadable = {f["shard"]: f["message"] for f in _codes(report)["shard-unreadable"]}
    assert "header length 4096 runs past the end of the file (16 bytes)" in unreadable[shard.name]
    assert unreadable["../core019_tp1/model-00001-of-00003.safetensors"] == "the index names a path outside the dir"


def test_an_index_without_a_weight_map_is_one_line(capsys, export_copy):
    hf = export_copy("core019_tp1")
    _write_index(hf, {"metadata": {}})
    rc, out, err = run_main(capsys, "verify-export", FIXTURES / "core019_tp1", hf)
    assert rc == 2 and out == "" and "no weight_map of tensor names to shard files" in err
    (hf / INDEX).write_text("{not json")
    rc, out, err = run_main(capsys, "verify-export", FIXTURES / "core019_tp1", hf)
    assert rc == 2 and "the weight index is not JSON" in err


def test_the_json_is_the_document_the_generic_walk_writes(capsys, export_copy):
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.ops.verify_export.verify import VerifyOptions, verify_export
    from ckptdoctor.render.common import to_json
    from ckptdoctor.render.verify_export import to_json_text

    hf = export_copy("core019_tp1")
    _rewrite(hf, _shard_of(hf, "lm_head.weight"), lambda t: t.pop("lm_head.weight"))
    for values in (False, True):
        report = verify_export(open_checkpoint(FIXTURES / "core019_tp1"), hf, VerifyOptions(values=values))
        assert report.findings and report.tensors
        assert to_json_text(report) == to_json(report)


@pytest.mark.mcore  # make_synthetic.py writes the checkpoint with torch DCP in a child process
def test_per_expert_keys_of_a_dcp_written_moe_checkpoint(capsys, tmp_path):
    """A MoE checkpoint keyed per layer and per expert (``decoder.layers.<i>.mlp.experts.local_experts.<e>.``,
    written by real DCP through bench/make_synthetic.py) against an export whose names and shapes this test
    derives by hand from the saved dims."""
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    save = tmp_path / "moe"
    cmd = [sys.executable, str(REPO / "bench" / "make_synthetic.py"), "--out", str(save)]
    cmd += ["--total-bytes", "2M", "--keys", "300", "--files", "4"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    rc, out, _ = run_main(capsys, "show", save, "args", "--format", "json")
    args = json.loads(out)["value"]
    hidden, layers, experts = args["hidden_size"], args["num_layers"], args["num_experts"]
    heads, ffn, vocab = args["num_attention_heads"], args["moe_ffn_hidden_size"], args["padded_vocab_size"]
    kv = hidden // heads
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
        shapes |= {p + f"self_attn.{x}_proj.weight": (heads * kv, hidden) for x in "qkvo"}
        shapes[p + "mlp.gate.weight"] = (experts, hidden)
        for e in range(experts):
            x = p + f"mlp.experts.{e}."
            shapes |= {x + "gate_proj.weight": (ffn, hidden), x + "up_proj.weight": (ffn, hidden)}
            shapes[x + "down_proj.weight"] = (hidden, ffn)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(
            {"model_type": "qwen2_moe", "hidden_size": hidden, "num_hidden_layers": layers, "num_experts": experts}
        )
    )
    weights = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
    safetensors_torch.save_file(weights, str(hf / "model.safetensors"))
    rc, report, _ = _verify(capsys, save, hf)
    assert rc == 0, report["findings"]
    assert report["expected_tensors"] == len(shapes)
    expert_rows = [t for t in report["tensors"] if ".mlp.experts.1.up_proj" in t["name"]]
    assert {t["megatron_key"] for t in expert_rows} == {
        f"decoder.layers.{i}.mlp.experts.local_experts.1.linear_fc1.weight" for i in range(layers)
    }
    gone = {n for n in shapes if n.startswith("model.layers.3.mlp.experts.1.")}
    safetensors_torch.save_file({n: w for n, w in weights.items() if n not in gone}, str(hf / "model.safetensors"))
    rc, report, _ = _verify(capsys, save, hf)
    assert rc == 1
    assert {(f["hf_name"], f["layer"], f["expert"]) for f in _codes(report)["missing"]} == {(n, 3, 1) for n in gone}


def test_the_help_and_the_schema_name_every_built_in_family(capsys):
    from ckptdoctor.ops.verify_export.mapping import FAMILIES

    rc, out, _ = run_main(capsys, "verify-export", "--help")
    assert rc == 0
    text = " ".join(out.split())
    described = shipped_schema("verify-export")["properties"]["family"]["description"]
    for family in FAMILIES:
        assert family in text and family in described, family


def test_a_shape_naming_2_to_the_40_experts_is_unmapped_not_listed(tmp_path):
    """A .metadata whose stacked expert key claims 2^40 experts (a few bytes) would name 2^42 HF tensors: that key is
    unmapped with the count, the others are verified, in bounded memory and time (it was a MemoryError)."""
    from conftest import run_ckptdoctor
    from test_hostile_inputs import MEMORY_LIMIT

    from ckptdoctor.formats.torch_dist import dump_metadata_object, load_metadata_object

    save = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "core019_moe_ep2", save)
    path = next(save.glob("iter_*")) / ".metadata"
    metadata = load_metadata_object(path)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    item = metadata.state_dict_metadata[key]
    item.__dict__["size"] = type(item.size)((item.size[0], 1 << 40, *item.size[2:]))
    path.write_bytes(dump_metadata_object(metadata))
    proc = run_ckptdoctor(
        "verify-export", save, HF / "core019_moe_ep2", "--format", "json", timeout=60, memory_headroom=MEMORY_LIMIT
    )
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    (unmapped,) = _codes(report, "warning")["unmapped"]
    assert unmapped["megatron_key"] == key and "names 4,398,046,511,104 HF tensors" in unmapped["message"]
    assert "extra" in _codes(report)  # the export's fc1 tensors: nothing maps to them now


def test_reinitialised_wording_follows_whether_the_checkpoint_slice_moved():
    torch = pytest.importorskip("torch")
    from ckptdoctor.ops.verify_export.values import _reinitialised

    gen = torch.Generator().manual_seed(1)
    fresh = torch.randn((64, 64), generator=gen) * 0.02
    trained = torch.randn((64, 64), generator=gen) * 0.05  # far from init's std: it moved
    at_init = torch.randn((64, 64), generator=gen) * 0.02
    moved = _reinitialised(torch, trained, fresh, (0.02,))
    assert moved is not None and moved.startswith("re-initialised (") and "which has moved from init" in moved
    alike = _reinitialised(torch, at_init, fresh, (0.02,))
    assert alike is not None and alike.startswith("re-initialised or another model's (")
    assert _reinitialised(torch, at_init, at_init + 1e-4, (0.02,)) is None  # correlated: the same weights, perturbed
