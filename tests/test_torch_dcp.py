"""Megatron-LM's --ckpt-format torch_dcp checkpoints (plain DCP, no metadata.json) are named for what they are
(CKD103), never taken for an interrupted torch_dist save whose metadata.json repair would write: Megatron-LM would
then read the dir as torch_dist. The fixture is written by fixtures/generate.py --backend torch_dcp."""

from __future__ import annotations

import shutil

import pytest
from conftest import FIXTURES, file_digests, run_cli, run_main

from ckptdoctor.ops.check import check_paths

TORCH_DCP = FIXTURES / "unsupported" / "core019_mlm_torch_dcp_tp1"
ITER = "iter_0000010"


def test_check_names_the_format(capsys):
    findings = check_paths([str(TORCH_DCP)]).findings
    assert [f.code for f in findings] == ["CKD103"]
    assert "--ckpt-format torch_dcp" in findings[0].message and "without metadata.json" in findings[0].message
    rc, out, _ = run_main(capsys, "check", TORCH_DCP)
    assert rc == 1 and "fix:" not in out  # no repair suggested


def test_repair_writes_nothing(capsys, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(TORCH_DCP, save)
    before = file_digests(save)
    rc, out, _ = run_main(capsys, "repair", save, "--in-place")
    assert rc == 1 and "not a format ckptdoctor repairs" in out and "data above is lost" not in out
    assert "point latest_checkpointed_iteration.txt" not in out and "refused" not in out
    assert file_digests(save) == before and not (save / ITER / "metadata.json").exists()


def test_other_commands_refuse_in_one_line(capsys):
    for command in (
        ["inspect"],
        ["diff", TORCH_DCP],
        ["edit", "--drop-section", "optimizer", "--dry-run"],
        ["strip-frozen", "--dry-run"],
    ):
        rc, out, err = run_main(capsys, command[0], TORCH_DCP, *command[1:])
        assert rc == 2 and "torch_dcp" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["core019_tp2", "core016_tp2"])
def test_an_interrupted_torch_dist_save_stays_one(tmp_path, name):
    """Without metadata.json a torch_dist save (common state in a common_state item or common.pt) is still CKD101."""
    save = tmp_path / name
    shutil.copytree(FIXTURES / name, save)
    (save / ITER / "metadata.json").unlink()
    assert [f.code for f in check_paths([str(save)]).findings] == ["CKD101"]


def test_read_without_torch():
    result = run_cli("check", str(TORCH_DCP), block=("torch", "megatron"))
    assert result.returncode == 1 and "CKD103" in result.stdout and "IMPORTED:\n" in result.stderr


def test_repair_of_an_unsupported_save_dir_leaves_its_bridge_tracker_too(capsys, tmp_path):
    """Nothing changes in a save dir whose checkpoint ckptdoctor does not read, Megatron-Bridge's tracker included."""
    save = tmp_path / "save"
    shutil.copytree(TORCH_DCP, save)
    shutil.copy(FIXTURES / "bridge_train_state" / "train_state_step10.pt", save / ITER / "train_state.pt")
    (save / "latest_train_state.pt").write_bytes(b"torn")
    before = file_digests(save)
    rc, out, _ = run_main(capsys, "repair", save, "--in-place")
    assert rc == 1 and "not a format ckptdoctor repairs" in out and file_digests(save) == before
