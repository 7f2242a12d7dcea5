"""``ckptdoctor can-load``: predictions against real megatron-core 0.19.2 loads (tests/can_load_matrix.jsonl).

The fast tests compare each cell's prediction with the outcome recorded from a real load; the ``mcore`` test
runs every real load again (tests/mcore_load_target.py, torchrun on gloo) and compares both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REPO, require_mcore, run_cli, shipped_schema

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.ops.can_load.args_from import load_yaml_args
from ckptdoctor.ops.can_load.predict import CanLoadReport, predict
from ckptdoctor.ops.can_load.run import Layout, LoadRun, parse_target
from ckptdoctor.render.common import to_json

MATRIX = REPO / "tests" / "can_load_matrix.jsonl"
ROWS = [json.loads(line) for line in MATRIX.read_text().splitlines() if line.strip()]
SCHEMA = shipped_schema("can-load")


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """``ckptdoctor ARGS`` in this process (the subprocess test below proves no torch is imported)."""
    from ckptdoctor.cli import main

    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def predict_cell(row: dict) -> CanLoadReport:
    run = LoadRun(
        finetune=row.get("finetune", False),
        no_load_optim=row.get("no_load_optim", False),
        no_load_rng=row.get("no_load_rng", False),
        strictness=row.get("strictness", "assume_ok_unexpected"),
        use_distributed_optimizer=row.get("use_distributed_optimizer"),
        use_checkpoint_args=row.get("use_checkpoint_args", False),
        sets=row.get("set", {}),
        virtual_stages=row.get("vpp", 1),  # the harness's run has virtual stages only where the cell says
    )
    return predict(open_checkpoint(FIXTURES / row["fixture"]), row["target"], run)


def assert_agrees(row: dict, outcome: dict) -> None:
    """The prediction has the real load's verdict; a failure names the section(s) the real error is about
    and megatron's exception type."""
    report = predict_cell(row)
    assert report.verdict == outcome["outcome"], (row["id"], report.failing_sections, outcome)
    if outcome["outcome"] == "corrupts":  # megatron raised nothing: the sections whose state the load misplaced
        assert set(outcome["sections"]) == set(report.failing_sections), (row["id"], report.failing_sections, outcome)
    if outcome["outcome"] == "fails":
        assert report.failing_sections, row["id"]
        assert set(outcome["sections"]) <= set(report.failing_sections), (row["id"], report.failing_sections, outcome)
        kinds = {s.error.split(":", 1)[0] for s in report.sections if s.error}
        assert outcome["error"].split(":", 1)[0] in kinds, (row["id"], kinds, outcome["error"])


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_prediction_matches_recorded_real_load(row):
    assert "expect" in row, f"{row['id']}: no recorded outcome (run tests/mcore_load_target.py --matrix OUT --record)"
    assert_agrees(row, row["expect"])


def test_matrix_covers_the_issue():
    targets = {(r["fixture"], r["target"]) for r in ROWS}
    tps = {parse_target(t, Layout(1, 1, 1, 1, 1, 1)).tp for _, t in targets}
    assert {1, 2, 4} <= tps
    assert any(r.get("finetune") for r in ROWS) and any(r.get("no_load_rng") for r in ROWS)
    assert any(r.get("no_load_optim") for r in ROWS) and any("num_layers" in r.get("set", {}) for r in ROWS)
    assert len({r.get("strictness", "assume_ok_unexpected") for r in ROWS}) >= 3
    assert {r["expect"]["outcome"] for r in ROWS} == {"loads", "fails", "corrupts"}


# About 4 minutes on 2 cores (every cell's process groups released after it; leaked, the matrix took over an hour).
REAL_LOADS_TIMEOUT = 1500


@pytest.mark.mcore
def test_real_loads_match_matrix_and_prediction(tmp_path):
    require_mcore()
    out = tmp_path / "results.json"
    start = time.monotonic()
    # Its own session: on a timeout the whole group is stopped (torchrun, on SIGTERM, stops its ranks, which run in
    # sessions of their own and would otherwise keep both cores busy for the rest of the run).
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "mcore_load_target.py"), "--matrix", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=REAL_LOADS_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"the real loads ran past {REAL_LOADS_TIMEOUT} s (killed): {stdout[-2000:]}{stderr[-2000:]}")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    results = json.loads(out.read_text())
    print(f"{len(results)} real loads in {time.monotonic() - start:.0f} s")
    for row in ROWS:
        real = results[row["id"]]
        assert real["outcome"] == row["expect"]["outcome"], (row["id"], real, row["expect"])
        assert real.get("sections") == row["expect"].get("sections"), (row["id"], real)
        assert_agrees(row, real)


# --- the CLI -----------------------------------------------------------------------------------------------


