"""Megatron-Bridge's tracker ``latest_train_state.pt`` and ``iter_*/train_state.pt``: check (CKD123-125, CKD133) and
repair, on save dirs built from a real megatron-core fixture and train state files written by real torch as
Bridge writes them (fixtures/bridge_train_state/make_train_state.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REPO, run_cli, run_main, shipped_schema, squash
from hostile_corpus import torch_zip

from ckptdoctor.atomic import FAULT_ENV, FAULT_EXIT_CODE
from ckptdoctor.cli import main
from ckptdoctor.ops.check import check_paths

ITER = "iter_0000010"
TRACKER = "latest_checkpointed_iteration.txt"
BRIDGE = "latest_train_state.pt"
STATES = FIXTURES / "bridge_train_state"


def _codes(path: Path) -> list[str]:
    return sorted(f.code for f in check_paths([str(path)]).findings)


def _bridge_save(tmp_path: Path, with_20: bool = False) -> Path:
    """A Bridge save dir: the core019_tp2 fixture's iter 10 with its train_state.pt, both trackers at 10; with_20
    adds iter 20 (a copy of 10 with step 20's train state; its common state still says 10: CKD132)."""
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "core019_tp2", save)
    shutil.copy(STATES / "train_state_step10.pt", save / ITER / "train_state.pt")
    shutil.copy(save / ITER / "train_state.pt", save / BRIDGE)
    if with_20:
        shutil.copytree(save / ITER, save / "iter_0000020")
        shutil.copy(STATES / "train_state_step20.pt", save / "iter_0000020" / "train_state.pt")
    return save


def test_a_bridge_save_dir_passes(capsys, tmp_path):
    save = _bridge_save(tmp_path)
    assert _codes(save) == []
    rc, out, _ = run_main(capsys, "repair", save)
    assert rc == 0 and "repairs" not in out


def test_torn_bridge_tracker_is_found_and_repaired_in_place(capsys, tmp_path):
    save = _bridge_save(tmp_path)
    torn = (save / BRIDGE).read_bytes()[:900]  # Bridge writes it with shutil.copy: a crash can cut it
    (save / BRIDGE).write_bytes(torn)
    rc, out, _ = run_main(capsys, "check", save)
    assert rc == 1 and f"{save / BRIDGE}: CKD123 [error]" in out and "fix: ckptdoctor repair" in out
    rc, out, _ = run_main(capsys, "repair", save, "--in-place", "--format", "json")
    report = json.loads(out)
    assert rc == 0, out
    assert [(a["kind"], a["fixes"], a["value"]) for a in report["actions"]] == [("bridge-tracker", ["CKD123"], "10")]
    assert (save / BRIDGE).read_bytes() == (save / ITER / "train_state.pt").read_bytes()
    assert [p.read_bytes() for p in save.glob(f"{BRIDGE}.bak-*")] == [torn]  # nothing lost
    assert not list(save.glob(f"{TRACKER}.bak-*")) and (save / TRACKER).read_text() == "10"  # the text one stays
    assert _codes(save) == []


def test_bridge_tracker_naming_a_missing_dir(capsys, tmp_path):
    save = _bridge_save(tmp_path)
    shutil.copy(STATES / "train_state_step20.pt", save / BRIDGE)
    rc, out, _ = run_main(capsys, "check", save)
    assert rc == 1 and "CKD124" in out and "says step 20 but iter_0000020 does not exist" in out
    rc, out, _ = run_main(capsys, "repair", save, "--in-place")
    assert rc == 0, out
    assert (save / BRIDGE).read_bytes() == (STATES / "train_state_step10.pt").read_bytes()
    assert _codes(save) == []


def test_disagreeing_trackers_bridge_follows_the_text_one(capsys, tmp_path):
    """The text tracker rolled back to 10 (as users do); Bridge's still names 20: Bridge would resume there. check
    checks both dirs; repair copies iter 10's train state, leaving the text tracker and iter 20 alone."""
    save = _bridge_save(tmp_path, with_20=True)
    shutil.copy(save / "iter_0000020" / "train_state.pt", save / BRIDGE)
    report = check_paths([str(save)])
    found = {(f.code, Path(f.path).name) for f in report.findings}
    assert ("CKD125", BRIDGE) in found and ("CKD132", "iter_0000020") in found  # iter 20 checked too
    message = next(f.message for f in report.findings if f.code == "CKD125")
    assert "Megatron-Bridge resumes from iter_0000020" in message and "Megatron-LM resumes from iter_0000010" in message
    iter_20 = sorted(p.read_bytes() for p in (save / "iter_0000020").iterdir())
    rc, out, _ = run_main(capsys, "repair", save, "--in-place", "--format", "json")
    assert rc == 0, out
    assert [a["kind"] for a in json.loads(out)["actions"]] == ["bridge-tracker"]
    assert (save / BRIDGE).read_bytes() == (STATES / "train_state_step10.pt").read_bytes()
    assert (save / TRACKER).read_text() == "10"
    assert sorted(p.read_bytes() for p in (save / "iter_0000020").iterdir()) == iter_20
    assert "CKD125" not in _codes(save)


