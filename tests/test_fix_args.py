"""fix-args on real convert.py-style fixtures (TP=1 source re-sharded to TP=4 with inherited args)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REPO, free_port, require_mcore, shipped_schema

from ckptdoctor.atomic import FAULT_ENV, FAULT_EXIT_CODE
from ckptdoctor.cli import main

PAIRS = [("core019_convert_tp4", "core019_convert_src_tp1"), ("core016_convert_tp4", "core016_convert_src_tp1")]
SCHEMA = shipped_schema("fix-args")
DERIVED = (
    "tensor_parallel_num_weight_shards",
    "gtp_weight_remat_size",
    "expert_tensor_parallel_num_weight_shards",
    "expert_gtp_weight_remat_size",
)


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _probe(iteration_dir: Path) -> dict:
    require_mcore()
    result = subprocess.run(
        [sys.executable, str(REPO / "tests/mcore_probe.py"), str(iteration_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, MASTER_PORT=str(free_port())),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("target,source", PAIRS)
def test_report_names_inherited_weight_shard_args(capsys, target, source):
    rc, out, _ = _run(capsys, "fix-args", FIXTURES / target, "--source", FIXTURES / source, "--format", "json")
    assert rc == 1
    report = json.loads(out)
    findings = {f["arg"]: f for f in report["findings"]}
    shards = findings["tensor_parallel_num_weight_shards"]
    assert shards["saved"] == 1 and shards["correct"] == 4 and shards["severity"] == "error"
    assert shards["megatron_error"] == (
        "tensor_parallel_num_weight_shards (1) must be >= tensor_model_parallel_size (4)."
    )
    assert findings["expert_tensor_parallel_num_weight_shards"]["correct"] == 4
    assert all(f["inherited"] for f in report["findings"])
    named = set(findings) | {i["arg"] for i in report["inherited"]}
    assert set(DERIVED) <= named  # all four weight-shard args are named, each marked inherited
    assert {i["arg"] for i in report["inherited"] if i["consistent"]} == {
        "gtp_weight_remat_size",
        "expert_gtp_weight_remat_size",
    }
    rc, out, _ = _run(capsys, "fix-args", FIXTURES / target, "--source", FIXTURES / source)
    assert "must be >= tensor_model_parallel_size (4)" in out and "yes" in out


# Converter re-shards that lower a degree: the saved GTP pair is the source's, consistent at the source's TP / ETP.
LOWERED = {
    # TP 2 -> 1: shards 2 at TP=1 would make megatron derive GTP weight remat 2 (the source ran none)
    "core019_convert_tp1": (
        "core019_tp2",
        {"expert_tensor_parallel_size": (2, 1), "tensor_parallel_num_weight_shards": (2, 1)},
        {"expert_tensor_parallel_num_weight_shards": (2, 1)},
    ),
    # ETP 2 -> EP 2, ETP 1: ETP itself is copied from the source (the savers keep TP, PP and EP only)
    "core019_convert_moe_ep2": (
        "core019_moe_etp2",
        {"expert_tensor_parallel_size": (2, 1)},
        {"expert_tensor_parallel_num_weight_shards": (2, 1)},
    ),
}


@pytest.mark.parametrize("name", sorted(LOWERED))
def test_lowered_degree_keeps_the_source_gtp_remat(capsys, name):
    source, changed, expert_shards = LOWERED[name]
    rc, out, _ = _run(capsys, "fix-args", FIXTURES / name, "--source", FIXTURES / source, "--format", "json")
    assert rc == 1
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    found = {f["arg"]: (f["saved"], f["correct"]) for f in report["findings"]}
    assert found == {**changed, **expert_shards}
    assert all(f["inherited"] and f["severity"] == "warning" for f in report["findings"])
    # the remat args are the source's intent: kept, never "corrected" to shards // TP
    assert {c["arg"] for c in report["changes"]} == set(found)
    assert not any("remat" in c["arg"] for c in report["changes"])


@pytest.mark.parametrize("name", ["core019_tp2", "core016_tp2", "core019_tp1_pp2", "core019_convert_src_tp1"])
def test_consistent_checkpoints_report_nothing(capsys, name):
    rc, out, _ = _run(capsys, "fix-args", FIXTURES / name)
    assert rc == 0 and "consistent" in out


@pytest.mark.mcore
@pytest.mark.parametrize("target,source", PAIRS)
def test_write_output_loads_in_megatron(capsys, tmp_path, target, source):
    before = _hashes(FIXTURES / target)
    out_dir = tmp_path / "fixed"
    rc, out, _ = _run(capsys, "fix-args", FIXTURES / target, "--output", out_dir, "--format", "json")
    assert rc == 0
    report = json.loads(out)
    assert report["written"]["mode"] == "output" and report["remaining"] == []
    assert report["findings"]  # what was wrong before the fix is kept
    assert _hashes(FIXTURES / target) == before  # the source is untouched
    assert (out_dir / "latest_checkpointed_iteration.txt").read_text() == "10"

    original = _probe(FIXTURES / target / "iter_0000010")
    fixed = _probe(out_dir / "iter_0000010")
    assert original["config_error"] == (
        "tensor_parallel_num_weight_shards (1) must be >= tensor_model_parallel_size (4)."
    )
    assert fixed["config_error"] is None
    assert fixed["args"]["tensor_parallel_num_weight_shards"] == "4"
    assert fixed["args"]["expert_tensor_parallel_num_weight_shards"] == "4"
    changed = {c["arg"] for c in report["changes"]}
    assert {k: v for k, v in fixed["args"].items() if k not in changed} == {
        k: v for k, v in original["args"].items() if k not in changed
    }
    assert fixed["arg_types"] == original["arg_types"]  # megatron enums come back as megatron enums
    assert fixed["common_repr"] == original["common_repr"]
    assert fixed["tensors"] == original["tensors"] and len(fixed["tensors"]) > 5  # bitwise unchanged
    # unchanged data files are hard links of the source's, not rewritten copies
    for name, digest in before.items():
        if name.endswith(".distcp") and (out_dir / "iter_0000010" / name).exists():
            assert _hashes(out_dir / "iter_0000010")[name] == digest


@pytest.mark.mcore
@pytest.mark.parametrize("name", sorted(LOWERED))
def test_lowered_degree_fix_resolves_as_the_source_in_megatron(capsys, tmp_path, name):
    source = LOWERED[name][0]
    out_dir = tmp_path / "fixed"
    rc, _, _ = _run(capsys, "fix-args", FIXTURES / name, "--output", out_dir)
    assert rc == 0
    original = _probe(FIXTURES / name / "iter_0000010")
    fixed = _probe(out_dir / "iter_0000010")
    reference = _probe(FIXTURES / source / "iter_0000010")
    assert fixed["config_error"] is None and fixed["tensors"] == original["tensors"]
    # megatron-core's own resolution: no GTP weight remat, as in the source; ETP as the expert chunks were cut
    for remat in ("gtp_weight_remat_size", "expert_gtp_weight_remat_size"):
        assert fixed["resolved"][remat] == reference["resolved"][remat] == 1
    layout = json.loads(_run(capsys, "inspect", out_dir, "--format", "json")[1])["layout"]
    assert fixed["resolved"]["expert_tensor_parallel_size"] == (layout["etp"] or layout["tp"])
    if name == "core019_convert_tp1":  # before the fix: remat 2 derived from the inherited shards
        assert original["resolved"]["gtp_weight_remat_size"] == 2


def test_write_in_place_keeps_backups_and_restores(capsys, copy_fixture):
    save = copy_fixture("core019_convert_tp4")
    iteration_dir = save / "iter_0000010"
    original_metadata = (iteration_dir / ".metadata").read_bytes()
    data_before = {k: v for k, v in _hashes(iteration_dir).items() if k.endswith(".distcp")}
    rc, out, _ = _run(capsys, "fix-args", save, "--in-place")
    assert rc == 0 and "backup:" in out
    backups = list(iteration_dir.glob(".metadata.bak-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == original_metadata
    after = _hashes(iteration_dir)
    assert all(after[k] == v for k, v in data_before.items())  # no tensor file rewritten
    rc, _, _ = _run(capsys, "fix-args", save)
    assert rc == 0
    # docs/commands/fix-args.md's restore recipe: move the backup back, drop the new common-state file
    backups[0].replace(iteration_dir / ".metadata")
    for new_file in iteration_dir.glob("common_state.fixargs-*.distcp"):
        new_file.unlink()
    rc, _, _ = _run(capsys, "fix-args", save)
    assert rc == 1


def _in_place_twice(capsys, save: Path) -> tuple[Path, list[Path]]:
    """fix-args --in-place run twice: each run moves the common state into a new data file, so the first run's file
    is referenced only by the second run's backup of .metadata."""
    iteration_dir = save / "iter_0000010"
    for iters in (30, 40):
        rc, _, _ = _run(capsys, "fix-args", save, "--in-place", "--only-set", "--set", f"train_iters={iters}")
        assert rc == 0
        time.sleep(1.1)  # another backup stamp (free_stamp would add a token within the same second)
    backups = sorted(iteration_dir.glob(".metadata.bak-*"))
    assert len(backups) == 2 and len(list(iteration_dir.glob("common_state.fixargs-*.distcp"))) == 2
    return iteration_dir, backups