def test_cli_exit_codes_and_json_schema():
    ok = run_cli(
        "can-load", str(FIXTURES / "core019_tp1"), "--target", "tp=2", "--format", "json", block=("torch", "megatron")
    )
    assert ok.returncode == 0, ok.stderr
    assert "IMPORTED:\n" in ok.stderr or ok.stderr.rstrip().endswith("IMPORTED:")
    report = json.loads(ok.stdout)
    jsonschema.validate(report, SCHEMA)
    sections = {s["section"]: s for s in report["sections"]}
    assert sections["model"]["verdict"] == "reshards" and sections["rng"]["verdict"] == "skipped"
    assert report["target"] == {"tp": 2, "pp": 1, "ep": 1, "etp": 2, "cp": 1, "dp": 1, "world": 2}

    bad = run_cli("can-load", str(FIXTURES / "core019_tp2_dp2"), "--target", "tp=1", "--format", "json")
    assert bad.returncode == 1
    failing = json.loads(bad.stdout)
    jsonschema.validate(failing, SCHEMA)
    assert failing["failing_sections"] == ["optimizer"]
    (optim,) = [s for s in failing["sections"] if s["section"] == "optimizer"]
    assert "not supported for DistributedOptimizer with sharding type dp_reshardable" in optim["error"]
    assert "--no-load-optim" in optim["fix"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tp=two", "is not NAME=N"),
        ("tp=2,xx=1", "unknown field 'xx'"),
        ("dp=2,world=4", "dp or world"),
        ("tp=0", "must be >= 1"),
        ("tp=" + "9" * 5000, "is too large"),  # int() refuses 5,000 digits: was an internal error
    ],
)
def test_bad_target_is_one_clear_error(capsys, spec, message):
    rc, _, err = cli(capsys, "can-load", str(FIXTURES / "core019_tp1"), "--target", spec)
    assert rc == 2 and err.count("\n") == 1
    assert message in err and "Traceback" not in err and "internal error" not in err


def test_text_output_names_the_failure_and_fix(capsys):
    rc, out, _ = cli(capsys, "can-load", str(FIXTURES / "core019_tp1"), "--target", "tp=1", "--set", "num_layers=3")
    assert rc == 1
    assert "Global shape mismatch for loaded" in out and "num_layers 2->3" in out
    assert "WILL NOT LOAD (fails: args, model, optimizer)" in out


def test_a_load_that_raises_nothing_but_misplaces_the_expert_buckets_is_loads_wrong(capsys):
    """EP x ETP kept (ETP 2 -> EP 2): the expert buckets keep their keys and sizes, megatron raises nothing and the
    saved moments land on other experts (cells moe-etp2-distopt-to-ep2, moe-distopt-to-ep1-etp2)."""
    ckpt = str(FIXTURES / "core019_moe_etp2_bf16_distopt")
    rc, out, _ = cli(capsys, "can-load", ckpt, "--target", "ep=2,etp=1", "--format", "json")
    assert rc == 1
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    assert (report["verdict"], report["will_load"], report["failing_sections"]) == ("corrupts", False, ["optimizer"])
    (optim,) = [s for s in report["sections"] if s["section"] == "optimizer"]
    assert optim["verdict"] == "corrupts" and optim["error"] is None and "--no-load-optim" in optim["fix"]
    assert "EP x ETP = 2" in optim["why"] and "main params" in optim["why"]
    rc, out, _ = cli(capsys, "can-load", ckpt, "--target", "ep=2,etp=1")
    assert rc == 1 and "LOADS WRONG (corrupts: optimizer)" in out and "fix: --no-load-optim" in out
    # Another EP x ETP changes the buckets' size: megatron raises, a failure as before.
    rc, out, _ = cli(capsys, "can-load", ckpt, "--target", "ep=2,etp=2,dp=4")
    assert rc == 1 and "Global shape mismatch" in out and "WILL NOT LOAD (fails: optimizer)" in out
    # --suggest offers that layout only with a fresh optimizer.
    rc, out, _ = cli(capsys, "can-load", ckpt, "--suggest", "--limit", "0", "--format", "json")
    listed = {(s["spec"], tuple(s["flags"])) for s in json.loads(out)["suggestions"]}
    at_ep2 = {flags for spec, flags in listed if "ep=2,etp=1" in spec and "cp=1" in spec}
    assert at_ep2 == {("--no-load-optim",)}, listed


def test_the_runs_virtual_pipeline_stages_decide_the_dp_reshardable_buckets(capsys):
    """The buckets are kept per model chunk: a run at another --num-virtual-stages-per-pipeline-rank fails them
    (cells vpp-distopt-to-no-vpp, pp2-distopt-to-vpp2); the default is the saved value."""
    vpp_ckpt = str(FIXTURES / "core019_pp2_vpp2_distopt")
    rc, out, _ = cli(capsys, "can-load", vpp_ckpt, "--target", "pp=2", "--format", "json")
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    assert rc == 0 and report["options"]["virtual_stages"] is None and report["verdict"] == "loads"
    rc, out, _ = cli(capsys, "can-load", vpp_ckpt, "--target", "pp=2", "--num-virtual-stages-per-pipeline-rank", "1")
    assert rc == 1 and "virtual pipeline stages 2->1" in out and "Global shape mismatch" in out
    assert "--num-virtual-stages-per-pipeline-rank 2 as saved" in out
    plain = str(FIXTURES / "core019_pp2_distopt")
    rc, out, _ = cli(capsys, "can-load", plain, "--target", "pp=2", "--num-virtual-stages-per-pipeline-rank", "2")
    assert rc == 1 and "virtual pipeline stages 1->2" in out
    # Without the distributed optimizer's buckets the virtual stages change nothing a load reads.
    rc, _, _ = cli(
        capsys,
        "can-load",
        str(FIXTURES / "core019_pp2_vpp2"),
        "--target",
        "pp=2",
        "--num-virtual-stages-per-pipeline-rank",
        "1",
    )
    assert rc == 0