def test_text_tracker_moved_and_bridge_tracker_follows(capsys, tmp_path):
    """Both trackers name iter 20, whose data file is gone: both go to iter 10 (the latest good)."""
    save = _bridge_save(tmp_path, with_20=True)
    (save / TRACKER).write_text("20")
    shutil.copy(save / "iter_0000020" / "train_state.pt", save / BRIDGE)
    (save / "iter_0000020" / "__1_0.distcp").unlink()
    rc, out, _ = run_main(capsys, "repair", save, "--in-place", "--format", "json")
    report = json.loads(out)
    assert rc == 0, out
    assert [(a["kind"], a["value"]) for a in report["actions"]] == [("tracker", "10"), ("bridge-tracker", "10")]
    assert (save / TRACKER).read_text() == "10"
    assert (save / BRIDGE).read_bytes() == (STATES / "train_state_step10.pt").read_bytes()
    assert [p.read_bytes() for p in save.glob(f"{BRIDGE}.bak-*")] == [(STATES / "train_state_step20.pt").read_bytes()]


def test_text_tracker_repaired_bridge_tracker_already_right(capsys, tmp_path):
    save = _bridge_save(tmp_path)
    (save / TRACKER).write_text("99")
    rc, out, _ = run_main(capsys, "repair", save, "--in-place", "--format", "json")
    assert rc == 0, out
    assert [a["kind"] for a in json.loads(out)["actions"]] == ["tracker"]
    assert not list(save.glob(f"{BRIDGE}.bak-*"))  # untouched: it already names iter 10


def test_no_text_tracker_bridge_one_named_in_the_warning(tmp_path):
    save = _bridge_save(tmp_path)
    (save / TRACKER).unlink()
    findings = check_paths([str(save)]).findings
    assert [f.code for f in findings] == ["CKD122"]
    assert "Megatron-Bridge resumes from iter_0000010: latest_train_state.pt" in findings[0].message


def test_train_state_of_the_wrong_step_and_no_copy_from_it(capsys, tmp_path):
    save = _bridge_save(tmp_path)
    shutil.copy(STATES / "train_state_step20.pt", save / ITER / "train_state.pt")  # a mis-copied file
    (save / BRIDGE).write_bytes(b"")
    findings = {(f.code, f.message) for f in check_paths([str(save)]).findings}
    assert ("CKD133", "says step 20, the dir name 10: Megatron-Bridge would resume at step 20") in findings
    assert "CKD123" in {code for code, _ in findings}
    rc, out, _ = run_main(capsys, "repair", save, "--in-place")
    assert rc == 1 and "CKD133" in out
    assert (save / BRIDGE).read_bytes() == b"" and not list(save.glob("*.bak-*"))  # nothing written


def test_iteration_without_train_state_cannot_feed_the_bridge_tracker(capsys, tmp_path):
    save = _bridge_save(tmp_path)
    (save / ITER / "train_state.pt").unlink()  # Bridge then rebuilds its counters: not an error
    (save / BRIDGE).write_bytes(b"garbage")
    assert _codes(save) == ["CKD123"]
    rc, out, _ = run_main(capsys, "repair", save, "--in-place")
    assert rc == 1 and "refused [CKD123]" in out and "has no train_state.pt to copy" in out
    assert (save / BRIDGE).read_bytes() == b"garbage"


def _hostile_train_state(marker: Path) -> bytes:
    """A torch.save-shaped zip whose pickle would run a shell command if unpickled by a plain loader."""
    payload = f"cposix\nsystem\n(S'touch {marker}'\ntR.".encode()
    return torch_zip(payload, (("archive/byteorder", b"little"),))


@pytest.mark.parametrize("where", [BRIDGE, f"{ITER}/train_state.pt"])
def test_hostile_train_state_is_refused_notrun_main(capsys, tmp_path, where):
    save = _bridge_save(tmp_path)
    marker = tmp_path / "executed"
    (save / where).write_bytes(_hostile_train_state(marker))
    rc, out, err = run_main(capsys, "check", save)
    assert rc == 1 and "posix.system" in out and "nothing executed" in squash(out) and "Traceback" not in out + err
    assert "CKD401" in out  # torch loads it with weights_only=False: the gate's finding, not damage
    assert not marker.exists()