def test_a_file_only_a_backup_references_is_not_an_orphan(capsys, copy_fixture):
    iteration_dir, backups = _in_place_twice(capsys, copy_fixture("core019_tp1"))
    rc, out, _ = _run(capsys, "check", iteration_dir)
    assert rc == 0 and "CKD115" not in out
    rc, out, _ = _run(capsys, "repair", iteration_dir, "--in-place")
    assert rc == 0 and "nothing to repair" in out
    assert not list(iteration_dir.parent.glob("*quarantine*"))
    # A backup that does not parse keeps nothing; with no backup left the first run's file is an orphan again.
    backups[1].write_bytes(b"not a pickle")
    rc, out, _ = _run(capsys, "check", iteration_dir, "--format", "json")
    assert rc == 1
    found = [f for f in json.loads(out)["findings"] if f["code"] == "CKD115"]
    stamp = backups[0].name.split(".bak-", 1)[1]
    assert [Path(f["path"]).name for f in found] == [f"common_state.fixargs-{stamp}.distcp"]


@pytest.mark.mcore
def test_the_older_backup_still_restores_after_check_and_repair(capsys, copy_fixture):
    iteration_dir, backups = _in_place_twice(capsys, copy_fixture("core019_tp1"))
    rc, _, _ = _run(capsys, "repair", iteration_dir, "--in-place")
    assert rc == 0
    # docs/commands/fix-args.md's restore recipe for the second run: its backup back, its data file removed
    stamp = backups[1].name.split(".bak-", 1)[1]
    os.link(backups[1], iteration_dir / ".metadata.new")
    (iteration_dir / ".metadata.new").replace(iteration_dir / ".metadata")
    backups[1].unlink()
    (iteration_dir / f"common_state.fixargs-{stamp}.distcp").unlink()
    rc, out, _ = _run(capsys, "check", iteration_dir)
    assert rc == 0, out
    assert _probe(iteration_dir)["args"]["train_iters"] == "30"  # the first run's args, read by megatron-core