def test_without_a_bucket_size_a_dp_past_40_moves_ddps_default_bucket_size():
    """DistributedDataParallel closes buckets at max(40M, 1M x DP) elements under --overlap-grad-reduce without
    --ddp-bucket-size (the explicit sizes are real loads: cells buckets-*); a buffer over 40M elements saved in
    several buckets is cut elsewhere at DP 64, not at DP 16; an explicit size pins it."""
    from ckptdoctor.ops.can_load.buckets import bucket_regrouping

    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_{}.{}"
    present = {bucket.format(i, state): (n,) for i, n in enumerate((40_000_128, 12_000_000)) for state in ("param",)}
    args = {"overlap_grad_reduce": True, "ddp_bucket_size": None}
    saved = Layout(tp=8, pp=1, ep=1, etp=8, cp=1, dp=32)

    def regrouped(dp: int, run_args: dict) -> str | None:
        verdict = bucket_regrouping(present, args, run_args, LoadRun(), saved, replace(saved, dp=dp))
        return verdict.why if verdict else None

    assert regrouped(16, args) is None and regrouped(40, args) is None
    why = regrouped(64, args)
    assert why and "40,000,000 elements->64,000,000 elements" in why
    assert regrouped(64, {**args, "ddp_bucket_size": 40_000_000}) is None  # pinned
    assert regrouped(32, {**args, "overlap_grad_reduce": False}) is not None  # one bucket a buffer now
    whole = {bucket.format(0, "param"): (30_000_000,)}  # saved in one bucket: cut again only below its size
    assert bucket_regrouping(whole, args, args, LoadRun(), saved, replace(saved, dp=64)) is None


# --- the modelling, cell by cell -----------------------------------------------------------------------------


def test_target_defaults_to_saved_layout():
    saved = Layout(tp=2, pp=1, ep=1, etp=2, cp=1, dp=2)
    assert parse_target("pp=2", saved) == Layout(tp=2, pp=2, ep=1, etp=2, cp=1, dp=2)
    assert parse_target("tp=4,world=8", saved) == Layout(tp=4, pp=1, ep=1, etp=4, cp=1, dp=2)
    # A layout megatron refuses is a prediction (tests/test_can_load_layout.py), not bad input.
    assert parse_target("ep=3", saved) == Layout(tp=2, pp=1, ep=3, etp=2, cp=1, dp=2)
    with pytest.raises(CkptError):
        parse_target("dp=2,world=4", saved)


def test_saved_expert_layout_is_the_chunks_where_the_args_are_inherited():
    """core019_convert_moe_ep2's args keep its source's ETP=2; the experts were saved whole (ETP=1) at EP=2."""
    ckpt = open_checkpoint(FIXTURES / "core019_convert_moe_ep2")
    report = predict(ckpt, "ep=2", LoadRun(no_load_optim=True))
    assert (report.saved["ep"], report.saved["etp"]) == (2, 1)
    assert report.saved["source"] == "args, expert layout from the chunk grids"
    assert report.target["etp"] == 1 and report.will_load  # the args' ETP=2 would not fit EP=2 in a world of 2
    honest = predict(open_checkpoint(FIXTURES / "core019_moe_etp2"), "dp=2", LoadRun(no_load_optim=True))
    assert honest.saved["source"] == "args" and honest.saved["etp"] == 2


def test_trainable_only_save_counts_the_dense_base_it_lacks_as_a_lower_bound():
    """core019_peft_trainable_tp2 holds the 4 LoRA adapters only; the run requests the whole base model: its
    embedding, final norm, output layer and every layer's four linears at least (the norms depend on the spec)."""
    report = predict(open_checkpoint(FIXTURES / "core019_peft_trainable_tp2"), "tp=2", LoadRun())
    (model,) = [s for s in report.sections if s.section == "model"]
    assert model.verdict == "fails" and "requests at least 7 keys the checkpoint lacks" in model.why
    full = open_checkpoint(FIXTURES / "core019_peft_full_tp2")
    base = {e.key for e in full.section_entries("model") if e.kind == "tensor" and ".adapter." not in e.key}
    fused_norms = {k for k in base if k.endswith(".layer_norm_weight")}  # spec-dependent: not counted
    assert len(base) == 9 and len(base - fused_norms) == 7  # the 7 counted are the real base less the norms