def test_bridge_tracker_that_is_a_fifo_or_a_dir(capsys, tmp_path):
    save = _bridge_save(tmp_path)
    (save / BRIDGE).unlink()
    os.mkfifo(save / BRIDGE)
    rc, out, _ = run_main(capsys, "check", save)  # never blocks on the FIFO
    assert rc == 1 and "CKD123" in out and "not a regular file" in out
    rc, out, _ = run_main(capsys, "repair", save, "--in-place")
    assert rc == 0, out
    backups = list(save.glob(f"{BRIDGE}.bak-*"))
    assert len(backups) == 1 and backups[0].is_fifo()  # moved aside, not lost
    assert (save / BRIDGE).read_bytes() == (STATES / "train_state_step10.pt").read_bytes()


def test_repair_to_an_output_writes_both_trackers(capsys, tmp_path):
    save = _bridge_save(tmp_path, with_20=True)
    (save / TRACKER).write_text("20")
    shutil.copy(save / "iter_0000020" / "train_state.pt", save / BRIDGE)
    (save / "iter_0000020" / "__1_0.distcp").unlink()
    before = sorted((p.name, p.read_bytes()) for p in save.rglob("*") if p.is_file())
    out_dir = tmp_path / "out"
    rc, out, _ = run_main(capsys, "repair", save, "--output", out_dir)
    assert rc == 0, out
    assert sorted((p.name, p.read_bytes()) for p in save.rglob("*") if p.is_file()) == before  # source untouched
    assert (out_dir / TRACKER).read_text() == "10"
    assert (out_dir / BRIDGE).read_bytes() == (STATES / "train_state_step10.pt").read_bytes()
    assert _codes(out_dir) == []


def test_killed_between_backup_and_write_then_rerun(tmp_path):
    save = _bridge_save(tmp_path)
    torn = (save / BRIDGE).read_bytes()[:500]
    (save / BRIDGE).write_bytes(torn)
    cmd = [sys.executable, "-m", "ckptdoctor", "repair", str(save), "--in-place"]
    env = dict(os.environ, **{FAULT_ENV: "repair:bridge-tracker-backup"})
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == FAULT_EXIT_CODE, result.stderr
    assert (save / BRIDGE).read_bytes() == torn  # killed before the write: the old file is still there
    assert [p.read_bytes() for p in save.glob(f"{BRIDGE}.bak-*")] == [torn]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (save / BRIDGE).read_bytes() == (STATES / "train_state_step10.pt").read_bytes()
    assert len(list(save.glob(f"{BRIDGE}.bak-*"))) == 2 and _codes(save) == []


# Megatron-Bridge's own read of its tracker (checkpoint_utils.read_train_state, TrainState.load_state_dict) and of
# the dir it names (get_checkpoint_name), with real torch: Bridge itself does not import here.
_BRIDGE_READ = """
import sys, torch
state = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
keys = ("step", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
        "floating_point_operations_so_far", "do_train", "do_valid", "do_test")
values = {k: state[k].item() for k in keys}
print("iter_{:07d}".format(values["step"]))
"""