@pytest.mark.mcore
def test_write_in_place_common_pt_era(capsys, copy_fixture):
    save = copy_fixture("core016_convert_tp4")
    iteration_dir = save / "iter_0000010"
    metadata_before = (iteration_dir / ".metadata").read_bytes()
    rc, _, _ = _run(capsys, "fix-args", save, "--in-place")
    assert rc == 0
    assert (iteration_dir / ".metadata").read_bytes() == metadata_before  # only common.pt is replaced
    assert len(list(iteration_dir.glob("common.pt.bak-*"))) == 1
    probe = _probe(iteration_dir)
    assert probe["config_error"] is None


# Each step of each write mode; a crash after any of them must leave the source loadable.
FAULTS = {
    ("core019_convert_tp4", "in-place"): ["write:common_state", "backup:.metadata", "write:.metadata"],
    ("core016_convert_tp4", "in-place"): ["backup:common.pt", "write:common.pt"],
    ("core019_convert_tp4", "output"): ["links", "write:common_state", "write:.metadata"],
}


@pytest.mark.mcore
@pytest.mark.parametrize("case", [(n, m, s) for (n, m), steps in FAULTS.items() for s in steps])
def test_crash_between_write_steps_leaves_source_loadable(copy_fixture, tmp_path, case):
    name, mode, step = case
    save = copy_fixture(name)
    before = _hashes(save)
    target = ["--in-place"] if mode == "in-place" else ["--output", str(tmp_path / "out")]
    env = dict(os.environ, **{FAULT_ENV: step})
    result = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "fix-args", str(save), *target],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == FAULT_EXIT_CODE, result.stderr
    if mode == "output":
        assert _hashes(save) == before  # the source is byte-identical
    else:
        # in place: every original file is still there (changed ones as backups) and the dir reads
        after = _hashes(save)
        originals = set(before.values())
        for rel, digest in before.items():
            assert digest in after.values() or rel not in after, rel
        assert originals <= set(after.values())
    probe = _probe(save / "iter_0000010")
    assert probe["config_error"] in (
        None,
        "tensor_parallel_num_weight_shards (1) must be >= tensor_model_parallel_size (4).",
    )
    assert len(probe["tensors"]) > 5


