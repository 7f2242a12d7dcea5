"""``can-load CKPT --suggest [--world-size N]`` (issue #37 item 5): the layouts and load flags under which a
checkpoint loads, fewest changes first, each a verdict of the can-load predictor that ``can-load --target``
repeats. The ``mcore`` test loads a fixture with real megatron-core 0.19.2 at the first suggested layout that
is not the saved one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jsonschema
import pytest
from conftest import FIXTURES, REPO, free_port, require_mcore, run_main, shipped_schema

SCHEMA = shipped_schema("can-load")
LAYOUT = ("tp", "pp", "ep", "etp", "cp", "dp", "world")


def suggest(capsys: pytest.CaptureFixture, path: object, *args: object, rc: int = 0) -> dict:
    code, out, err = run_main(capsys, "can-load", path, "--suggest", *args, "--format", "json")
    assert code == rc, err
    doc = json.loads(out)
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    assert doc["schema"] == "ckptdoctor.can-load/1"
    return doc


def repeat(capsys: pytest.CaptureFixture, path: object, suggestion: dict) -> tuple[int, dict]:
    """The suggestion run back through the normal form, ``can-load CKPT --target SPEC FLAGS``."""
    code, out, err = run_main(capsys, "can-load", path, *suggestion["argv"], "--format", "json")
    assert code in (0, 1), err
    return code, json.loads(out)


def order_keys(doc: dict) -> list[tuple[int, int]]:
    return [(s["layout_changes"], s["flag_changes"]) for s in doc["suggestions"]]


@pytest.mark.parametrize(
    "fixture", ["core019_tp2", "core019_moe_ep2", "core019_pp2_uneven", "core019_tp2_dp2", "core019_gqa_qkln_tp2"]
)
def test_saved_layout_first_and_every_suggestion_loads_through_target(capsys, fixture):
    path = FIXTURES / fixture
    doc = suggest(capsys, path, "--limit", "0")
    saved = {k: doc["saved"][k] for k in LAYOUT}
    assert doc["world_size"] == saved["world"] and doc["world_source"] == "saved"
    assert doc["will_load"] and doc["loading"] == len(doc["suggestions"]) and doc["more"] == 0
    first = doc["suggestions"][0]
    assert first["target"] == saved and first["changes"] == [] and first["flags"] == []
    assert doc["as_saved_failing"] == []
    keys = order_keys(doc)
    assert keys == sorted(keys), keys  # layout changes, then added flags: never fewer than the one before
    assert [k[0] for k in keys] == sorted(k[0] for k in keys)
    seen = set()
    for suggestion in doc["suggestions"]:
        target = suggestion["target"]
        assert target["tp"] * target["pp"] * target["cp"] * target["dp"] == doc["world_size"] == target["world"]
        assert tuple(target[k] for k in LAYOUT) not in seen  # one candidate per layout
        seen.add(tuple(target[k] for k in LAYOUT))
        code, repeated = repeat(capsys, path, suggestion)
        assert code == 0 and repeated["will_load"], (suggestion, repeated["failing_sections"])
        assert repeated["target"] == target
        assert {s["section"]: s["verdict"] for s in repeated["sections"]} == suggestion["sections"]
        assert repeated["warnings"] == suggestion["warnings"]


def test_layouts_that_cannot_load_are_never_suggested(capsys):
    """core019_tp2 (4 heads, 2 layers, seq 32) on 8 GPUs: TP=8 breaks the heads, PP=4 and PP=8 the layers;
    megatron refuses them at startup, and no flag changes that."""
    path = FIXTURES / "core019_tp2"
    doc = suggest(capsys, path, "--world-size", "8", "--limit", "0")
    assert doc["world_size"] == 8 and doc["world_source"] == "--world-size"
    targets = [s["target"] for s in doc["suggestions"]]
    assert targets and all(t["world"] == 8 for t in targets)
    assert not [t for t in targets if t["tp"] == 8 or t["pp"] > 2]
    assert doc["search"]["refused_at_startup"] > 0 and doc["search"]["complete"]
    for refused in ("tp=8,pp=1,cp=1,dp=1", "tp=1,pp=4,cp=1,dp=2", "tp=2,pp=4,cp=1,dp=1"):
        code, report = repeat(capsys, path, {"argv": ["--target", refused, "--no-load-optim", "--no-load-rng"]})
        assert code == 1 and "args" in report["failing_sections"], refused
    # the saved TP/PP at 8 GPUs (DP 1 -> 4) is no layout change: first
    assert doc["suggestions"][0]["target"] == {"tp": 2, "pp": 1, "ep": 1, "etp": 2, "cp": 1, "dp": 4, "world": 8}
    assert doc["suggestions"][0]["changes"] == []


def test_uneven_pipeline_suggests_only_splits_megatron_accepts(capsys):
    """core019_pp2_uneven (3 layers, first stage 1): PP=1 leaves 2 layers for 0 middle stages, refused; with the
    split undone (--set ... =null) the even layouts load, and each suggestion's argv carries the --set."""
    path = FIXTURES / "core019_pp2_uneven"
    doc = suggest(capsys, path, "--limit", "0")
    assert [s["target"]["pp"] for s in doc["suggestions"]] == [2]
    undone = suggest(capsys, path, "--set", "decoder_first_pipeline_num_layers=null", "--limit", "0")
    assert undone["suggestions"] and all(s["target"]["pp"] == 1 for s in undone["suggestions"])  # 3 % 2 layers
    for suggestion in undone["suggestions"]:
        assert suggestion["argv"][-2:] == ["--set", "decoder_first_pipeline_num_layers=null"]
        code, repeated = repeat(capsys, path, suggestion)
        assert code == 0 and repeated["target"] == suggestion["target"]