def test_moe_at_tp_above_1_without_sequence_parallel_warns_of_the_first_step():
    """megatron-core's MoELayer raises in its first training forward (not at load) when TP > 1 without sequence
    parallelism: the verdict stays LOADS, a warning says what the run will meet."""
    ckpt = open_checkpoint(FIXTURES / "core019_moe_ep2")
    warned = predict(ckpt, "tp=2,ep=1,dp=1", LoadRun(no_load_optim=True))
    assert warned.will_load and any("MoELayer: ValueError: During training" in w for w in warned.warnings)
    with_sp = predict(ckpt, "tp=2,ep=1,dp=1", LoadRun(no_load_optim=True, sets={"sequence_parallel": True}))
    assert not any("sequence parallelism" in w for w in with_sp.warnings)
    dense = predict(open_checkpoint(FIXTURES / "core019_tp1"), "tp=2,dp=1", LoadRun(no_load_optim=True))
    assert not any("sequence parallelism" in w for w in dense.warnings)


def test_virtual_pipeline_sizes_megatron_refuses_fail_at_startup():
    """--num-virtual-stages-per-pipeline-rank: validate_args needs PP > 1, TransformerBlock a rank's layers
    divisible by the virtual stages (core019_pp2_vpp2: 4 layers)."""
    ckpt = open_checkpoint(FIXTURES / "core019_pp2_vpp2")
    cases = {
        ("pp=2", 3): "num_layers_per_pipeline_rank 2 should be divisible by vp_size 3",
        ("pp=4,dp=1", 2): "num_layers_per_pipeline_rank 1 should be divisible by vp_size 2",
        ("pp=1,dp=1", 2): "When interleaved schedule is used, pipeline-model-parallel size should be greater than 1",
        ("pp=2", 2): None,
        ("pp=2", 1): None,
    }
    for (target, vpp), error in cases.items():
        report = predict(ckpt, target, LoadRun(virtual_stages=vpp))
        (args,) = [s for s in report.sections if s.section == "args"]
        if error is None:
            assert args.verdict == "loads" and report.will_load, (target, vpp)
        else:
            assert args.verdict == "fails" and error in args.error, (target, vpp, args.error)


def test_gtp_remat_derived_from_the_shards_the_run_keeps():
    """core019_convert_tp1 keeps its TP=2 source's shards (2): with them (--use-checkpoint-args, or a --set)
    megatron derives GTP remat 2, which a world of 1 cannot hold; a fresh launch resolves them at its TP."""
    ckpt = open_checkpoint(FIXTURES / "core019_convert_tp1")
    for run in (
        LoadRun(no_load_optim=True, use_checkpoint_args=True),
        LoadRun(no_load_optim=True, sets={"tensor_parallel_num_weight_shards": 2}),
    ):
        (args,) = [s for s in predict(ckpt, "tp=1,dp=1", run).sections if s.section == "args"]
        assert args.verdict == "fails" and "total_model_size=2" in args.error
    assert predict(ckpt, "tp=1,dp=1", LoadRun(no_load_optim=True)).will_load


def test_set_of_another_type_than_the_saved_arg_is_a_usage_error():
    ckpt = open_checkpoint(FIXTURES / "core019_tp1")
    for sets in ({"num_layers": "abc"}, {"bf16": 1}, {"num_layers": 2.5}):
        with pytest.raises(CkptError, match="give a value of that type"):
            predict(ckpt, "tp=1", LoadRun(sets=sets))
    assert predict(ckpt, "tp=1", LoadRun(sets={"init_method_std": 1, "num_layers": 2})).will_load


@pytest.mark.parametrize(
    "sets, message",
    [
        ({"hidden_size": -32}, "a model size, a positive integer"),
        ({"num_attention_heads": 0}, "a model size, a positive integer"),
        ({"num_query_groups": 0}, "a model size, a positive integer"),
        ({"ffn_hidden_size": True}, "give a value of that type"),
        ({"num_layers": None}, "Megatron-LM requires num_layers"),
    ],
)
def test_set_of_an_impossible_model_size_is_a_usage_error(sets, message):
    """Megatron sizes tensors by these args or divides by them: no load is predicted from zero, a negative size or
    a required arg left unset (it was: LOADS with --finetune)."""
    ckpt = open_checkpoint(FIXTURES / "core019_gqa_qkln_tp2")
    with pytest.raises(CkptError, match=message):
        predict(ckpt, "tp=2", LoadRun(finetune=True, sets=sets))
    assert predict(ckpt, "tp=2", LoadRun(sets={"num_query_groups": None, "num_experts": None})).verdict != "error"


def test_optimizer_state_dropped_by_a_round_trip_points_at_no_load_optim_only(tmp_path):
    """core019_tp2_dp2 through fsdp_dtensor and back: its buckets are gone, its common state still says
    dp_reshardable. No optimizer choice finds the state, so the fix is --no-load-optim, not the other optimizer."""
    from ckptdoctor.cli import main

    assert main(["convert", str(FIXTURES / "core019_tp2_dp2"), "--to", "fsdp_dtensor", "-o", str(tmp_path / "f")]) == 0
    assert main(["convert", str(tmp_path / "f"), "--to", "torch_dist", "-o", str(tmp_path / "back")]) == 0
    ckpt = open_checkpoint(tmp_path / "back")
    for distributed in (None, False):
        report = predict(ckpt, "tp=2", LoadRun(use_distributed_optimizer=distributed))
        (optim,) = [s for s in report.sections if s.section == "optimizer"]
        assert optim.verdict == "fails" and optim.fix.startswith("--no-load-optim: the checkpoint holds no optimizer")
        assert "use-distributed-optimizer" not in optim.fix
    skipped = predict(ckpt, "tp=2", LoadRun(no_load_optim=True))
    assert "optimizer" not in skipped.failing_sections  # (the round trip dropped the rng and extra state too)


