"""``can-load``: the target layout a loading run gets, and the layouts megatron refuses at startup (issue #35
item 3).

A fresh Megatron-LM launch takes its layout from its own command line; ``--use-checkpoint-args`` never copies
ETP or CP (``--use-mp-args-from-checkpoint-args`` copies TP, PP, VPP and EP), and ETP defaults to TP. So an
omitted ``etp`` is the target TP, not a dense checkpoint's saved ETP; and a layout megatron refuses (world size
by TP x PP x CP in ``validate_args``, by EP x ETP x PP in ``initialize_model_parallel``, EP without experts) is a
prediction (exit 1, section ``args``, megatron's message), not bad input. The ``mcore`` test runs megatron's own
checks on the same args and compares the messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REPO, free_port, require_mcore, shipped_schema

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.cli import main
from ckptdoctor.ops.can_load.predict import predict
from ckptdoctor.ops.can_load.run import Layout, LoadRun, parse_target

SCHEMA = shipped_schema("can-load")
EXPERT_WORLD = "RuntimeError: world_size ({}) is not divisible by expert_tensor_model_pipeline_parallel size ({})"


def cli(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, dict | str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if "json" in args and out else out), err


@pytest.fixture(scope="module")
def dense_etp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """core019_tp1 (dense, TP=1, world 1) whose saved args say expert_tensor_parallel_size=2."""
    out = tmp_path_factory.mktemp("etp2") / "ckpt"
    rc = main(
        ["fix-args", str(FIXTURES / "core019_tp1"), "--set", "expert_tensor_parallel_size=2", "--force", "-o", str(out)]
    )
    assert rc in (0, 1) and (out / "iter_0000010").is_dir()
    return out


def _args(doc: dict) -> dict:
    (section,) = [s for s in doc["sections"] if s["section"] == "args"]
    return section


@pytest.mark.parametrize("extra", [(), ("--use-checkpoint-args",)])
def test_dense_saved_etp_follows_the_target_tp(capsys, dense_etp2, extra):
    """Was exit 2, "--target: EP x ETP x PP = 2 does not divide the world size 1"."""
    rc, doc, err = cli(capsys, "can-load", dense_etp2, "--target", "tp=1", *extra, "--format", "json")
    assert rc == 0, (err, doc)
    jsonschema.validate(doc, SCHEMA)
    assert doc["saved"]["etp"] == 2 and doc["target"]["etp"] == 1
    (model,) = [s for s in doc["sections"] if s["section"] == "model"]
    assert model["verdict"] == "loads"  # ETP cuts no tensor of a dense model: no "ETP 2->1" reshard


def test_saved_etp_kept_on_the_command_line_is_a_prediction(capsys, dense_etp2):
    """The run's command line keeps --expert-tensor-parallel-size 2 at world 1: initialize_model_parallel fails."""
    rc, doc, err = cli(capsys, "can-load", dense_etp2, "--target", "tp=1,etp=2", "--format", "json")
    assert rc == 1, err
    jsonschema.validate(doc, SCHEMA)
    assert doc["failing_sections"] == ["args"]
    assert _args(doc)["error"] == EXPERT_WORLD.format(1, 2) and "etp=N" in _args(doc)["fix"]
    rc, out, _ = cli(capsys, "can-load", dense_etp2, "--target", "tp=1,etp=2")
    assert rc == 1 and "megatron: " + EXPERT_WORLD.format(1, 2) in out and "fails: args" in out


def test_saved_ep_the_target_world_cannot_hold_is_a_prediction(capsys):
    """core019_moe_ep2 (EP=2) at world 1: the omitted EP is the saved one. Was exit 2."""
    rc, doc, err = cli(capsys, "can-load", FIXTURES / "core019_moe_ep2", "--target", "world=1", "--format", "json")
    assert rc == 1, err
    assert doc["target"] == {"tp": 1, "pp": 1, "ep": 2, "etp": 1, "cp": 1, "dp": 1, "world": 1}
    assert doc["failing_sections"] == ["args"] and _args(doc)["error"] == EXPERT_WORLD.format(1, 2)
    assert cli(capsys, "can-load", FIXTURES / "core019_moe_ep2", "--target", "world=1,ep=1")[0] in (0, 1)