def test_load_flags_come_before_layout_changes_and_are_minimal(capsys):
    """core019_tp2_dp2 (distributed optimizer, dp_reshardable): a TP or PP change needs --no-load-optim, a CP one
    (DP 2 -> 1) does not. Under --strictness raise_all the saved layout needs a strictness flag, listed first."""
    path = FIXTURES / "core019_tp2_dp2"
    doc = suggest(capsys, path, "--limit", "0")
    by_layout = {(s["target"]["tp"], s["target"]["pp"], s["target"]["cp"]): s for s in doc["suggestions"]}
    assert by_layout[(1, 1, 1)]["flags"] == ["--no-load-optim"]
    assert by_layout[(1, 1, 1)]["changes"] == ["TP 2->1", "--no-load-optim"]
    assert by_layout[(2, 1, 2)]["flags"] == []
    code, bare = repeat(capsys, path, {"argv": ["--target", by_layout[(1, 1, 1)]["spec"]]})
    assert code == 1 and bare["failing_sections"] == ["optimizer"]  # the flag is needed, not just added

    strict = suggest(capsys, path, "--strictness", "raise_all", "--limit", "0")
    assert strict["as_saved_failing"]  # raise_all: saved keys that no rank requests (the rerun state)
    first = strict["suggestions"][0]
    assert first["layout_changes"] == 0 and first["flag_changes"] == 1
    assert first["flags"] == ["--strictness", "assume_ok_unexpected"]  # megatron's default: argv names none
    assert first["argv"] == ["--target", first["spec"]] and first["changes"] == ["--strictness=assume_ok_unexpected"]
    keys = order_keys(strict)
    assert keys == sorted(keys) and keys[-1][0] > 0
    for suggestion in strict["suggestions"]:
        assert repeat(capsys, path, suggestion)[0] == 0