def test_set_coerces_and_refuses_unknown(capsys):
    target = FIXTURES / "core019_tp2"
    rc, out, _ = _run(capsys, "fix-args", target, "--set", "seq_length=64", "--set", "swiglu=false", "--format", "json")
    changes = {c["arg"]: c for c in json.loads(out)["changes"]}
    assert changes["seq_length"]["new"] == 64 and changes["swiglu"]["new"] is False
    rc, _, err = _run(capsys, "fix-args", target, "--set", "no_such_arg=3")
    assert rc == 2 and "no_such_arg" in err and "--force" in err
    rc, _, err = _run(capsys, "fix-args", target, "--set", "seq_length=abc")
    assert rc == 2 and "expected an integer" in err


@pytest.mark.mcore
def test_set_unknown_with_force_loads_in_megatron(capsys, tmp_path):
    target = FIXTURES / "core019_tp2"
    out_dir = tmp_path / "out"
    rc, out, _ = _run(
        capsys,
        "fix-args",
        target,
        "--set",
        "no_such_arg=3",
        "--force",
        "--output",
        out_dir,
        "--format",
        "json",
    )
    assert rc == 0
    probe = _probe(out_dir / "iter_0000010")
    assert probe["args"]["no_such_arg"] == "3" and probe["args"]["seq_length"] == "32"


def test_output_refuses_non_empty_dir(capsys, tmp_path):
    out_dir = tmp_path / "busy"
    out_dir.mkdir()
    (out_dir / "x").write_text("keep me")
    rc, _, err = _run(capsys, "fix-args", FIXTURES / "core019_convert_tp4", "--output", out_dir)
    assert rc == 2 and "not empty" in err and (out_dir / "x").read_text() == "keep me"


def test_usage_errors(capsys, tmp_path):
    src = FIXTURES / "core019_convert_tp4"
    rc, _, err = _run(capsys, "fix-args", src, "--write")
    assert rc == 2 and "--write needs -o/--output DIR or --in-place" in err and "deprecated" in err
    rc, _, err = _run(capsys, "fix-args", src, "-o", tmp_path / "o", "--in-place")
    assert rc == 2 and "not both" in err and not (tmp_path / "o").exists()


