"""edit's outputs loaded by real Megatron-LM code (megatron-core 0.19.2 and its megatron.training): weights-only
edits at TP=1, 2 and 4 with exactly the flags edit reports (and not without them), --compact output, removed
_extra_state, and the layer-spec presets against the keys the spec's model requests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, free_port, require_mcore

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.cli import main

SCRIPT = REPO / "tests" / "mcore_load_edited.py"
WEIGHTS_ONLY = ["--drop-section", "optimizer", "--drop-section", "rng", "--drop-section", "rerun"]
pytestmark = pytest.mark.mcore


def _edit(capsys, source: Path, out: Path, *args: str) -> dict:
    rc = main(["edit", str(source), *args, "--output", str(out), "--format", "json"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(stdout)


def _load(cases: list[dict], nproc: int = 1, dp: int = 1, layout: dict | None = None) -> str:
    args = [json.dumps(cases), "--dp", str(dp)] + (["--layout", json.dumps(layout)] if layout else [])
    if nproc == 1:
        command = [sys.executable, str(SCRIPT), *args]
    else:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
        command = [sys.executable, *launcher, str(SCRIPT), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for case in cases:
        verdict = "OK" if case["expect"] == "ok" else "FAILED-AS-EXPECTED"
        hits = proc.stdout.count(f"CASE {case['name']} {verdict} ")
        assert hits == nproc if verdict == "OK" else hits > 0, (case["name"], proc.stdout[-3000:])
    return proc.stdout


def _case(name: str, ckpt: Path, reference: str, flags: list[str], expect: str = "ok", **extra) -> dict:
    via = extra.pop("via", "load_checkpoint")
    return dict(
        name=name, via=via, ckpt=str(ckpt), reference=str(FIXTURES / reference), flags=flags, expect=expect, **extra
    )


@pytest.fixture(scope="module")
def weights_only(tmp_path_factory):
    """Weights-only edits of the TP=2 fixtures (model-space optimizer; distributed optimizer at DP=2), and their
    --compact twin, with the flags edit reports."""
    require_mcore()
    root = tmp_path_factory.mktemp("edited")
    out = {}
    for name, source, extra in [
        ("tp2", "core019_tp2", []),
        ("tp2_dp2", "core019_tp2_dp2", []),
        ("tp2_compact", "core019_tp2", ["--compact"]),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptdoctor", "edit", str(FIXTURES / source), *WEIGHTS_ONLY, *extra]
            + ["--output", str(root / name), "--format", "json"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        out[name] = (root / name, json.loads(proc.stdout))
    return out


def test_weights_only_edit_loads_at_tp1_with_the_reported_flags_only(weights_only):
    (tp2, report), (dp2, report_dp), (compact, report_c) = (weights_only[k] for k in ("tp2", "tp2_dp2", "tp2_compact"))
    flags = report["plan"]["load_flags"]
    assert flags == report_dp["plan"]["load_flags"] == report_c["plan"]["load_flags"] == ["--no-load-optim"]
    _load(
        [
            # without the reported flag Megatron-LM's load_checkpoint tries to restore the optimizer and fails
            _case("no-flags", tp2, "core019_tp2", [], "KeyError: 'optimizer'"),
            _case("reported-flags", tp2, "core019_tp2", flags),
            # the full checkpoint's dp_reshardable optimizer refuses a TP change; the weights-only edit loads
            _case(
                "full-dp2",
                FIXTURES / "core019_tp2_dp2",
                "core019_tp2_dp2",
                [],
                "not supported for DistributedOptimizer with sharding type dp_reshardable",
                dist_opt=True,
            ),
            _case("edited-dp2", dp2, "core019_tp2_dp2", flags, dist_opt=True),
            _case("compact", compact, "core019_tp2", flags),
        ]
    )


def test_weights_only_edit_loads_at_tp2_same_layout_without_rng_flags(weights_only, tmp_path):
    """Same TP/PP/world as saved: Megatron would request rng and rerun state; the edit's common state (args
    no_save_rng, no rerun_state_machine) makes it not, so --no-load-rng is not needed. Control: the same
    checkpoint with no_save_rng set back to false (fix-args) fails at that layout without --no-load-rng."""
    tp2, report = weights_only["tp2"]
    flags = report["plan"]["load_flags"]
    assert "--no-load-rng" not in flags
    control = tmp_path / "control"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "fix-args", str(tp2), "--output", str(control)]
        + ["--set", "no_save_rng=false", "--only-set"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    stdout = _load(
        [
            _case("same-layout", tp2, "core019_tp2", flags),
            _case("control", control, "core019_tp2", flags, "Missing key in checkpoint state_dict: rng_state/"),
        ],
        nproc=2,
    )
    assert stdout.count("CASE same-layout OK ") == 2
    assert len(re.findall(r"CASE same-layout OK rank \d tp 2: \d+ parameters equal, rng restored 0\n", stdout)) == 2


def test_weights_only_edit_loads_at_tp4(weights_only):
    (tp2, report), (dp2, _) = weights_only["tp2"], weights_only["tp2_dp2"]
    flags = report["plan"]["load_flags"]
    _load(
        [
            _case("tp4", tp2, "core019_tp2", flags),
            _case("tp4-dp2-source", dp2, "core019_tp2_dp2", flags, dist_opt=True),
        ],
        nproc=4,
    )


def test_weights_only_edit_of_a_chained_moe_optimizer_loads_at_another_ep(capsys, tmp_path):
    """An MoE model's distributed optimizer saves its buckets as chained_0./chained_1.optimizer.distributed.*: they
    are optimizer items, so the weights-only edit drops them too, and its output loads at EP=1 with the reported
    flag, where the full checkpoint fails (a run at EP=1 builds one optimizer and requests them unprefixed: the
    real load of tests/can_load_matrix.jsonl's moe-distopt-to-ep1)."""
    require_mcore()
    source = FIXTURES / "core019_moe_ep2_distopt"
    report = _edit(capsys, source, tmp_path / "weights", *WEIGHTS_ONLY)
    flags = report["plan"]["load_flags"]
    assert flags == ["--no-load-optim"]
    assert not [k for k in open_checkpoint(tmp_path / "weights").entries if k.startswith(("chained_", "optimizer"))]
    _load(
        [_case("edited-chained", tmp_path / "weights", source.name, flags, dist_opt=True)],
        nproc=2,
        dp=2,
        layout={"ep": 1, "num_experts": 4},
    )


def test_removed_extra_state_and_spec_presets_load(capsys, tmp_path):
    require_mcore()
    src = FIXTURES / "core019_tp2"
    _edit(capsys, src, tmp_path / "no_extra", "--remove", "_extra_state")
    _edit(capsys, src, tmp_path / "local", "--preset", "te-to-local")
    _edit(capsys, tmp_path / "local", tmp_path / "back", "--preset", "local-to-te")
    stdout = _load(
        [
            # a model whose linear layers keep no extra state requests no _extra_state item: loads cleanly
            _case(
                "no-extra", tmp_path / "no_extra", "core019_tp2", [], via="dist", no_extra_state=True, print_keys=True
            ),
            # the fixture's own model does request them: the edited checkpoint is not for it
            _case("needs-extra", tmp_path / "no_extra", "core019_tp2", [], "_extra_state", via="dist"),
            # module names (a local-spec layer without sharded_state_dict_keys_map): what te-to-local gives
            _case("local", tmp_path / "local", "core019_tp2", [], via="dist", module_names=True, print_keys=True),
            _case(
                "local-vs-te", tmp_path / "local", "core019_tp2", [], "layer_norm_weight from model not in", via="dist"
            ),
            # and back: the spec's keys map, i.e. Transformer Engine's fused norm names
            _case("te", tmp_path / "back", "core019_tp2", [], via="dist", print_keys=True),
        ]
    )
    requested = {
        line.split(" ", 2)[1]: set(json.loads(line.split(" ", 2)[2]))
        for line in stdout.splitlines()
        if line.startswith("KEYS ")
    }
    for case, directory in [("no-extra", "no_extra"), ("local", "local"), ("te", "back")]:
        model_keys = {k for k, e in open_checkpoint(tmp_path / directory).entries.items() if e.section == "model"}
        # the edited model section is exactly what the model requests, _extra_state objects included
        assert model_keys == requested[case], (case, model_keys ^ requested[case])
    assert not any("_extra_state" in k for k in requested["no-extra"])
    assert {"decoder.layers.input_layernorm.weight", "decoder.layers.pre_mlp_layernorm.weight"} <= requested["local"]
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in requested["te"]


def _te_spec_key(key: str, keys: set[str], spec: dict[str, dict[str, str]]) -> str:
    """The name megatron-core's TE layer spec gives a local-spec module-name key: a norm the spec makes an
    IdentityOp lives in the one LayerNorm-fused linear of the submodule after it (TransformerLayer's order:
    input_layernorm -> self_attention, pre_mlp_layernorm -> mlp), as Transformer Engine's LayerNormLinear names its
    parameters (layer_norm_weight, layer_norm_bias); a norm the spec keeps as a module keeps its name."""
    match = re.fullmatch(r"(.*\.|)(input_layernorm|pre_mlp_layernorm)\.(weight|bias)", key)
    if match is None:
        return key
    layer, norm, param = match.groups()
    submodules = spec["moe" if f"{layer}mlp.router.weight" in keys else "dense"]
    if submodules[norm] != "IdentityOp":
        return key
    after = "self_attention." if norm == "input_layernorm" else "mlp."
    fused = [path for path, name in submodules.items() if path.startswith(after) and "LayerNorm" in name]
    assert len(fused) == 1 and submodules[fused[0]] == "TELayerNormColumnParallelLinear", fused
    return f"{layer}{fused[0]}.layer_norm_{param}"


def test_local_to_te_gives_the_keys_of_megatron_cores_te_spec(capsys, tmp_path):
    """local-to-te against megatron-core 0.19.2's Transformer Engine GPT layer spec itself (built without TE by
    tests/mcore_te_spec.py), dense, MoE and a model of both (per-layer keys); te-to-local gives the module names."""
    require_mcore()
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "mcore_te_spec.py")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = json.loads(proc.stdout)
    assert spec["dense"]["pre_mlp_layernorm"] == "IdentityOp" and spec["moe"]["pre_mlp_layernorm"] != "IdentityOp"

    def model_keys(directory: Path) -> set[str]:
        return {k for k, e in open_checkpoint(directory).entries.items() if e.section == "model"}

    for fixture in ("core019_tp2", "core019_moe_ep2", "core019_moe_mixed_shared_ep2"):
        local, te = tmp_path / fixture / "local", tmp_path / fixture / "te"
        _edit(capsys, FIXTURES / fixture, local, "--preset", "te-to-local")
        _edit(capsys, local, te, "--preset", "local-to-te")
        local_keys = model_keys(local)
        assert any("pre_mlp_layernorm" in k for k in local_keys) and not any("layer_norm_" in k for k in local_keys)
        expected = {_te_spec_key(k, local_keys, spec) for k in local_keys}
        assert model_keys(te) == expected, (fixture, model_keys(te) ^ expected)
        if fixture == "core019_tp2":  # a dense model saved by the local spec's keys map has the TE names already
            assert expected == model_keys(FIXTURES / fixture)
        else:  # the MoE layers' pre-MLP norm, which that map saves as mlp.linear_fc1.layer_norm_weight
            assert any(k.endswith("pre_mlp_layernorm.weight") for k in expected)
            assert expected != model_keys(FIXTURES / fixture)