def test_dp_reshardable_reshards_only_where_dp_x_cp_changes():
    """The distributed optimizer shards over DP x CP: trading DP for CP keeps every rank's buckets."""
    ckpt = open_checkpoint(FIXTURES / "core019_tp2_dp2")
    same = predict(ckpt, "tp=2,pp=1,cp=2,dp=1", LoadRun())
    (optim,) = [s for s in same.sections if s.section == "optimizer"]
    assert optim.verdict == "loads"
    (optim,) = [s for s in predict(ckpt, "tp=2,pp=1,dp=1", LoadRun()).sections if s.section == "optimizer"]
    assert optim.verdict == "reshards"


def test_world_defaults_follow_dp_of_the_distributed_optimizer_fixture():
    report = predict(open_checkpoint(FIXTURES / "core019_tp2_dp2"), "dp=1", LoadRun())
    assert report.saved["dp"] == 2 and report.target["world"] == 2
    assert report.will_load
    (optim,) = [s for s in report.sections if s.section == "optimizer"]
    assert optim.verdict == "reshards" and "dp_reshardable" in optim.why


def test_gtp_weight_shards_fail_only_with_checkpoint_args():
    ckpt = open_checkpoint(FIXTURES / "core019_convert_tp4")
    kept = predict(ckpt, "tp=4", LoadRun(use_checkpoint_args=True, no_load_optim=True, no_load_rng=True))
    (args,) = [s for s in kept.sections if s.section == "args"]
    assert args.verdict == "fails"
    assert args.error == "ValueError: tensor_parallel_num_weight_shards (1) must be >= tensor_model_parallel_size (4)."
    fresh = predict(ckpt, "tp=4", LoadRun(no_load_optim=True, no_load_rng=True))
    assert fresh.will_load


def test_vocab_padding_is_an_allowed_mismatch():
    report = predict(open_checkpoint(FIXTURES / "core019_tp1"), "tp=1", LoadRun(sets={"padded_vocab_size": 256}))
    (model,) = [s for s in report.sections if s.section == "model"]
    assert report.will_load and "padded vocabulary 128 -> 256" in model.why


def test_dropping_strictness_breaks_swiglu_factory_merges():
    """log_unexpected drops requested keys the checkpoint lacks; a SwiGLU linear_fc1 among them (a
    ShardedTensorFactory) makes apply_factory_merges fail instead of leaving the param at its initial value."""
    ckpt = open_checkpoint(FIXTURES / "core019_tp2_dp2")
    strict = predict(ckpt, "tp=2,dp=1", LoadRun(use_distributed_optimizer=False))
    (optim,) = [s for s in strict.sections if s.section == "optimizer"]
    assert strict.failing_sections == ["optimizer"] and optim.error.startswith("KeyError: optimizer.state.")
    lenient = predict(ckpt, "tp=2,dp=1", LoadRun(use_distributed_optimizer=False, strictness="log_unexpected"))
    (optim,) = [s for s in lenient.sections if s.section == "optimizer"]
    assert lenient.failing_sections == ["optimizer"] and "apply_factory_merges" in optim.error
    fresh = predict(ckpt, "tp=2,dp=1", LoadRun(use_distributed_optimizer=False, no_load_optim=True))
    assert fresh.will_load


def test_zarr_is_not_loadable_by_current_core():
    report = predict(open_checkpoint(FIXTURES / "core014_zarr_tp2"), "tp=1", LoadRun())
    assert report.failing_sections[0] == "format" and "zarr" in report.sections[0].why


@pytest.mark.parametrize("with_pyyaml", [True, False])
def test_args_from_yaml(tmp_path, monkeypatch, capsys, with_pyyaml):
    config = tmp_path / "run_config.yaml"
    config.write_text("model:\n  num_layers: 3  # deeper\n  hidden_size: 32\n  num_moe_experts: null\nother: x\n")
    if not with_pyyaml:
        monkeypatch.setitem(sys.modules, "yaml", None)
    args = load_yaml_args(config)
    assert args["num_layers"] == 3 and args["num_experts"] is None
    rc, out, _ = cli(capsys, "can-load", str(FIXTURES / "core019_tp1"), "--target", "tp=1", "--args-from", str(config))
    assert rc == 1 and "num_layers 2->3" in out


def test_args_from_another_checkpoint(capsys):
    other = str(FIXTURES / "core019_tp1_pp2")
    rc, out, _ = cli(capsys, "can-load", str(FIXTURES / "core019_tp1"), "--target", "tp=1", "--args-from", other)
    assert rc == 1 and "num_layers 2->4" in out


def test_bad_set_is_a_usage_error(capsys):
    rc, _, err = cli(capsys, "can-load", str(FIXTURES / "core019_tp1"), "--target", "tp=1", "--set", "num layers")
    assert rc == 2 and "is not NAME=VALUE" in err and "Traceback" not in err