def test_moe_etp_kept_or_following_tp_is_no_change(capsys):
    """core019_moe_ep2 (TP=ETP=1, EP=2): TP 1->2 with the experts' ETP kept at 1, or following TP to 2, is one
    change each (--target names etp, so either repeats); an ETP of its own is a change of its own."""
    doc = suggest(capsys, FIXTURES / "core019_moe_ep2", "--limit", "0")
    by_change = {}
    for s in doc["suggestions"]:
        by_change.setdefault(tuple(s["changes"]), []).append(s["target"])
    assert {"tp": 2, "pp": 1, "ep": 2, "etp": 1, "cp": 1, "dp": 1, "world": 2} in by_change[("TP 1->2",)]
    assert all(f",etp={s['target']['etp']}," in s["spec"] for s in doc["suggestions"])
    assert any(change.startswith("ETP 1->2") for s in doc["suggestions"] for change in s["changes"])


def test_limit_says_how_many_more_and_text_says_the_order(capsys):
    path = FIXTURES / "core019_moe_ep2"
    full = suggest(capsys, path, "--limit", "0")
    assert full["loading"] > 3
    short = suggest(capsys, path, "--limit", "3")
    assert short["suggestions"] == full["suggestions"][:3] and short["more"] == full["loading"] - 3
    code, out, _ = run_main(capsys, "can-load", path, "--suggest", "--limit", "3")
    assert code == 0
    assert "ordered by how little changes: the saved layout (load flags only) first" in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("it loads with"))
    assert lines[start + 1].split() == ["1", "TP=1", "PP=1", "EP=2", "ETP=1", "CP=1", "DP=2", "as", "saved"]
    assert lines[start + 2].strip() == f"ckptdoctor can-load {path} --target tp=1,pp=1,ep=2,etp=1,cp=1,dp=2"
    assert f"... and {full['loading'] - 3} more (--limit 0 lists them all)" in out
    assert f"verdict: LOADS ({full['loading']} candidates)" in out


def test_nothing_loads_is_exit_1_and_says_why(capsys):
    """core019_tp1 at 3 GPUs: TP=3 breaks the heads, PP=3 the layers, CP=3 the sequence; DP=3 alone loads unless
    the run asks for layers the checkpoint lacks."""
    path = FIXTURES / "core019_tp1"
    doc = suggest(capsys, path, "--world-size", "3", "--set", "num_layers=3", rc=1)
    assert not doc["will_load"] and doc["suggestions"] == [] and doc["loading"] == 0
    assert "model" in doc["as_saved_failing"]
    code, out, _ = run_main(capsys, "can-load", path, "--suggest", "--world-size", "3", "--set", "num_layers=3")
    assert code == 1 and "verdict: WILL NOT LOAD at any layout of world size 3" in out


def test_argv_carries_the_iteration_and_args_from(capsys):
    """Flags that are not load flags stay in each candidate's command, so it predicts the same run."""
    path = FIXTURES / "core019_tp2"
    doc = suggest(capsys, path, "--iteration", "10", "--args-from", FIXTURES / "core019_tp1", "--limit", "0")
    for suggestion in doc["suggestions"]:
        assert suggestion["argv"][-4:] == ["--iteration", "10", "--args-from", str(FIXTURES / "core019_tp1")]
        code, repeated = repeat(capsys, path, suggestion)
        assert code == 0 and repeated["target"] == suggestion["target"]


def test_a_failure_no_layout_changes_is_not_searched(capsys):
    """Legacy zarr: megatron-core 0.19 cannot read it at any layout, with any flags."""
    path = FIXTURES / "core014_zarr_tp2"
    doc = suggest(capsys, path, rc=1)
    assert doc["blocked"] == ["format"] and doc["search"]["layouts"] == 0 and doc["suggestions"] == []
    code, out, _ = run_main(capsys, "can-load", path, "--suggest")
    assert code == 1 and "not searched: a format failure holds at every layout, whatever the flags" in out


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "give --target LAYOUT or --suggest"),
        (("--suggest", "--target", "tp=1"), "give --target LAYOUT or --suggest"),
        (("--target", "tp=1", "--world-size", "2"), "--world-size goes with --suggest"),
        (("--suggest", "--world-size", "0"), "--world-size"),
    ],
)
def test_usage_errors(capsys, args, message):
    code, _, err = run_main(capsys, "can-load", FIXTURES / "core019_tp1", *args)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.mcore