@pytest.mark.mcore
def test_repaired_bridge_tracker_reads_with_torch_as_bridge_reads_it(capsys, tmp_path):
    save = _bridge_save(tmp_path)
    (save / BRIDGE).write_bytes(b"PK\x03\x04 torn")
    assert main(["repair", str(save), "--in-place"]) == 0
    capsys.readouterr()
    result = subprocess.run(
        [sys.executable, "-c", _BRIDGE_READ, str(save / BRIDGE)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert (save / result.stdout.strip()).is_dir() and result.stdout.strip() == ITER


def test_latest_good_reports_the_bridge_tracker(capsys, tmp_path):
    save = _bridge_save(tmp_path)
    rc, out, _ = run_main(capsys, "latest-good", save, "--format", "json")
    assert rc == 0 and json.loads(out)["bridge_tracker"] == "10"
    (save / BRIDGE).write_bytes(b"torn")
    rc, out, _ = run_main(capsys, "latest-good", save, "--format", "json")
    assert rc == 0 and json.loads(out)["bridge_tracker"] is None


def test_bridge_files_are_read_without_torch(tmp_path):
    save = _bridge_save(tmp_path, with_20=True)
    shutil.copy(save / "iter_0000020" / "train_state.pt", save / BRIDGE)
    result = run_cli("check", str(save), "--format", "json", block=("torch", "megatron"))
    assert result.returncode == 1, result.stderr
    assert "CKD125" in result.stdout and "IMPORTED:\n" in result.stderr


def test_inspect_names_the_bridge_tracker_where_it_differs(capsys, tmp_path):
    save = _bridge_save(tmp_path, with_20=True)
    rc, out, _ = run_main(capsys, "inspect", save)
    assert rc == 0 and "(tracker says 10)" in squash(out)  # they agree: nothing more said
    shutil.copy(save / "iter_0000020" / "train_state.pt", save / BRIDGE)
    rc, out, _ = run_main(capsys, "inspect", save)
    assert rc == 0 and "(tracker says 10; Megatron-Bridge's latest_train_state.pt says 20)" in squash(out)
    (save / BRIDGE).write_bytes(b"torn")
    rc, out, _ = run_main(capsys, "inspect", save, "--format", "json")
    assert rc == 0 and json.loads(out)["tracker"]["bridge"] == "unreadable"
    jsonschema.validate(json.loads(out), shipped_schema("inspect"))


@pytest.mark.parametrize(
    "fixture, command",
    [
        ("core019_peft_full_tp1", ["strip-frozen", "--preset", "lora", "-o"]),
        ("core019_tp2", ["edit", "--drop-section", "optimizer", "-o"]),
        ("core019_convert_tp4", ["fix-args", "--output"]),
    ],
)
def test_rewritten_save_dirs_carry_the_bridge_tracker(capsys, tmp_path, fixture, command):
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / fixture, save)
    shutil.copy(STATES / "train_state_step10.pt", save / ITER / "train_state.pt")
    shutil.copy(save / ITER / "train_state.pt", save / BRIDGE)
    out_dir = tmp_path / "out"
    rc, out, err = run_main(capsys, command[0], save, *command[1:], out_dir)
    assert rc == 0, out + err
    assert (out_dir / BRIDGE).read_bytes() == (STATES / "train_state_step10.pt").read_bytes()
    assert (out_dir / ITER / "train_state.pt").is_file() and _codes(out_dir) == []
    (save / BRIDGE).unlink()  # a save dir without Bridge's tracker gets none
    shutil.rmtree(out_dir)
    rc, out, err = run_main(capsys, command[0], save, *command[1:], out_dir)
    assert rc == 0, out + err
    assert not (out_dir / BRIDGE).exists()


def test_save_dir_with_only_the_bridge_tracker_is_followed(capsys, tmp_path):
    """Without the text tracker every command follows Bridge's, as Bridge's resume does."""
    save = _bridge_save(tmp_path)
    (save / TRACKER).unlink()
    rc, out, _ = run_main(capsys, "inspect", save)
    assert rc == 0 and f"checkpoint      {save / ITER}" in out
    assert "(Megatron-Bridge's tracker says 10, no latest_checkpointed_iteration.txt)" in out
    rc, out, _ = run_main(capsys, "repair", save, "--in-place", "--format", "json")
    assert rc == 0 and [a["kind"] for a in json.loads(out)["actions"]] == ["tracker"]
    assert (save / TRACKER).read_text() == "10" and not list(save.glob(f"{BRIDGE}.bak-*"))
    (save / TRACKER).unlink()
    (save / BRIDGE).write_bytes(b"torn")
    rc, out, err = run_main(capsys, "inspect", save)
    assert (
        rc == 2
        and err.strip()
        == f"ckptdoctor: error: {save / BRIDGE}: not a readable torch.save file (too short for a zip archive)"
    )
    shutil.copy(STATES / "train_state_step20.pt", save / BRIDGE)
    rc, out, err = run_main(capsys, "inspect", save)
    assert rc == 2 and "Megatron-Bridge's tracker" in err and "iter_0000020" in err and "Traceback" not in err


def test_pre_commit_passes_bridge_files(capsys, tmp_path):
    """The hook's file pattern takes Bridge's files; each leads to its save dir or iteration dir."""
    from ckptdoctor.ops.check import CHECKPOINT_FILE_RE

    save = _bridge_save(tmp_path)
    assert CHECKPOINT_FILE_RE.search(str(save / BRIDGE)) and CHECKPOINT_FILE_RE.search(
        str(save / ITER / "train_state.pt")
    )
    (save / BRIDGE).write_bytes(b"torn")
    rc, out, _ = run_main(capsys, "check", "--isolated", save / BRIDGE)
    assert rc == 1 and "CKD123" in out
    shutil.copy(STATES / "train_state_step20.pt", save / ITER / "train_state.pt")
    rc, out, _ = run_main(capsys, "check", "--isolated", save / ITER / "train_state.pt")
    assert rc == 1 and "CKD133" in out and "CKD123" not in out  # the iteration dir alone