def test_rows_are_unique():
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    assert all(Path(FIXTURES / r["fixture"]).is_dir() for r in ROWS)


def test_release_checkpoint_loads_model_only(tmp_path):
    import shutil

    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "core019_tp1" / "iter_0000010", save / "release")
    (save / "latest_checkpointed_iteration.txt").write_text("release")
    report = predict(open_checkpoint(save), "tp=2", LoadRun())
    verdicts = {s.section: (s.verdict, s.why) for s in report.sections}
    assert report.will_load
    assert verdicts["optimizer"] == ("skipped", "not requested (a release checkpoint)")
    assert verdicts["rng"][0] == verdicts["rerun"][0] == "skipped"


def test_sharding_type_without_content_metadata():
    from ckptdoctor.ops.can_load.optim import sharding_type

    typed = {"content_metadata": {"distrib_optim_sharding_type": "fully_reshardable"}}
    assert sharding_type(typed, {}, LoadRun()) == "fully_reshardable"
    untyped = {"content_metadata": {"singleton_local_shards": False}}
    assert sharding_type(untyped, {}, LoadRun()) == "fully_sharded_model_space"
    assert sharding_type({}, {"ckpt_fully_parallel_save": True}, LoadRun()) == "fully_sharded_model_space"
    assert sharding_type({}, {}, LoadRun()) == "dp_zero_gather_scatter"
    assert sharding_type({}, {}, LoadRun(dist_optim_sharding_type="dp_reshardable")) == "dp_reshardable"


def test_startup_checks_at_the_target():
    ckpt = open_checkpoint(FIXTURES / "core019_tp1")
    report = predict(ckpt, "tp=8", LoadRun())
    (args,) = [s for s in report.sections if s.section == "args"]
    assert args.error == "ValueError: num_attention_heads (4) must be a multiple of tensor_model_parallel_size (8)."
    moe = predict(open_checkpoint(FIXTURES / "core019_moe_ep2"), "ep=3,dp=3", LoadRun())
    assert "args" in moe.failing_sections


def test_docs_matrix_lists_every_cell():
    page = (REPO / "docs" / "can-load-matrix.md").read_text()
    missing = [r["id"] for r in ROWS if f"| {r['id']} | {r['fixture']} | {r['target']} |" not in page]
    assert not missing, f"docs/can-load-matrix.md lacks {missing}"


def test_docs_example_is_current_output(capsys, monkeypatch):
    page = (REPO / "docs" / "commands" / "can-load.md").read_text()
    command = "$ ckptdoctor can-load fixtures/core019_tp2_dp2 --target tp=1\n"
    start = page.index(command) + len(command)
    shown = page[start : page.index("```\n", start)]
    monkeypatch.chdir(REPO)
    rc, out, _ = cli(capsys, "can-load", "fixtures/core019_tp2_dp2", "--target", "tp=1")
    assert rc == 1 and out == shown


@pytest.mark.parametrize(
    "sets, key, changed",
    [
        ({"swiglu": False}, "decoder.layers.mlp.linear_fc1.weight", "swiglu True->False"),
        (
            {"group_query_attention": True, "num_query_groups": 2},
            "decoder.layers.self_attention.linear_qkv.weight",
            "num_query_groups 4->2",
        ),
        ({"ffn_hidden_size": 128}, "decoder.layers.mlp.linear_fc1.weight", "ffn_hidden_size 64->128"),
    ],
)
def test_model_shape_changes_name_the_key_and_the_arg(sets, key, changed):
    report = predict(open_checkpoint(FIXTURES / "core019_tp1"), "tp=1", LoadRun(finetune=True, sets=sets))
    (model,) = [s for s in report.sections if s.section == "model"]
    assert model.verdict == "fails" and key in model.error and changed in model.fix
    assert model.error.startswith("CheckpointingException: Global shape mismatch for loaded (torch.Size([")


def test_set_of_a_layout_arg_is_refused_and_unknown_names_warned(capsys):
    ckpt = str(FIXTURES / "core019_tp1")
    rc, _, err = cli(capsys, "can-load", ckpt, "--target", "tp=1", "--set", "tensor_model_parallel_size=2")
    assert rc == 2 and "give it as --target tp=N" in err
    report = predict(open_checkpoint(FIXTURES / "core019_tp1"), "tp=1", LoadRun(sets={"num_layrs": 3}))
    assert report.will_load and report.warnings == [
        "--set num_layrs: not an arg of the checkpoint (a new arg, or a typo?)"
    ]


@pytest.mark.parametrize(
    "name", sorted(p.name for p in FIXTURES.iterdir() if (p / "latest_checkpointed_iteration.txt").exists())
)
def test_every_fixture_predicts_at_several_targets(name):
    ckpt = open_checkpoint(FIXTURES / name)
    for target in ("tp=1", "tp=2", "pp=2", "dp=2", "tp=4,pp=1,dp=2"):
        for run in (LoadRun(), LoadRun(finetune=True, strictness="raise_all")):
            report = predict(ckpt, target, run)
            doc = json.loads(to_json(report))
            jsonschema.validate(doc, SCHEMA)
            assert doc["will_load"] == (not doc["failing_sections"])
            assert all(s["error"] and s["fix"] for s in doc["sections"] if s["verdict"] == "fails"), doc["sections"]