def test_first_suggested_new_layout_loads_in_megatron(capsys, tmp_path):
    """Real Megatron-LM load_checkpoint (megatron-core 0.19.2, torchrun on gloo, CPU) at the first suggested
    layout that is not the saved one, with its flags (tests/mcore_load_target.py builds the run as the can-load
    matrix does; it runs CP=1 only)."""
    require_mcore()
    fixture = "core019_tp2"
    doc = suggest(capsys, FIXTURES / fixture)
    new = next(s for s in doc["suggestions"] if s["changes"] and s["target"]["cp"] == 1)
    target = new["target"]
    assert new["changes"][0].startswith("TP 2->1")
    cell = {
        "id": "suggested",
        "fixture": fixture,
        "target": {k: target[k] for k in ("tp", "pp", "ep", "etp", "dp")},
        "no_load_optim": "--no-load-optim" in new["flags"],
        "no_load_rng": "--no-load-rng" in new["flags"],
    }
    if "--strictness" in new["flags"]:
        cell["strictness"] = new["flags"][new["flags"].index("--strictness") + 1]
    cells, out = tmp_path / "cells.json", tmp_path / "out.json"
    cells.write_text(json.dumps([cell]))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(target["world"])]
    launcher += ["--master_port", str(free_port())]
    proc = subprocess.run(
        [*launcher, str(REPO / "tests" / "mcore_load_target.py"), str(cells), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (result,) = json.loads(out.read_text())
    assert result["outcome"] == "loads", result


def test_a_large_world_size_is_searched_in_bounded_time(capsys, tmp_path):
    """A world of 805M GPUs is searched (DP the rest of each layout); past the largest --target field it is a usage
    error, and saved args past it one line (a saved world of 2^62 took 2^31 trial divisions: it hung)."""
    from conftest import run_ckptdoctor

    from ckptdoctor.ops.can_load.run import MAX_TARGET

    path = FIXTURES / "core019_tp1"
    world = 3 * 2**28  # under MAX_TARGET
    proc = run_ckptdoctor("can-load", path, "--suggest", "--world-size", str(world), "--format", "json", timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["world_size"] == world
    for suggestion in doc["suggestions"]:
        target = suggestion["target"]
        assert target["tp"] * target["pp"] * target["cp"] * target["dp"] == world
    code, _, err = run_main(capsys, "can-load", path, "--suggest", "--world-size", str(MAX_TARGET + 1))
    assert code == 2 and "--world-size" in err
    from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip

    shutil.copytree(FIXTURES / "core016_tp1", tmp_path / "ckpt")  # its args in common.pt
    common = tmp_path / "ckpt" / "iter_0000010" / "common.pt"
    state = load_torch_zip(common, "common.pt")
    state["args"].data_parallel_size = 2**62  # the saved world: TP x PP x CP x DP
    common.write_bytes(dump_torch_zip(state))
    proc = run_ckptdoctor("can-load", tmp_path / "ckpt", "--suggest", timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"ckptdoctor: error: --suggest: the saved world size {2**62:,} is past {MAX_TARGET:,}: give --world-size"
    ]


def test_no_loading_layout_for_refused_extra_state_names_the_te_flags(capsys):
    """core019_te_delayed's pickled delayed-scaling state fails under the newest TE at every layout: the verdict
    names the flags that change that (which --suggest searches only when given)."""
    path = FIXTURES / "core019_te_delayed"
    code, out, _ = run_main(capsys, "can-load", path, "--suggest")
    text = " ".join(out.split())
    assert code == 1 and "WILL NOT LOAD at any layout" in text and "--te-unsafe-pickle" in text
    code, out, _ = run_main(capsys, "can-load", path, "--suggest", "--te-unsafe-pickle")
    assert code == 0 and "verdict: LOADS" in out
    code, out, _ = run_main(capsys, "can-load", FIXTURES / "core019_peft_trainable_tp1", "--suggest")
    assert code == 1 and "--te-unsafe-pickle" not in out  # fails for another reason: no TE flag named
