"""Issue #37 item 4: ``ckptdoctor history SAVE_DIR``: one line per iteration dir (iteration, status and why, size,
sealed, which tracker names it), in text and JSON, from metadata only, ``--jobs`` not changing a byte of it, and on
object storage as on disk. The save dir is built from the real fixtures: copies of their iteration dirs, one sealed
with ``ckptdoctor seal``, one that lost a data file, one cut short, the tracker on the broken newest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jsonschema
import pytest
import s3_server
from conftest import FIXTURES, run_cli, run_main, shipped_schema

from ckptdoctor.storage import interface

ITER = "iter_0000010"
TRACKER = "latest_checkpointed_iteration.txt"
BRIDGE_TRACKER = "latest_train_state.pt"
NAME = "core019_tp2"


def _sizes(directory: Path) -> tuple[int, int]:
    files = [p for p in directory.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _save(tmp_path: Path, capsys) -> Path:
    """iter 10 sealed and good; 20 with a stray data file (CKD115, a warning); 30 lost rank 0's data file; 40 is
    an interrupted save (no metadata.json, rank 1's file cut short), and the tracker names 40."""
    save = tmp_path / "save"
    save.mkdir()
    for i in (10, 20, 30, 40):
        shutil.copytree(FIXTURES / NAME / ITER, save / f"iter_{i:07d}")
    rc, _, err = run_main(capsys, "seal", save / "iter_0000010")
    assert rc == 0, err
    shutil.copy(save / "iter_0000020" / "__0_0.distcp", save / "iter_0000020" / "__7_0.distcp")
    (save / "iter_0000030" / "__0_0.distcp").unlink()
    (save / "iter_0000040" / "metadata.json").unlink()
    with open(save / "iter_0000040" / "__1_0.distcp", "r+b") as f:
        f.truncate(1000)
    (save / TRACKER).write_text("40")
    return save


def _json(capsys, *args: object, codes: tuple[int, ...] = (0,)) -> dict:
    rc, out, err = run_main(capsys, "history", *args, "--format", "json")
    assert rc in codes, (rc, err)
    doc = json.loads(out)
    jsonschema.Draft202012Validator(shipped_schema("history")).validate(doc)
    return doc


def test_history_lists_each_iteration_dir_with_its_status_size_seal_and_tracker(capsys, tmp_path):
    save = _save(tmp_path, capsys)
    # the copies' common state says iteration 10 (CKD132): ignored, so that only the damage made here decides
    doc = _json(capsys, save, "--ignore", "CKD132")
    assert doc["save_dir"] == str(save) and doc["tracker"] == "40" and doc["bridge_tracker"] is None
    rows = {row["iteration"]: row for row in doc["iterations"]}
    assert [row["iteration"] for row in doc["iterations"]] == [40, 30, 20, 10]  # newest first
    assert {i: rows[i]["status"] for i in rows} == {40: "broken", 30: "broken", 20: "warnings", 10: "good"}
    assert rows[40]["top"]["code"] == "CKD101" and rows[40]["errors"] == 2  # and CKD114
    assert rows[30]["top"]["code"] == "CKD113" and rows[30]["top"]["lost"]
    assert rows[20]["top"]["code"] == "CKD115" and (rows[20]["errors"], rows[20]["warnings"]) == (0, 1)
    assert rows[10]["top"] is None and rows[10]["errors"] == rows[10]["warnings"] == 0
    for i, row in rows.items():
        assert row["iteration_dir"] == str(save / f"iter_{i:07d}") and row["release"] is False
        assert (row["bytes"], row["files"]) == _sizes(save / f"iter_{i:07d}")
        assert row["sealed"] is (i == 10) and row["tracker"] is (i == 40) and row["bridge_tracker"] is False
    assert doc["findings"] == []

    rc, out, _ = run_main(capsys, "history", save, "--ignore", "CKD132")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["iteration", "status", "size", "sealed", "tracker", "why"]
    by_iteration = {line.split()[0]: line.split() for line in lines[1:5]}
    assert list(by_iteration) == ["40", "30", "20", "10"]
    for i, words in by_iteration.items():
        row = rows[int(i)]
        assert words[1] == row["status"]
        assert words[4] == ("yes" if row["sealed"] else "no")
        assert words[5] == ("tracker" if row["tracker"] else "-")
        if row["top"] is None:
            assert len(words) == 6
        else:
            assert words[6] == row["top"]["code"]
    assert "(and 1 more finding)" in lines[1]  # iter 40's CKD114 behind its CKD101
    assert lines[-1] == (
        "4 iteration dirs: 1 good, 1 with warnings, 2 broken; the tracker names 40 (broken); latest good: 20."
    )


def test_history_verifies_the_seal_only_when_asked_and_says_so(capsys, tmp_path):
    """A sealed dir whose data changed after the seal: from metadata it is good (the summary says its hashes were
    not verified); --verify-integrity hashes it as latest-good does, and then it is broken (CKD301)."""
    save = tmp_path / "save"
    save.mkdir()
    shutil.copytree(FIXTURES / NAME / ITER, save / ITER)
    (save / TRACKER).write_text("10")
    rc, _, err = run_main(capsys, "seal", save)
    assert rc == 0, err
    with open(save / ITER / "__0_0.distcp", "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 1]))
    doc = _json(capsys, save)
    assert doc["integrity_verified"] is False and doc["iterations"][0]["status"] == "good"
    rc, out, _ = run_main(capsys, "history", save)
    assert rc == 0 and "latest good: 10 (its integrity.json hashes not verified: --verify-integrity" in " ".join(
        out.split()
    )
    doc = _json(capsys, save, "--verify-integrity", codes=(1,))
    assert doc["integrity_verified"] is True
    assert doc["iterations"][0]["status"] == "broken" and doc["iterations"][0]["top"]["code"] == "CKD301"
    rc, _, _ = run_main(capsys, "latest-good", save)
    assert rc == 1  # the two agree


def test_history_sizes_are_human_readable(capsys, tmp_path):
    save = _save(tmp_path, capsys)
    rc, out, _ = run_main(capsys, "history", save)
    assert rc == 0
    size, _ = _sizes(save / ITER)
    row = next(line for line in out.splitlines() if line.startswith("10 "))
    assert f"{size / 1024:.1f} KiB" in row


def test_history_exit_code_and_tracker_findings(capsys, tmp_path):
    save = _save(tmp_path, capsys)
    shutil.rmtree(save / "iter_0000010")
    shutil.rmtree(save / "iter_0000020")
    (save / TRACKER).write_text("99")
    doc = _json(capsys, save, "--ignore", "CKD132", codes=(1,))  # listed, but no dir passes check
    assert [row["status"] for row in doc["iterations"]] == ["broken", "broken"]
    assert [f["code"] for f in doc["findings"]] == ["CKD121"] and doc["tracker"] == "99"
    assert not any(row["tracker"] for row in doc["iterations"])
    rc, out, _ = run_main(capsys, "history", save, "--ignore", "CKD132")
    assert rc == 1 and "CKD121 [error] tracker says 99" in out
    assert out.splitlines()[-1].endswith("the tracker names 99, which is not here; none passes check.")
    # --select narrows what counts, as in latest-good: only a missing metadata.json
    doc = _json(capsys, save, "--select", "CKD101")
    assert [row["status"] for row in doc["iterations"]] == ["broken", "good"]
    rc, _, err = run_main(capsys, "history", tmp_path / "nowhere")
    assert rc == 2 and "nowhere" in err
    rc, _, err = run_main(capsys, "history", save / "iter_0000030")
    assert rc == 2 and "not a save dir" in err


def test_history_jobs_do_not_change_the_output(capsys, tmp_path):
    save = _save(tmp_path, capsys)
    outputs = set()
    for jobs in ("1", "3"):
        for fmt in ("text", "json"):
            rc, out, _ = run_main(capsys, "history", save, "--jobs", jobs, "--format", fmt)
            outputs.add((fmt, rc, out))
    assert len(outputs) == 2


def test_history_of_a_bridge_save_marks_its_tracker(capsys, tmp_path):
    """Megatron-Bridge's save dir: latest_train_state.pt names the step it resumes from."""
    save = _save(tmp_path, capsys)
    (save / TRACKER).unlink()
    shutil.copy(FIXTURES / "bridge_train_state" / "train_state_step20.pt", save / BRIDGE_TRACKER)
    doc = _json(capsys, save, "--ignore", "CKD132")
    assert doc["tracker"] is None and doc["bridge_tracker"] == "20"
    assert [row["iteration"] for row in doc["iterations"] if row["bridge_tracker"]] == [20]
    assert not any(row["tracker"] for row in doc["iterations"])
    assert [f["code"] for f in doc["findings"]] == ["CKD122"]  # Megatron-LM's tracker is missing: a warning
    rc, out, _ = run_main(capsys, "history", save, "--ignore", "CKD132")
    assert rc == 0 and next(line for line in out.splitlines() if line.startswith("20 ")).split()[5] == "bridge"


def test_history_of_nemo_style_iteration_dirs_checks_their_weights(capsys, tmp_path):
    """A NeMo 2 style iteration dir holds its distributed checkpoint in ``weights/``, as locate accepts."""
    save = tmp_path / "save"
    (save / "iter_0000010").mkdir(parents=True)
    shutil.copytree(FIXTURES / NAME / ITER, save / "iter_0000010" / "weights")
    (save / TRACKER).write_text("10")
    doc = _json(capsys, save)
    (row,) = doc["iterations"]
    assert row["status"] == "good" and row["tracker"] is True
    assert (row["bytes"], row["files"]) == _sizes(save / "iter_0000010")


def test_history_imports_no_torch(tmp_path, capsys):
    save = _save(tmp_path, capsys)
    proc = run_cli("history", str(save), "--jobs", "1", block=("torch", "megatron", "numpy"))
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED:\n" in proc.stderr and "40         broken" in proc.stdout


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = s3_server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.xdist_group("s3")
def test_history_on_object_storage_equals_local(s3, capsys, tmp_path, monkeypatch):
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    save = _save(tmp_path, capsys)
    s3.upload_tree(save, "history/save")
    url = f"s3://{s3_server.BUCKET}/history/save"
    for args in ([], ["--format", "json"], ["--jobs", "2", "--format", "json"]):
        interface.forget_stores()
        local = run_main(capsys, "history", save, "--ignore", "CKD132", *args)
        interface.forget_stores()
        remote = run_main(capsys, "history", url, "--ignore", "CKD132", *args)
        assert remote[0] == local[0] == 0
        assert remote[1].replace(url, str(save)) == local[1], remote[2]
    assert os.environ.get("AWS_ACCESS_KEY_ID")  # the server's credentials were in use


def test_history_and_latest_good_take_the_tracker_file_as_the_other_commands_do(capsys):
    tracker = FIXTURES / NAME / TRACKER
    for command in ("history", "latest-good"):
        rc, out, err = run_main(capsys, command, tracker, "--format", "json")
        assert rc == 0, (command, err)
        assert json.loads(out)["save_dir"] == str(FIXTURES / NAME)
    rc, _, err = run_main(capsys, "history", FIXTURES / NAME / "nope")
    assert rc == 2 and "no such file or directory" in err


def test_a_dir_not_named_as_megatron_names_an_iteration_is_not_one(capsys, tmp_path):
    """iter_00000010 is no dir Megatron writes or loads (iter_{:07d}); read as iteration 10 it made two dirs of one
    iteration: history listed both, latest-good chose one and inspect -i 10 the other."""
    save = tmp_path / "save"
    save.mkdir()
    for name in (ITER, "iter_00000010"):
        shutil.copytree(FIXTURES / NAME / ITER, save / name)
    (save / TRACKER).write_text("10")
    rc, out, err = run_main(capsys, "history", save, "--format", "json")
    assert rc == 0 and [row["iteration_dir"] for row in json.loads(out)["iterations"]] == [str(save / ITER)], out
    rc, out, err = run_main(capsys, "latest-good", save)
    assert rc == 0 and out.strip() == str(save / ITER), out + err
