"""latest-good, seal and repair (issue #12), on copies of the real megatron-core fixtures damaged by each test."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, file_digests, require_mcore, squash

from ckptdoctor.atomic import FAULT_ENV, FAULT_EXIT_CODE
from ckptdoctor.cli import main
from ckptdoctor.ops.check import check_paths

ITER = "iter_0000010"
TRACKER = "latest_checkpointed_iteration.txt"


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _codes(path: Path) -> set[str]:
    return {f.code for f in check_paths([str(path)]).findings}


def _three_iterations(tmp_path: Path, name: str = "core019_tp2") -> Path:
    """A save dir with iter 10, 20, 30 (copies of one fixture's iteration dir), the tracker at 30;
    30 is an interrupted save (no metadata.json, a rank's file cut short), 20 lost a rank's data file."""
    save = tmp_path / "save"
    save.mkdir()
    for i in (10, 20, 30):
        shutil.copytree(FIXTURES / name / ITER, save / f"iter_{i:07d}")
    (save / TRACKER).write_text("30")
    (save / "iter_0000030" / "metadata.json").unlink()
    with open(save / "iter_0000030" / "__1_0.distcp", "r+b") as f:
        f.truncate(1000)
    (save / "iter_0000020" / "__0_0.distcp").unlink()
    return save


# --- latest-good ----------------------------------------------------------------------------------------


def test_latest_good_picks_the_oldest_of_three(capsys, tmp_path):
    save = _three_iterations(tmp_path)
    # CKD132 (the copies' saved iteration is 10) is ignored so that only the damage made here decides
    rc, out, err = _run(capsys, "latest-good", save, "--ignore", "CKD132")
    assert rc == 0 and out.strip() == str(save / ITER)
    assert "skipped" in err and "iter_0000030: CKD101" in err and "iter_0000020: CKD113" in err
    rc, out, _ = _run(capsys, "latest-good", save, "--ignore", "CKD132", "--iteration-only")
    assert rc == 0 and out.strip() == "10"
    rc, out, _ = _run(capsys, "latest-good", save, "--ignore", "CKD132", "--format", "json")
    report = json.loads(out)
    assert report["iteration"] == 10 and report["tracker"] == "30"
    assert [Path(s["iteration_dir"]).name for s in report["skipped"]] == ["iter_0000030", "iter_0000020"]
    assert {e["code"] for e in report["skipped"][0]["errors"]} == {"CKD101", "CKD114"}


def test_latest_good_none_and_select(capsys, tmp_path):
    save = _three_iterations(tmp_path)
    (save / ITER / ".metadata").write_bytes(b"garbage")
    rc, out, err = _run(capsys, "latest-good", save, "--ignore", "CKD132")
    assert rc == 1 and out == "" and "no iteration dir" in err
    # --select narrows what disqualifies: only a missing metadata.json counts
    rc, out, _ = _run(capsys, "latest-good", save, "--select", "CKD101", "--iteration-only")
    assert rc == 0 and out.strip() == "20"
    rc, _, err = _run(capsys, "latest-good", tmp_path / "nowhere")
    assert rc == 2


def test_latest_good_warnings_do_not_disqualify(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    shutil.copy(save / ITER / "__0_0.distcp", save / ITER / "__5_0.distcp")  # CKD115, a warning
    rc, out, _ = _run(capsys, "latest-good", save, "--iteration-only")
    assert rc == 0 and out.strip() == "10"


# --- seal -----------------------------------------------------------------------------------------------


def test_seal_writes_megatrons_manifest(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    iteration_dir = save / ITER
    rc, out, _ = _run(capsys, "seal", save, "--jobs", "1")
    assert rc == 0 and "sealed" in out
    manifest = json.loads((iteration_dir / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256"
    assert list(manifest["files"]) == sorted(p.name for p in iteration_dir.iterdir() if p.name != "integrity.json")
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((iteration_dir / name).read_bytes()).hexdigest() == digest
    single = (iteration_dir / "integrity.json").read_bytes()
    rc, out, _ = _run(capsys, "seal", save, "--force", "--jobs", "4", "--format", "json")
    assert rc == 0 and json.loads(out)["replaced"] is True and json.loads(out)["jobs"] == 4
    assert (iteration_dir / "integrity.json").read_bytes() == single  # parallel hashing: the same manifest
    (kept,) = save.glob(f"{ITER}.quarantine-*/integrity.json.bak-*")  # the replaced one is kept, beside the dir
    assert kept.read_bytes() == single and str(kept) in json.loads(out)["notes"][-1]
    assert _codes(save) == set()
    with open(iteration_dir / "__1_0.distcp", "r+b") as f:  # one payload byte flipped
        f.seek(600)
        byte = f.read(1)
        f.seek(600)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "CKD301" in _codes(save)


def test_seal_of_a_sealed_checkpoint_is_unchanged_exit_0(capsys, copy_fixture):
    """Issue #35 point 9: "seal if not sealed" in a pipeline. A second seal exits 0, `already sealed, unchanged`,
    hashes and writes nothing (text and JSON); a manifest that does not describe the dir is refused, naming
    --force; --force re-seals."""
    save = copy_fixture("core019_tp2")
    iteration_dir = save / ITER
    assert _run(capsys, "seal", save)[0] == 0
    manifest = iteration_dir / "integrity.json"
    before = (manifest.read_bytes(), manifest.stat().st_mtime_ns, sorted(p.name for p in save.iterdir()))
    rc, out, err = _run(capsys, "seal", save)
    assert (rc, err) == (0, "") and out.startswith(f"already sealed, unchanged: {iteration_dir}"), out + err
    rc, out, err = _run(capsys, "seal", save / ITER, "--format", "json")
    result = json.loads(out)
    assert rc == 0 and result["unchanged"] is True and result["replaced"] is False and result["bytes"] == 0
    assert result["files"] == 4 and "already sealed, unchanged" in result["notes"][0]
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns, sorted(p.name for p in save.iterdir())) == before
    metadata = iteration_dir / ".metadata"
    original = metadata.read_bytes()
    metadata.write_bytes(original[:2] + b"]\x8c\x02os\x8c\x06system\x93a0" + original[2:])  # listed, unsafe now
    rc, out, err = _run(capsys, "seal", save)
    assert rc == 1 and "CKD401" in err and "os.system" in err, out + err  # the gate, as for every write command
    metadata.write_bytes(original)
    (iteration_dir / "notes.txt").write_text("added after the seal\n")  # CKD304: the manifest no longer lists all
    rc, out, err = _run(capsys, "seal", save)
    assert rc == 2 and out == "" and "CKD304" in err and "--force" in err and err.count("\n") == 1, err
    rc, out, _ = _run(capsys, "seal", save, "--force", "--format", "json")
    assert rc == 0 and json.loads(out)["replaced"] is True and json.loads(out)["unchanged"] is False
    assert "notes.txt" in json.loads(manifest.read_text())["files"]


def test_seal_refuses_a_checkpoint_that_fails_check(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    (save / ITER / "metadata.json").unlink()
    rc, _, err = _run(capsys, "seal", save / ITER)
    assert rc == 2 and "metadata.json" in err
    assert not (save / ITER / "integrity.json").exists()
    save2 = copy_fixture("core019_tp2")
    with open(save2 / ITER / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    rc, _, err = _run(capsys, "seal", save2)
    assert rc == 2 and "refusing to seal" in err and "CKD114" in err
    assert not (save2 / ITER / "integrity.json").exists()


def test_seal_refuses_zarr_and_check_says_a_manifest_there_covers_no_tensor(capsys, copy_fixture, tmp_path):
    """A zarr save keeps each tensor's chunks in a subdirectory: Megatron's manifest (file names in the dir) cannot
    list them, so a seal would vouch for the common state alone."""
    save = copy_fixture("core014_zarr_tp2")
    rc, _, err = _run(capsys, "seal", save)
    assert rc == 2 and "legacy zarr checkpoint" in err and "nothing was changed" in err
    assert not (save / ITER / "integrity.json").exists()
    rc, _, err = _run(capsys, "seal", save, "-o", tmp_path / "copy")
    assert rc == 2 and "legacy zarr checkpoint" in err and not (tmp_path / "copy").exists()
    listed = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (save / ITER).iterdir() if p.is_file()}
    (save / ITER / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": listed}))
    rc, out, _ = _run(capsys, "check", save, "--format", "json")
    found = json.loads(out)["findings"]
    assert rc == 1 and [(f["code"], f["severity"]) for f in found] == [("CKD304", "warning")]
    assert "per-tensor subdirectories" in found[0]["message"]


def test_seal_output_never_is_contains_or_lies_inside_the_source(capsys, copy_fixture):
    """seal -o --force replaces its output: the source save dir, a dir holding it, or one inside it is refused
    (exit 2, nothing changed), as every other write command refuses it."""
    save = copy_fixture("core019_tp1")
    shutil.copytree(save / ITER, save / "iter_0000005")
    (save / "notes.txt").write_text("mine")
    before = file_digests(save.parent)
    for source, output in (
        (save, save),
        (save / ITER, save.parent),
        (save, save / ITER / "sealed"),
        (save / ITER, save / ITER),
    ):
        rc, _, err = _run(capsys, "seal", source, "-o", output, "--force")
        assert rc == 2 and "is, contains or lies inside the source checkpoint" in err, (source, output)
    assert file_digests(save.parent) == before


def test_seal_output_refuses_files_that_change_while_hashed_and_a_writer_holding_the_lock(
    capsys, copy_fixture, tmp_path, monkeypatch
):
    """The manifest must hash the bytes the copy links: a file rewritten meanwhile stops the copy (nothing
    written), and an in-place writer's lock on the source refuses it."""
    from ckptdoctor.ops import seal as seal_op

    save = copy_fixture("core019_tp1")
    hash_timed = seal_op._hash_timed

    def rewriting(files, *args, **kwargs):
        result = hash_timed(files, *args, **kwargs)
        data = save / ITER / "__0_0.distcp"
        data.write_bytes(data.read_bytes())  # same bytes, a new mtime: a writer was there
        os.utime(data, ns=(1, 1))
        return result

    monkeypatch.setattr(seal_op, "_hash_timed", rewriting)
    rc, _, err = _run(capsys, "seal", save, "-o", tmp_path / "a")
    assert rc == 2 and "files changed while they were hashed" in err and not (tmp_path / "a").exists()
    monkeypatch.undo()
    holder = subprocess.Popen(  # an in-place write in another process holds the source's lock
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from ckptdoctor import locking\n"
            "with locking.checkpoint_lock(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(60)",
            str(save / ITER),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        rc, _, err = _run(capsys, "seal", save, "-o", tmp_path / "b")
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2 and "writing this checkpoint" in err and not (tmp_path / "b").exists()
    rc, _, err = _run(capsys, "seal", save, "-o", tmp_path / "c")
    assert rc == 0, err


def test_seal_output_writes_a_sealed_copy_and_leaves_the_source(capsys, copy_fixture, tmp_path):
    """``seal -o DIR`` (issue #37 point 6, the form object storage needs): a new save dir whose files are the
    source's (hard links) plus Megatron's manifest over them; the source is not changed. A sealed source is
    refused without --force, and so is a non-empty output."""
    save = copy_fixture("core019_tp2")
    before = file_digests(save)
    out = tmp_path / "sealed"
    rc, text, err = _run(capsys, "seal", save, "-o", out, "--jobs", "2")
    assert rc == 0 and text.startswith(f"sealed {out / ITER}: "), text + err
    assert file_digests(save) == before  # the source: no integrity.json, nothing else changed
    manifest = json.loads((out / ITER / "integrity.json").read_text())
    expected = {Path(n).name: d for n, d in before.items() if n.startswith(f"{ITER}/")}
    assert manifest == {"algorithm": "sha256", "files": expected}
    for name in manifest["files"]:  # the copy's files are the source's own
        assert os.stat(out / ITER / name).st_ino == os.stat(save / ITER / name).st_ino
    assert (out / TRACKER).read_text() == "10" and _codes(out) == set()
    rc, _, err = _run(capsys, "seal", out, "-o", tmp_path / "again")
    assert rc == 2 and "already sealed" in err and "--force" in err and not (tmp_path / "again").exists()
    rc, _, err = _run(capsys, "seal", save, "-o", out)
    assert rc == 2 and "not empty" in err


_MEGATRON_VERIFY = """
import sys
from megatron.core.dist_checkpointing.validation import verify_integrity_manifest
try:
    verify_integrity_manifest(sys.argv[1])
except Exception as exc:
    print("REJECTED", type(exc).__name__, exc)
else:
    print("ACCEPTED")
"""


def _megatron_verify(iteration_dir: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _MEGATRON_VERIFY, str(iteration_dir)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


@pytest.mark.mcore
@pytest.mark.parametrize("name", ["core019_tp2", "core016_tp2"])
def test_megatron_verifier_accepts_a_sealed_checkpoint_and_rejects_a_flipped_byte(capsys, copy_fixture, tmp_path, name):
    require_mcore()
    save = copy_fixture(name)
    iteration_dir = save / ITER
    assert _megatron_verify(iteration_dir).startswith("REJECTED")  # no manifest yet
    rc, _, _ = _run(capsys, "seal", save)
    assert rc == 0
    assert _megatron_verify(iteration_dir) == "ACCEPTED"
    # byte-identical to what megatron-core's own save_integrity_manifest writes for the same dir
    twin = tmp_path / "twin"
    shutil.copytree(iteration_dir, twin)
    (twin / "integrity.json").unlink()
    code = (
        "import sys; from megatron.core.dist_checkpointing.validation import save_integrity_manifest; "
        "save_integrity_manifest(sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", code, str(twin)], check=True, capture_output=True, timeout=300)
    assert (twin / "integrity.json").read_bytes() == (iteration_dir / "integrity.json").read_bytes()
    data = sorted(iteration_dir.glob("*.distcp"))[-1]
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)
        f.seek(data.stat().st_size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    verdict = _megatron_verify(iteration_dir)
    assert verdict.startswith("REJECTED CheckpointingException") and f"{data.name}: hash mismatch" in verdict


# --- repair ---------------------------------------------------------------------------------------------


def test_repair_tracker_pointing_nowhere(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    (save / TRACKER).write_text("99")
    rc, out, _ = _run(capsys, "repair", save)
    assert rc == 1 and "[CKD121] point latest_checkpointed_iteration.txt to 10" in out
    assert (save / TRACKER).read_text() == "99"  # report only
    rc, out, _ = _run(capsys, "repair", save, "--in-place")
    assert rc == 0 and "the repaired findings are gone" in out
    assert (save / TRACKER).read_text() == "10"
    assert [p.read_text() for p in save.glob(f"{TRACKER}.bak-*")] == ["99"]
    assert _codes(save) == set()


def test_repair_tracker_garbage_and_release(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    (save / ITER).rename(save / "release")
    (save / TRACKER).write_text("garbage")
    rc, out, _ = _run(capsys, "repair", save, "--in-place", "--format", "json")
    report = json.loads(out)
    assert rc == 0 and report["actions"][0]["fixes"] == ["CKD120"] and report["actions"][0]["value"] == "release"
    assert (save / TRACKER).read_text() == "release"


def test_repair_tracker_pointing_to_an_incomplete_iteration(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    broken = save / "iter_0000020"
    shutil.copytree(save / ITER, broken)
    (broken / "metadata.json").unlink()
    with open(broken / "__1_0.distcp", "r+b") as f:
        f.truncate(5000)
    (save / TRACKER).write_text("20")
    before = file_digests(broken)
    rc, out, _ = _run(capsys, "repair", save)
    assert rc == 1
    out = squash(out)  # wrapped to the width: the phrases whatever the tmp path's length
    assert "refused [CKD101]" in out and "must stay incomplete" in out and "CKD114" in out
    assert (
        "not repairable" in out
        and "truncated: 5000 bytes" in out
        and " chunks of " in out
        and f"latest good one: {save / ITER}" in out
    )
    rc, out, _ = _run(capsys, "repair", save, "--in-place")
    assert rc == 0, out
    assert (save / TRACKER).read_text() == "10"
    assert file_digests(broken) == before  # the incomplete save stays as it was: incomplete
    assert _codes(save) == set()


def _damaged(save: Path, damage: str) -> None:
    if damage in ("data-file", "tracker"):
        (save / ITER / "__1_0.distcp").unlink()
    if damage == "tracker":
        (save / TRACKER).write_text("99")
    if damage == "unsafe-pickle":  # .metadata references os.system (a list holding the global; nothing runs)
        metadata = save / ITER / ".metadata"
        original = metadata.read_bytes()
        metadata.write_bytes(original[:2] + b"]\x8c\x02os\x8c\x06system\x93a0" + original[2:])


@pytest.mark.parametrize(
    "damage, lost",
    [
        ("data-file", "the data of CKD113 is lost from this checkpoint"),
        ("tracker", None),  # the tracker and its dir: nothing lost by the tracker
        ("unsafe-pickle", None),
    ],
)
def test_repair_refusals_name_what_check_found_and_lose_only_lost_data(capsys, copy_fixture, damage, lost):
    """Issue #35 point 5: a refusal names a code check found (it said "refused [CKD121]" where check found only
    CKD113 or CKD401), and "lost" is said of data that is (it followed a tracker line and an unsafe pickle)."""
    save = copy_fixture("core019_tp2")
    _damaged(save, damage)
    found = _codes(save)
    runs = [[save], [save, "--format", "json"]] + ([[save / ITER]] if damage != "tracker" else [])  # its dir lost data
    for args in runs:
        rc, out, _ = _run(capsys, "repair", *args)
        assert rc == 1, out
        if "--format" in args:
            report = json.loads(out)
            assert {r["code"] for r in report["refused"]} <= found, (found, report["refused"])
            text = report["way_out"]
        else:
            refused = {line.split("]")[0].removeprefix("refused [") for line in out.splitlines() if "refused [" in line}
            assert refused <= found, (found, out)
            assert "the data above is lost" not in out
            text = out
        if lost is not None:
            assert lost in text, text
        else:
            assert "is lost" not in text.replace("no data is lost", ""), text
    if damage == "unsafe-pickle":
        assert "CKD401: no data is lost, but loading it would run the code the gate refused" in text
    if damage == "tracker":
        rc, out, _ = _run(capsys, "repair", save)
        assert "CKD121: the tracker loses no data" in out and "latest-good skipped iter_0000010: CKD113" in out


@pytest.mark.parametrize("name", ["core019_tp2", "core016_tp2", "core014_zarr_tp2"])
def test_repair_missing_metadata_json_of_a_complete_save(capsys, copy_fixture, tmp_path, name):
    save = copy_fixture(name)
    original = (save / ITER / "metadata.json").read_bytes()
    (save / ITER / "metadata.json").unlink()
    source = file_digests(save)
    rc, out, _ = _run(capsys, "repair", save, "--output", tmp_path / "out")
    assert rc == 0, out
    assert file_digests(save) == source  # --output leaves the source untouched
    assert (tmp_path / "out" / ITER / "metadata.json").read_bytes() == original  # what Megatron wrote, per era
    assert (tmp_path / "out" / TRACKER).read_text() == "10"
    rc, out, _ = _run(capsys, "repair", save / ITER, "--in-place")
    assert rc == 0, out
    assert (save / ITER / "metadata.json").read_bytes() == original
    assert _codes(save) == set()


def test_repair_refuses_metadata_json_of_an_incomplete_save(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    iteration_dir = save / ITER
    (iteration_dir / "metadata.json").unlink()
    (iteration_dir / "__1_0.distcp").unlink()  # rank 1 never wrote its data
    before = file_digests(save)
    rc, out, _ = _run(capsys, "repair", iteration_dir, "--in-place")
    assert rc == 1
    assert "refused [CKD101]" in out and "CKD113" in out and "must stay incomplete" in out
    assert "latest-good" in out
    assert file_digests(save) == before
    rc, out, _ = _run(capsys, "repair", save, "--format", "json")  # from the save dir: nothing passes check
    report = json.loads(out)
    assert rc == 1 and report["latest_good"] is None and not report["actions"]


def test_repair_refuses_metadata_json_of_an_incomplete_zarr_save(capsys, copy_fixture):
    save = copy_fixture("core014_zarr_tp2")
    iteration_dir = save / ITER
    (iteration_dir / "metadata.json").unlink()
    chunk = next(
        p
        for p in sorted((iteration_dir / "decoder.layers.mlp.linear_fc2.weight").iterdir())
        if not p.name.startswith(".")
    )
    chunk.write_bytes(chunk.read_bytes()[:-4])  # a rank died mid-write: one element short
    before = file_digests(save)
    rc, out, _ = _run(capsys, "repair", iteration_dir, "--in-place")
    assert rc == 1 and "refused [CKD101]" in out, out
    assert file_digests(save) == before


def test_repair_quarantines_orphans_and_keeps_integrity(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    iteration_dir = save / ITER
    orphan = iteration_dir / "__7_0.distcp"
    shutil.copy(iteration_dir / "__0_0.distcp", orphan)
    content = orphan.read_bytes()
    assert _run(capsys, "seal", save)[0] == 0  # the orphan is a warning: sealed, and listed
    assert "__7_0.distcp" in json.loads((iteration_dir / "integrity.json").read_text())["files"]
    rc, out, _ = _run(capsys, "repair", save)
    assert rc == 1 and "[CKD115] move 1 unreferenced data file(s) (__7_0.distcp)" in out
    rc, out, _ = _run(capsys, "repair", save, "--in-place")
    assert rc == 0, out
    assert not orphan.exists()
    quarantined = list(save.glob(f"{ITER}.quarantine-*/__7_0.distcp"))
    assert len(quarantined) == 1 and quarantined[0].read_bytes() == content  # moved, never deleted
    assert "__7_0.distcp" not in json.loads((iteration_dir / "integrity.json").read_text())["files"]
    assert _codes(save) == set()
    rc, out, _ = _run(capsys, "latest-good", save, "--iteration-only")  # the quarantine dir is no iteration
    assert rc == 0 and out.strip() == "10"


def test_repair_metadata_json_of_a_sealed_checkpoint(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    assert _run(capsys, "seal", save)[0] == 0
    (save / ITER / "metadata.json").unlink()
    rc, out, _ = _run(capsys, "repair", save / ITER, "--in-place")
    assert rc == 0, out
    assert _codes(save) == set()  # the manifest lists metadata.json with the hash of the file written


def test_repair_delegates_args_to_fix_args(capsys, tmp_path):
    rc, out, _ = _run(capsys, "repair", FIXTURES / "core019_convert_tp4", "--format", "json")
    report = json.loads(out)
    assert rc == 1
    (action,) = report["actions"]
    assert action["kind"] == "fix-args" and "CKD2" in action["fixes"][0]
    assert {c["arg"] for c in action["value"]} >= {"tensor_parallel_num_weight_shards"}
    rc, out, _ = _run(capsys, "repair", FIXTURES / "core019_convert_tp4", "--output", tmp_path / "out")
    assert rc == 0, out
    assert not list((tmp_path / "out" / ITER).glob("*.bak-*"))  # the source is the backup of a new output
    assert not [c for c in _codes(tmp_path / "out") if c.startswith("CKD2")]


def test_repair_usage_and_overlap(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    rc, _, err = _run(capsys, "repair", save, "--write")
    assert rc == 2 and "--write needs -o/--output DIR or --in-place" in err
    (save / ITER / "metadata.json").unlink()
    rc, _, err = _run(capsys, "repair", save, "--output", save / "inside")
    assert rc == 2 and "inside the source" in err
    rc, out, _ = _run(capsys, "repair", FIXTURES / "core019_tp1")
    assert rc == 0 and "nothing to repair" in out


@pytest.mark.parametrize(
    "step",
    [
        "repair:quarantine",
        "atomic:before-replace:metadata.json",
        "repair:metadata-json",
        "atomic:before-replace:integrity.json",
        "repair:tracker-backup",
        "atomic:before-replace:latest_checkpointed_iteration.txt",
    ],
)
def test_repair_in_place_killed_at_every_step(copy_fixture, step):
    """A kill between two steps leaves a checkpoint with no new error; rerunning repair finishes the job."""
    save = copy_fixture("core019_tp2")
    iteration_dir = save / ITER
    shutil.copy(iteration_dir / "__0_0.distcp", iteration_dir / "__7_0.distcp")
    assert main(["seal", str(save)]) == 0
    (iteration_dir / "metadata.json").unlink()
    (save / TRACKER).write_text("99")  # tracker broken too: repair from the iteration dir, then the save dir
    data = {k: v for k, v in file_digests(iteration_dir).items() if k.endswith(".distcp")}
    before = {f.code for f in check_paths([str(iteration_dir)]).findings}
    cmd = [sys.executable, "-m", "ckptdoctor", "repair", "--in-place"]
    target = iteration_dir
    if "tracker" in step or TRACKER in step:  # the iteration dir first (the save dir has no good one yet)
        assert subprocess.run([*cmd, str(iteration_dir)], cwd=REPO, capture_output=True, timeout=120).returncode == 0
        target = save
    result = subprocess.run(
        [*cmd, str(target)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **{FAULT_ENV: step}),
    )
    assert result.returncode == FAULT_EXIT_CODE, result.stderr
    # nothing lost: every data file is in the dir or in the quarantine dir, byte for byte
    moved = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in save.glob(f"{ITER}.quarantine-*/*.distcp")}
    now = {k: v for k, v in file_digests(iteration_dir).items() if k.endswith(".distcp")}
    assert {**now, **moved} == data
    after = check_paths([str(iteration_dir)]).findings
    assert not {f.code for f in after if f.severity == "error"} - before  # no new error
    for part in iteration_dir.glob(".*.ckptdoctor-part-*"):  # CKD151: a temp file check says is safe to delete
        part.unlink()
    for again in (iteration_dir, save):
        result = subprocess.run([*cmd, str(again)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode in (0, 1), result.stderr
    assert _codes(save) == set()


# --- real megatron-core loads repaired checkpoints --------------------------------------------------------


def _probe(iteration_dir: Path) -> dict:
    result = subprocess.run(
        [sys.executable, str(REPO / "tests/mcore_probe.py"), str(iteration_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.mcore
@pytest.mark.parametrize("name", ["core019_tp2", "core016_tp2"])
def test_megatron_loads_repaired_checkpoints(capsys, copy_fixture, name):
    require_mcore()
    save = copy_fixture(name)
    iteration_dir = save / ITER
    original = _probe(FIXTURES / name / ITER)
    shutil.copy(
        iteration_dir / sorted(p.name for p in iteration_dir.glob("*.distcp"))[0], iteration_dir / "__9_0.distcp"
    )
    assert _run(capsys, "seal", save)[0] == 0
    (iteration_dir / "metadata.json").unlink()
    (save / TRACKER).write_text("42")
    assert _run(capsys, "repair", iteration_dir, "--in-place")[0] == 0
    assert _run(capsys, "repair", save, "--in-place")[0] == 0
    assert (save / TRACKER).read_text() == "10"
    repaired = _probe(iteration_dir)
    assert repaired["tensors"] == original["tensors"] and len(repaired["tensors"]) > 5
    assert repaired["common_repr"] == original["common_repr"]
    assert repaired["verify_integrity"] == "ok"  # megatron's own verifier accepts the kept manifest


# --- strip-frozen keeps integrity.json consistent ---------------------------------------------------------


def _sealed_peft(capsys, copy_fixture) -> Path:
    save = copy_fixture("core019_peft_full_tp1")
    assert _run(capsys, "seal", save)[0] == 0
    return save


def _assert_resealed(iteration_dir: Path) -> None:
    manifest = json.loads((iteration_dir / "integrity.json").read_text())
    assert list(manifest["files"]) == sorted(
        p.name for p in iteration_dir.iterdir() if p.is_file() and p.name != "integrity.json"
    )
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((iteration_dir / name).read_bytes()).hexdigest() == digest
    assert check_paths([str(iteration_dir)]).findings == []  # hashes verified (check's default)


def test_strip_frozen_reseals_a_sealed_checkpoint(capsys, copy_fixture, tmp_path):
    save = _sealed_peft(capsys, copy_fixture)
    source = file_digests(save)
    rc, out, _ = _run(
        capsys, "strip-frozen", save, "--preset", "lora", "--output", tmp_path / "out", "--format", "json"
    )
    assert rc == 0, out
    assert json.loads(out)["result"]["resealed"] is True
    assert file_digests(save) == source
    _assert_resealed(tmp_path / "out" / ITER)
    assert _codes(tmp_path / "out") == set()
    rc, out, _ = _run(capsys, "strip-frozen", save, "--preset", "lora", "--in-place")
    assert rc == 0, out
    _assert_resealed(save / ITER)
    # Both outputs are sealed over the same files, and the copied tensor data is byte-identical (the re-pickled
    # common state and .metadata may differ in memo layout between runs: equal content, not equal bytes).
    out_files = json.loads((tmp_path / "out" / ITER / "integrity.json").read_text())["files"]
    in_place_files = json.loads((save / ITER / "integrity.json").read_text())["files"]
    assert set(out_files) == set(in_place_files)
    assert {k: v for k, v in out_files.items() if k.startswith("__")} == {
        k: v for k, v in in_place_files.items() if k.startswith("__")
    }
    backup = next(save.glob(f"{ITER}.bak-*"))
    assert file_digests(backup) == {k[len(ITER) + 1 :]: v for k, v in source.items() if k.startswith(ITER + "/")}


def test_strip_frozen_without_a_manifest_writes_none(capsys, copy_fixture, tmp_path):
    save = copy_fixture("core019_peft_full_tp1")
    rc, out, _ = _run(
        capsys, "strip-frozen", save, "--preset", "lora", "--output", tmp_path / "out", "--format", "json"
    )
    assert rc == 0 and json.loads(out)["result"]["resealed"] is False
    assert not (tmp_path / "out" / ITER / "integrity.json").exists()


def test_strip_frozen_refuses_a_source_that_fails_its_manifest(capsys, copy_fixture, tmp_path):
    """A changed source byte must not be re-sealed into a manifest that vouches for it."""
    save = _sealed_peft(capsys, copy_fixture)
    data = sorted((save / ITER).glob("*.distcp"))[0]
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)
        f.seek(data.stat().st_size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    before = file_digests(save)
    rc, _, err = _run(capsys, "strip-frozen", save, "--preset", "lora", "--output", tmp_path / "out")
    assert rc == 2 and f"{data.name}: sha256 differs from integrity.json" in err
    assert not (tmp_path / "out").exists()
    rc, _, err = _run(capsys, "strip-frozen", save, "--preset", "lora", "--in-place")
    assert rc == 2 and "refusing to strip" in err
    assert file_digests(save) == before and not list(save.glob(f"{ITER}.bak-*"))


@pytest.mark.parametrize("step", ["strip-frozen:resealed", "atomic:before-replace:integrity.json"])
def test_strip_frozen_killed_while_resealing_leaves_no_stale_manifest(capsys, copy_fixture, step):
    save = _sealed_peft(capsys, copy_fixture)
    before = file_digests(save)
    result = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "strip-frozen", str(save), "--preset", "lora", "--in-place"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **{FAULT_ENV: step}),
    )
    assert result.returncode == FAULT_EXIT_CODE, result.stderr
    assert file_digests(save / ITER) == {k[len(ITER) + 1 :]: v for k, v in before.items() if k.startswith(ITER + "/")}
    assert {f.code for f in check_paths([str(save)]).findings} == {"CKD151"}  # the unfinished staging dir


@pytest.mark.mcore
def test_megatron_verifier_accepts_a_stripped_sealed_checkpoint(capsys, copy_fixture, tmp_path):
    require_mcore()
    save = _sealed_peft(capsys, copy_fixture)
    assert _megatron_verify(save / ITER) == "ACCEPTED"
    rc, out, _ = _run(capsys, "strip-frozen", save, "--preset", "lora", "--output", tmp_path / "out")
    assert rc == 0, out
    assert _megatron_verify(tmp_path / "out" / ITER) == "ACCEPTED"
    rc, out, _ = _run(capsys, "strip-frozen", save, "--preset", "lora", "--in-place")
    assert rc == 0, out
    assert _megatron_verify(save / ITER) == "ACCEPTED"


# --- repair quarantines leftovers of interrupted ckptdoctor writes (CKD151), leaves CKD150 to the user --------


def _killed(*args, step: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **{FAULT_ENV: step}),
    )
    assert result.returncode == FAULT_EXIT_CODE, result.stderr


def _with_write_leftovers(copy_fixture) -> tuple[Path, list[Path]]:
    """A checkpoint with two CKD151 leftovers made by real killed runs: the unfinished staging dir of a
    strip-frozen --in-place (beside) and the temp file of seal's atomic write (inside)."""
    save = copy_fixture("core019_peft_full_tp1")
    iteration_dir = save / ITER
    _killed("seal", save, step="atomic:before-replace:integrity.json")
    (part,) = iteration_dir.glob(".*.ckptdoctor-part-*")
    part.rename(tmp := save.parent / part.name)  # aside: strip-frozen refuses a checkpoint with a leftover
    _killed("strip-frozen", save, "--preset", "lora", "--in-place", step="strip-frozen:data-written")
    tmp.rename(part)
    left = sorted(save.glob(f".{ITER}.ckptdoctor-swap-*")) + sorted(iteration_dir.glob(".*.ckptdoctor-part-*"))
    assert len(left) == 2
    found = check_paths([str(save)]).findings
    assert {f.code for f in found} == {"CKD151"} and {f.path for f in found} == {str(p) for p in left}
    return save, left


def test_repair_quarantines_write_leftovers(capsys, copy_fixture, tmp_path):
    save, left = _with_write_leftovers(copy_fixture)
    contents = {p.name: file_digests(p) if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest() for p in left}
    rc, out, _ = _run(capsys, "repair", save)
    assert rc == 1 and "[CKD151] move 2 leftover(s) of an interrupted ckptdoctor write" in out
    assert all(p.exists() for p in left)  # report only
    # --output: the source keeps its leftovers, the output has none
    source = file_digests(save)
    rc, out, _ = _run(capsys, "repair", save, "--output", tmp_path / "out")
    assert rc == 0, out
    assert file_digests(save) == source and all(p.exists() for p in left)
    assert _codes(tmp_path / "out") == set()
    assert not list((tmp_path / "out").rglob("*ckptdoctor*"))
    rc, out, _ = _run(capsys, "repair", save, "--in-place", "--format", "json")
    report = json.loads(out)
    assert rc == 0, out
    assert [a["kind"] for a in report["actions"]] == ["quarantine-leftovers"]
    assert not any(p.exists() for p in left)
    (qdir,) = save.glob(f"{ITER}.quarantine-*")
    moved = {
        p.name: file_digests(p) if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest() for p in qdir.iterdir()
    }
    assert moved == contents  # moved, never deleted
    assert _codes(save) == set()
    rc, out, _ = _run(capsys, "strip-frozen", save, "--preset", "lora", "--in-place")  # no longer blocked
    assert rc == 0, out


def test_repair_leftover_listed_in_the_manifest_is_unlisted_first(capsys, copy_fixture, tmp_path):
    save = copy_fixture("core019_tp1")
    iteration_dir = save / ITER
    part = iteration_dir / ".common.pt.ckptdoctor-part-0123abcd"
    part.write_bytes(b"half")
    manifest = {
        "algorithm": "sha256",
        "files": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(iteration_dir.iterdir()) if p.is_file()
        },
    }
    (iteration_dir / "integrity.json").write_text(json.dumps(manifest, indent=2))  # as megatron would list it
    assert _codes(save) == {"CKD151"}
    rc, out, _ = _run(capsys, "repair", save, "--output", tmp_path / "out")
    assert rc == 0, out  # not carried over, and unlisted from the output's manifest
    assert _codes(tmp_path / "out") == set() and not (tmp_path / "out" / ITER / part.name).exists()
    rc, out, _ = _run(capsys, "repair", save, "--in-place")
    assert rc == 0, out
    assert part.name not in json.loads((iteration_dir / "integrity.json").read_text())["files"]
    assert len(list(save.glob(f"{ITER}.quarantine-*/{part.name}"))) == 1
    assert len(list(save.glob(f"{ITER}.quarantine-*/integrity.json.bak-*"))) == 1
    assert _codes(save) == set()


def test_repair_leaves_an_interrupted_write_to_the_user(capsys, copy_fixture):
    """CKD150 (the original displaced or partly rewritten): report only, with check's restore commands."""
    save = copy_fixture("core019_tp1")
    iteration_dir = save / ITER
    shutil.copy(iteration_dir / "__0_0.distcp", iteration_dir / "__7_0.distcp")  # CKD115, repairable alone
    _killed("fix-args", save, "--in-place", "--set", "seq_length=77", step="journal")
    (journal,) = iteration_dir.glob(".ckptdoctor-fixargs-*.json")
    (restore,) = [f.message for f in check_paths([str(save)]).findings if f.code == "CKD150"]
    restore = restore.split("restore the original: ", 1)[1]
    before = file_digests(save)
    rc, out, _ = _run(capsys, "repair", save)
    out = squash(out)  # wrapped to the width: the phrases whatever the tmp path's length
    assert rc == 1 and "refused [CKD150]" in out and squash(restore) in out and "then run repair again" in out
    assert "refused [CKD115]" in out and "repairs" not in out
    rc, out, _ = _run(capsys, "repair", save, "--in-place")
    assert rc == 1 and "nothing to write" in out
    assert file_digests(save) == before and journal.exists() and not list(save.glob(f"{ITER}.quarantine-*"))
    subprocess.run(["bash", "-c", restore], check=True)  # the user restores, then repair does the rest
    rc, out, _ = _run(capsys, "repair", save, "--in-place")
    assert rc == 0, out
    assert _codes(save) == set()


def test_repair_does_not_point_the_tracker_away_from_a_displaced_iteration(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    shutil.copytree(save / ITER, save / "iter_0000005")
    stamp = "20250101T000000"
    # strip-frozen --in-place killed between its two renames (no renameat2 exchange): the original renamed to
    # its backup name, the staging dir (named with the original's inode) not yet renamed into place
    inode = os.lstat(save / ITER).st_ino
    (save / f".{ITER}.ckptdoctor-swap-{inode}-{stamp}-0123abcd").mkdir()
    (save / ITER).rename(save / f"{ITER}.bak-{stamp}")
    assert "CKD150" in _codes(save)
    rc, out, _ = _run(capsys, "repair", save, "--in-place")
    assert rc == 1 and "refused [CKD150]" in out and "the tracker is not changed" in out
    assert (save / TRACKER).read_text() == "10"


@pytest.mark.parametrize("step", ["atomic:before-replace:integrity.json", "repair:quarantine-leftover"])
def test_repair_quarantining_leftovers_killed_at_every_step(copy_fixture, step):
    """The kill harness for the CKD151 moves: every leftover stays in place or in the quarantine dir, the
    checkpoint gets no new error, and a rerun finishes the job."""
    save = copy_fixture("core019_tp2")
    iteration_dir = save / ITER
    (iteration_dir / ".common.pt.ckptdoctor-part-0123abcd").write_bytes(b"half")
    staging = save / f".{ITER}.ckptdoctor-tmp-20250101T000000-0123abcd"
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"unfinished")
    manifest = {
        "algorithm": "sha256",
        "files": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(iteration_dir.iterdir()) if p.is_file()
        },
    }
    (iteration_dir / "integrity.json").write_text(json.dumps(manifest, indent=2))  # the temp file listed too
    everything = {**file_digests(save)}
    assert _codes(save) == {"CKD151"}
    cmd = [sys.executable, "-m", "ckptdoctor", "repair", str(save), "--in-place"]
    result = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ, **{FAULT_ENV: step})
    )
    assert result.returncode == FAULT_EXIT_CODE, result.stderr
    now = file_digests(save)
    for name, digest in everything.items():  # every file is where it was or in the quarantine dir
        if name == f"{ITER}/integrity.json":
            continue
        inside = name.split("/", 1)[1] if name.startswith(ITER + "/") else name  # as named in the quarantine
        moved = [now[k] for k in now if k.startswith(f"{ITER}.quarantine-") and k.split("/", 1)[1] == inside]
        assert now.get(name) == digest or moved == [digest], name
    assert not {f.code for f in check_paths([str(save)]).findings if f.severity == "error"}  # no new error
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _codes(save) == set()
    assert len(list(save.glob(f"{ITER}.quarantine-*/.common.pt.ckptdoctor-part-0123abcd"))) == 1
    assert len(list(save.glob(f"{ITER}.quarantine-*/.{ITER}.ckptdoctor-tmp-*/__0_0.distcp"))) == 1


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_repair_moves_a_tracker_that_is_not_a_file_aside(capsys, copy_fixture, kind):
    """A FIFO or a dir in the tracker's place is kept under the backup name, never replaced or deleted."""
    save = copy_fixture("core019_tp1")
    tracker = save / TRACKER
    tracker.unlink()
    if kind == "fifo":
        os.mkfifo(tracker)
    else:
        tracker.mkdir()
        (tracker / "note").write_text("keep me")
    rc, out, _ = _run(capsys, "repair", save, "--in-place")
    assert rc == 0, out
    assert tracker.read_text() == "10"
    (backup,) = save.glob(f"{TRACKER}.bak-*")
    assert backup.is_fifo() if kind == "fifo" else (backup / "note").read_text() == "keep me"
    assert _codes(save) == set()