def test_fully_reshardable_reshards_tp_but_not_into_a_plain_optimizer():
    """A fully_reshardable distributed-optimizer checkpoint stores model-space optimizer.state.* tensors, so TP/PP
    may change; a run without the distributed optimizer finds those keys but matches none of its param groups."""
    ckpt = open_checkpoint(FIXTURES / "core019_tp2_dp2_fully_reshardable")
    report = predict(ckpt, "tp=1,dp=1", LoadRun())
    (optim,) = [s for s in report.sections if s.section == "optimizer"]
    assert report.will_load and optim.verdict == "reshards"
    plain = predict(ckpt, "dp=1", LoadRun(use_distributed_optimizer=False))
    (optim,) = [s for s in plain.sections if s.section == "optimizer"]
    assert plain.failing_sections == ["optimizer"] and "fully_reshardable" in optim.why
    assert optim.error.startswith("ValueError: Could not find parameter group") and "--use-distributed" in optim.fix
    assert predict(ckpt, "dp=1", LoadRun(use_distributed_optimizer=False, no_load_optim=True)).will_load


def test_qk_layernorm_is_a_spec_choice_not_a_shape():
    """Without qk_layernorm the run requests no q_/k_layernorm: the saved ones are ignored (a warning), or fail
    raise_all; with it, a checkpoint that lacks them fails the default strictness (KeyError)."""
    gqa = open_checkpoint(FIXTURES / "core019_gqa_qkln_tp2")
    dropped = predict(gqa, "tp=2", LoadRun(sets={"qk_layernorm": False}))
    assert dropped.will_load
    assert [w for w in dropped.warnings if "q_layernorm" in w or "k_layernorm" in w], dropped.warnings
    strict = predict(gqa, "tp=2", LoadRun(sets={"qk_layernorm": False}, strictness="raise_all"))
    assert {"model", "optimizer"} <= set(strict.failing_sections)
    assert predict(gqa, "tp=4", LoadRun()).will_load and not predict(gqa, "tp=4", LoadRun()).warnings
    added = predict(open_checkpoint(FIXTURES / "core019_tp1"), "tp=1", LoadRun(sets={"qk_layernorm": True}))
    (model,) = [s for s in added.sections if s.section == "model"]
    assert added.failing_sections == ["model"] and "_layernorm.weight from model not in state dict" in model.error
    assert "qk_layernorm" in model.fix


def test_tied_embeddings_flip_requests_or_ignores_the_output_layer():
    """A tied checkpoint has no output_layer.weight: an untied run fails on it first (an allow_shape_mismatch key,
    looked up before any other: "KeyError: 'output_layer.weight'"); a tied run ignores an untied one's."""
    tied = open_checkpoint(FIXTURES / "core019_tied_pp2")
    assert predict(tied, "pp=1", LoadRun()).will_load
    untied = predict(tied, "pp=1", LoadRun(finetune=True, sets={"untie_embeddings_and_output_weights": True}))
    (model,) = [s for s in untied.sections if s.section == "model"]
    assert untied.failing_sections == ["model"] and model.error == "KeyError: 'output_layer.weight'"
    assert "untie_embeddings_and_output_weights False->True" in model.fix
    plain = open_checkpoint(FIXTURES / "core019_tp1")
    ignored = predict(plain, "tp=1", LoadRun(sets={"untie_embeddings_and_output_weights": False}))
    assert ignored.will_load and any("output_layer.weight" in w for w in ignored.warnings)
    tied_run = LoadRun(finetune=True, strictness="raise_all", sets={"untie_embeddings_and_output_weights": False})
    strict = predict(plain, "tp=1", tied_run)
    assert {"model", "optimizer"} <= set(strict.failing_sections)


def test_mixed_dense_moe_layers_and_shared_experts():
    """moe_layer_freq [0, 1] keys layers by index; a shared expert's shape follows its own size arg; the pattern
    must list every layer; a homogeneous run requests the stacked keys the checkpoint lacks."""
    ckpt = open_checkpoint(FIXTURES / "core019_moe_mixed_shared_ep2")
    assert predict(ckpt, "ep=2", LoadRun()).will_load
    shared = predict(ckpt, "ep=2", LoadRun(finetune=True, sets={"moe_shared_expert_intermediate_size": 64}))
    (model,) = [s for s in shared.sections if s.section == "model"]
    assert shared.failing_sections == ["model"] and "shared_experts.linear_fc1.weight" in model.error
    layers = predict(ckpt, "ep=2", LoadRun(finetune=True, sets={"num_layers": 3}))
    (args,) = [s for s in layers.sections if s.section == "args"]
    assert args.error.startswith("AssertionError: Invalid length of moe_layer_pattern: 2, expected 3")
    assert "moe_layer_freq" in args.fix
    stacked = predict(ckpt, "ep=2", LoadRun(finetune=True, sets={"moe_layer_freq": 1}))
    (model,) = [s for s in stacked.sections if s.section == "model"]
    assert stacked.failing_sections == ["model"] and model.error.startswith("KeyError: decoder.layers.")