@pytest.mark.mcore
def test_run_config_and_integrity_kept_consistent(capsys, copy_fixture, tmp_path):
    require_mcore()
    save = copy_fixture("core019_convert_tp4")
    iteration_dir = save / "iter_0000010"
    (iteration_dir / "run_config.yaml").write_text(
        "model:\n  tensor_model_parallel_size: 4\n  tensor_parallel_num_weight_shards: 1  # from source\n"
        "  expert_tensor_parallel_size: 1\n  seq_length: 32\ntrain:\n  train_iters: 10\n"
    )
    code = (
        "from megatron.core.dist_checkpointing.validation import save_integrity_manifest; "
        f"save_integrity_manifest({str(iteration_dir)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    rc, out, _ = _run(capsys, "fix-args", save, "--output", tmp_path / "out")
    assert rc == 0 and "run_config.yaml updated" in out and "integrity.json updated" in out
    fixed = tmp_path / "out" / "iter_0000010"
    text = (fixed / "run_config.yaml").read_text()
    assert "  tensor_parallel_num_weight_shards: 4  # from source\n" in text
    assert "  expert_tensor_parallel_size: 4\n" in text and "  seq_length: 32\n" in text
    assert _probe(fixed)["verify_integrity"] == "ok"


def test_a_run_config_that_is_not_utf8_is_one_error_naming_it(capsys, copy_fixture, tmp_path):
    """It was read with read_text: a UnicodeDecodeError (an internal error) for fix-args and edit --set-arg."""
    save = copy_fixture("core019_convert_tp4")
    run_config = save / "iter_0000010" / "run_config.yaml"
    run_config.write_bytes(b"model:\n  tensor_parallel_num_weight_shards: 1\n\xff\xfe\n")
    rc, _, err = _run(capsys, "fix-args", save, "--output", tmp_path / "out")
    assert rc == 2 and f"{run_config}: not UTF-8 text" in err and "internal error" not in err, err
    assert not (tmp_path / "out").exists()


# --- issue 11: write-mode output, exit codes, world_size, did-you-mean, schema ------------------------------


def test_write_leads_with_what_was_wrong_and_json_keeps_findings(capsys, tmp_path):
    target = FIXTURES / "core019_convert_tp4"
    rc, out, _ = _run(capsys, "fix-args", target, "--output", tmp_path / "a")
    assert rc == 0
    assert out.index("was wrong (3 inconsistent args)") < out.index("changed:") < out.index("wrote ")
    assert "tensor_parallel_num_weight_shards: 1 -> 4 (fix)" in out
    assert out.rstrip().endswith("after writing: the args are consistent with the checkpoint's parallelism")
    assert "args are consistent" not in out.splitlines()[1]
    rc, out, _ = _run(capsys, "fix-args", target, "--output", tmp_path / "b", "--format", "json")
    assert rc == 0
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    assert {f["arg"] for f in report["findings"]} == {
        "expert_tensor_parallel_size",
        "tensor_parallel_num_weight_shards",
        "expert_tensor_parallel_num_weight_shards",
    }
    assert report["remaining"] == [] and report["written"]["mode"] == "output"


@pytest.mark.parametrize(
    "args",
    [
        ("core019_convert_tp4", "--source", FIXTURES / "core019_convert_src_tp1"),
        ("core019_tp2",),
        ("core019_tp2", "--set", "seq_length=64"),
    ],
)
def test_json_validates_against_schema(capsys, args):
    rc, out, _ = _run(capsys, "fix-args", FIXTURES / args[0], *args[1:], "--format", "json")
    assert rc in (0, 1)
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    assert report["remaining"] is None and report["written"] is None


def test_world_size_derived_from_data_parallel_size(capsys, tmp_path):
    bad = tmp_path / "bad"
    rc, out, _ = _run(
        capsys,
        "fix-args",
        FIXTURES / "core019_tp2_dp2",
        "--set",
        "world_size=3",
        "--only-set",
        "--output",
        bad,
        "--format",
        "json",
    )
    # --write exits 1 when findings remain after writing (here: the world_size just set)
    assert rc == 1
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    assert [f["arg"] for f in report["remaining"]] == ["world_size"]
    rc, out, _ = _run(capsys, "fix-args", bad, "--format", "json")
    assert rc == 1
    (finding,) = json.loads(out)["findings"]
    assert finding["arg"] == "world_size" and finding["saved"] == 3 and finding["correct"] == 4
    assert "TP x PP x CP x DP = 4" in finding["reason"]
    rc, out, _ = _run(capsys, "fix-args", bad, "--in-place")
    assert rc == 0 and "world_size: 3 -> 4 (fix)" in out


def test_write_exits_1_when_findings_remain_text(capsys, tmp_path):
    rc, out, _ = _run(
        capsys,
        "fix-args",
        FIXTURES / "core019_convert_tp4",
        "--output",
        tmp_path / "o",
        "--set",
        "tensor_parallel_num_weight_shards=1",
        "--set",
        "seq_length=64",
    )
    assert rc == 1
    assert "after writing: 1 inconsistent arg remains:" in out and "CKD210" in out.split("after writing")[1]


def test_set_dry_run_reports_what_the_write_would_leave(capsys, tmp_path):
    """A --set that contradicts the chunks: the dry run says what the write then reports, with the same exit code."""
    src = FIXTURES / "core019_tp2"
    rc, out, _ = _run(capsys, "fix-args", src, "--set", "tensor_model_parallel_size=4", "--format", "json")
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    assert rc == 1 and report["findings"] == [] and report["remaining"] is None
    assert [(f["code"], f["saved"], f["correct"]) for f in report["would_remain"]] == [("CKD201", 4, 2)]
    rc_write, out, _ = _run(capsys, "fix-args", src, "--set", "tensor_model_parallel_size=4", "-o", tmp_path / "o")
    assert rc_write == rc == 1 and "after writing: 1 inconsistent arg remains" in out
    rc, out, _ = _run(capsys, "fix-args", FIXTURES / "core019_convert_tp4", "--format", "json")
    assert rc == 1 and json.loads(out)["would_remain"] == []  # the fixes leave nothing
    rc, out, _ = _run(capsys, "fix-args", src, "--format", "json")
    assert rc == 0 and json.loads(out)["would_remain"] is None  # nothing planned


def test_set_misspelled_name_suggests_the_saved_arg(capsys):
    rc, _, err = _run(
        capsys, "fix-args", FIXTURES / "core019_convert_tp4", "--set", "tensor_parallel_num_weight_shard=4"
    )
    assert rc == 2 and "did you mean 'tensor_parallel_num_weight_shards'?" in err
    rc, _, err = _run(capsys, "fix-args", FIXTURES / "core019_tp2", "--set", "zzzzzz=1")
    assert rc == 2 and "did you mean" not in err


def test_inspect_marks_inconsistent_args_and_points_to_fix_args(capsys):
    rc, out, _ = _run(capsys, "inspect", FIXTURES / "core019_convert_tp4")
    assert rc == 0
    assert "inconsistent args (3)" in out
    assert "CKD210 [error] tensor_parallel_num_weight_shards=1 (should be 4)" in out
    assert "fix: ckptdoctor fix-args" in out
    rc, out, _ = _run(capsys, "inspect", FIXTURES / "core019_convert_tp4", "--format", "json")
    codes = [f["code"] for f in json.loads(out)["arg_findings"]]
    assert codes == ["CKD203", "CKD210", "CKD212"]
    rc, out, _ = _run(capsys, "inspect", FIXTURES / "core019_tp2")
    assert rc == 0 and "inconsistent args" not in out


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_source_is_refused_before_anything_is_written(tmp_path, damage):
    """core019_convert_tp4 (its args inherited from the TP=1 source: fixes to write) with a data file missing or cut
    short, as a partial copy or upload leaves it: both -o and --in-place refuse with the lost chunks named, exit 2;
    the output is not created and the source is unchanged (a fixed copy carried the damage on, exit 0)."""
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "core019_convert_tp4", source)
    data_file = source / "iter_0000010" / "__1_0.distcp"
    if damage == "missing":
        data_file.unlink()
    else:
        os.truncate(data_file, 100)
    before = {p.relative_to(source): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    code = "CKD113" if damage == "missing" else "CKD114"
    for where in (["-o", str(tmp_path / "out")], ["--in-place"]):
        assert main(["fix-args", str(source), *where]) == 2
    assert not (tmp_path / "out").exists()
    assert {p.relative_to(source): p.read_bytes() for p in source.rglob("*") if p.is_file()} == before
    run = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "fix-args", str(source), "--in-place"], capture_output=True, text=True
    )
    assert run.returncode == 2 and f"{code} " in run.stderr and "refusing to fix the args" in run.stderr, run.stderr