def test_dropped_redundant_extra_state_loads_with_the_reported_strictness(capsys, tmp_path):
    """edit --drop-redundant-extra-state keeps only the keys with delayed-scaling state (the TE 1.x BytesIO of
    core019_te_mixed's layer 0, and with it layer 1's); megatron-core 0.19.2 still requests the dropped ones: the
    default strictness fails, the strictness the report names loads every parameter. A key with one shard
    dropped fails under that strictness too: why the edit keeps such keys whole."""
    require_mcore()
    src = FIXTURES / "core019_te_mixed"
    report = _edit(capsys, src, tmp_path / "lean", "--drop-redundant-extra-state")
    assert any("log_unexpected" in note for note in report["plan"]["load_notes"])
    left = {k for k in open_checkpoint(tmp_path / "lean").entries if "_extra_state" in k}
    # linear_proj: layer 0 holds FP8 state, layer 1 none; the key is kept whole, because a partial key fails
    assert left == {f"decoder.layers.self_attention.linear_proj._extra_state/shard_{i}_2" for i in range(2)}
    _edit(capsys, src, tmp_path / "partial", "--remove", r"linear_proj\._extra_state/shard_1_2")
    _load(
        [
            _case("lean-default", tmp_path / "lean", "core019_te_mixed", [], "_extra_state", via="dist"),
            _case("lean-log", tmp_path / "lean", "core019_te_mixed", [], via="dist", strictness="log_unexpected"),
            _case(
                "partial-log",
                tmp_path / "partial",
                "core019_te_mixed",
                [],
                "Missing key in checkpoint state_dict: decoder.layers.self_attention.linear_proj._extra_state/shard_1",
                via="dist",
                strictness="log_unexpected",
            ),
        ]
    )
    # can-load predicts both outcomes of the real loads above (its model section; TE's refusal is another one)
    for strictness, verdict in (("assume_ok_unexpected", "fails"), ("log_unexpected", "loads")):
        capsys.readouterr()
        main(["can-load", str(tmp_path / "lean"), "--target", "tp=1", "--format", "json", "--strictness", strictness])
        sections = {s["section"]: s for s in json.loads(capsys.readouterr().out)["sections"]}
        assert sections["model"]["verdict"] == verdict, (strictness, sections["model"])