def test_world_that_tp_pp_cp_does_not_divide_is_a_prediction(capsys):
    """validate_args asserts it first. Was exit 2, "world=4 is not a multiple of TP x PP x CP = 3"."""
    rc, doc, err = cli(capsys, "can-load", FIXTURES / "core019_tp2_dp2", "--target", "tp=3,world=4", "--format", "json")
    assert rc == 1, err
    jsonschema.validate(doc, SCHEMA)
    assert doc["target"]["world"] == 4 and "args" in doc["failing_sections"]
    assert _args(doc)["error"] == (
        "AssertionError: world size (4) is not divisible by total_model_size (total_model_size=3)"
    )


def test_expert_parallelism_without_experts_fails_validate_args(capsys):
    """Was predicted to load: validate_args refuses EP > 1 on a dense model."""
    rc, doc, err = cli(capsys, "can-load", FIXTURES / "core019_tp1", "--target", "ep=2,dp=2", "--format", "json")
    assert rc == 1, err
    assert doc["failing_sections"] == ["args"]
    assert _args(doc)["error"] == "AssertionError: num_experts must be non None to use expert model parallelism"


def test_omitted_etp_keeps_only_an_experts_cut():
    """An MoE checkpoint saved at ETP != TP keeps its ETP (as an omitted EP is kept); a dense one's saved ETP, or
    one that equalled TP, is replaced by the target TP (Megatron's default)."""
    moe = Layout(tp=2, pp=1, ep=2, etp=1, cp=1, dp=2)
    assert parse_target("pp=2", moe, experts=True).etp == 1
    assert parse_target("tp=4", moe, experts=True).etp == 1
    assert parse_target("tp=4", moe, experts=False).etp == 4
    assert parse_target("tp=4,etp=2", moe, experts=False).etp == 2
    assert parse_target("tp=1", Layout(2, 1, 1, 2, 1, 1), experts=True).etp == 1


def _case(report_args: dict, target: dict) -> dict:
    model = {k: report_args[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")}
    model["max_position_embeddings"] = report_args.get("max_position_embeddings") or model["seq_length"]
    model["num_experts"] = report_args.get("num_experts")
    layout = {
        "tensor_model_parallel_size": target["tp"],
        "pipeline_model_parallel_size": target["pp"],
        "context_parallel_size": target["cp"],
        "expert_model_parallel_size": target["ep"],
        "expert_tensor_parallel_size": target["etp"],
    }
    return {"args": {**model, **layout}, "world": target["world"]}


@pytest.mark.mcore
def test_predicted_layout_errors_are_megatrons(tmp_path, dense_etp2):
    """Megatron-LM's validate_args and megatron-core's initialize_model_parallel, on CPU, at each target: the same
    error (or none) as can-load's args section."""
    require_mcore()
    from ckptdoctor.args import args_as_dict

    cells = [
        (dense_etp2, "tp=1,etp=2"),
        (dense_etp2, "tp=1"),
        (FIXTURES / "core019_moe_ep2", "world=1"),
        (FIXTURES / "core019_tp2_dp2", "tp=3,world=4"),
        (FIXTURES / "core019_tp1", "ep=2,dp=2"),
        (FIXTURES / "core019_tp1", "cp=32,dp=1"),  # seq_length 32: not a multiple of 2 x CP
    ]
    cases, predicted = [], []
    for path, target in cells:
        ckpt = open_checkpoint(path)
        report = predict(ckpt, target, LoadRun())
        (args,) = [s for s in report.sections if s.section == "args"]
        predicted.append(args.error)
        cases.append(_case(args_as_dict(ckpt.common_state().get("args")), report.target))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "mcore_layout_checks.py"), str(tmp_path / "cases.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MASTER_PORT": str(free_port())},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    assert real == predicted, list(zip(cells, real, predicted, strict=True))


def test_context_parallel_that_does_not_split_the_sequence_fails_validate_args(capsys):
    """validate_args: seq_length (32) a multiple of 2 x CP. Was predicted to load."""
    rc, doc, err = cli(capsys, "can-load", FIXTURES / "core019_tp1", "--target", "cp=32,dp=1", "--format", "json")
    assert rc == 1, err
    jsonschema.validate(doc, SCHEMA)
    assert doc["failing_sections"] == ["args"]
    assert _args(doc)["error"].startswith("AssertionError: seq-length should be a multiple of 2 * context-parallel")
    assert cli(capsys, "can-load", FIXTURES / "core019_tp1", "--target", "cp=16,dp=1")[0] == 0