def test_uneven_pipeline_split_is_validated_at_the_target():
    """decoder_first_pipeline_num_layers=1 of 3 layers: PP=2 and PP=3 split the rest evenly, PP=1 leaves 2 layers
    for no middle stage, PP=4 2 layers for 3 middle stages (TransformerConfig's ValueErrors)."""
    ckpt = open_checkpoint(FIXTURES / "core019_pp2_uneven")
    assert predict(ckpt, "pp=2", LoadRun()).will_load and predict(ckpt, "pp=3", LoadRun()).will_load
    for target, message in (("pp=1", "Mismatch: 2 middle layers"), ("pp=4", "middle stage: 2 must be divisible")):
        report = predict(ckpt, target, LoadRun())
        (args,) = [s for s in report.sections if s.section == "args"]
        assert report.failing_sections == ["args"] and message in args.error, (target, args.error)
    assert predict(ckpt, "pp=1", LoadRun(sets={"decoder_first_pipeline_num_layers": None})).will_load


# --- lost data files ---------------------------------------------------------------------------------------


def _can_load_json(*args: str) -> tuple[int, dict]:
    import contextlib
    import io

    from ckptdoctor.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["can-load", *args, "--format", "json"])
    report = json.loads(out.getvalue())
    jsonschema.validate(report, SCHEMA)
    return rc, report


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_lost_data_file_fails_the_data_section_at_every_layout(copy_fixture, damage):
    """A data file of the model's chunks removed or cut short (a copy that stopped): `check` says CKD113/CKD114;
    can-load says the load fails (torch's reader raises on the file or the short read), at the saved layout and at
    any other, and --suggest searches nothing."""
    save = copy_fixture("core019_tp2")
    data_file = save / "iter_0000010" / "__1_0.distcp"
    if damage == "missing":
        data_file.unlink()
    else:
        os.truncate(data_file, 1000)
    for target in ("tp=2", "tp=1"):
        rc, report = _can_load_json(str(save), "--target", target)
        assert rc == 1 and report["verdict"] == "fails" and report["failing_sections"][0] == "data", report
        (data,) = [s for s in report["sections"] if s["section"] == "data"]
        code = "CKD113" if damage == "missing" else "CKD114"
        assert data["why"].startswith(f"{code}: ") and "lost 38 chunks of 20 keys" in data["why"], data
    rc, suggested = _can_load_json(str(save), "--suggest")
    assert rc == 1 and suggested["blocked"] == ["data"] and suggested["search"]["predictions"] == 0


def test_lost_optimizer_chunks_fail_only_a_run_that_reads_them(copy_fixture):
    """A data file cut where only optimizer chunks follow: the default run fails (data), --no-load-optim and
    --finetune load with a warning naming the lost chunks, and --suggest finds the layouts with --no-load-optim."""
    save = copy_fixture("core019_tp2")
    ckpt = open_checkpoint(save)
    placed = [
        (chunk.storage.offset, key)
        for key, entry in ckpt.entries.items()
        for chunk in entry.chunks
        if chunk.storage.relative_path == "__0_0.distcp"
    ]
    cut = min(offset for offset, key in placed if key.startswith("optimizer."))
    assert all(key.startswith("optimizer.") for offset, key in placed if offset >= cut)
    os.truncate(save / "iter_0000010" / "__0_0.distcp", cut + 10)
    rc, report = _can_load_json(str(save), "--target", "tp=2")
    assert rc == 1 and report["failing_sections"] == ["data"], report
    for flag in ("--no-load-optim", "--finetune"):
        rc, report = _can_load_json(str(save), "--target", "tp=2", flag)
        assert rc == 0 and report["verdict"] == "loads", report
        assert any("(not read by this run)" in w and "optimizer.state." in w for w in report["warnings"])
    rc, suggested = _can_load_json(str(save), "--suggest")
    assert rc == 0 and suggested["blocked"] == [] and suggested["suggestions"], suggested
    assert all("--no-load-optim" in s["argv"] for s in suggested["suggestions"]), suggested["suggestions"]


@pytest.mark.parametrize(
    "edit, key",
    [
        (["--remove", r"^embedding\."], "embedding.word_embeddings.weight"),
        (["--remove", r"^decoder\.layers\."], "decoder.layers.mlp.linear_fc1.weight"),
        (["--rename", "final_layernorm", "final_norm"], "decoder.final_layernorm.weight"),
    ],
    ids=["embedding removed", "every layer removed", "final layernorm renamed"],
)
def test_keys_every_gpt_has_are_requested_though_not_saved(tmp_path, edit, key):
    """The run's model requests its embedding, final layernorm and layers' linears whatever was saved: an edit
    that removed or renamed them fails the model section (the real load of such edits: tests/test_edit_mcore.py)."""
    from ckptdoctor.cli import main

    out = tmp_path / "edited"
    assert main(["edit", str(FIXTURES / "core019_tp2"), *edit, "--output", str(out), "--format", "json"]) == 0
    rc, report = _can_load_json(str(out), "--target", "tp=2")
    (model,) = [s for s in report["sections"] if s["section"] == "model"]
    assert rc == 1 and model["verdict"] == "fails" and key in model["why"], model