def test_removed_or_renamed_model_keys_fail_a_real_load_as_can_load_predicts(capsys, tmp_path):
    """A model key removed or renamed by edit: the model that saved the checkpoint still requests it, and
    megatron-core's load fails naming it; can-load's model section says so (it predicted LOADS: its requests
    were made from the saved keys), and edit's notes say what a load needs."""
    require_mcore()
    src = FIXTURES / "core019_tp1"
    renamed = _edit(capsys, src, tmp_path / "renamed", "--rename", "final_layernorm", "final_norm")
    assert renamed["plan"]["load_flags"] == [] and any("renamed" in n for n in renamed["plan"]["load_notes"])
    _edit(capsys, src, tmp_path / "removed", "--remove", r"linear_qkv\.weight$")
    _load(
        [
            _case("renamed", tmp_path / "renamed", "core019_tp1", [], "decoder.final_layernorm.weight", via="dist"),
            _case("removed", tmp_path / "removed", "core019_tp1", [], "linear_qkv.weight", via="dist"),
        ]
    )
    for name, key in (("renamed", "decoder.final_layernorm.weight"), ("removed", "linear_qkv.weight")):
        capsys.readouterr()
        rc = main(["can-load", str(tmp_path / name), "--target", "tp=1", "--format", "json"])
        sections = {s["section"]: s for s in json.loads(capsys.readouterr().out)["sections"]}
        assert rc == 1 and sections["model"]["verdict"] == "fails" and key in sections["model"]["why"], sections
