"""Write safety (issue #9): every write command killed or interrupted at every step leaves the original
byte-identical or restorable exactly as docs/recovery.md / ``check`` says; one writer at a time; backups are never
overwritten; failures are one-line errors. Fast: no torch or megatron-core is needed (all children run the CLI).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, file_digests, require_exchange, run_ckptdoctor

from ckptdoctor.atomic import FAULT_ENV, FAULT_EXIT_CODE, FAULT_MODE_ENV, FAULT_SLEEP_ENV
from ckptdoctor.cli import main
from ckptdoctor.errors import CkptError
from ckptdoctor.ops.check import check_paths

ITER = "iter_0000010"
LOCK_MESSAGE = "another ckptdoctor command is writing this checkpoint"
REFUSAL = "an interrupted ckptdoctor write left"
LEFTOVER_CODES = ("CKD150", "CKD151")


# --- helpers ---------------------------------------------------------------------------------------------


def _cli(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ckptdoctor ARGS`` in a child process (forked: conftest.run_ckptdoctor), killed or
    interrupted at a fault point by ``env``."""
    return run_ckptdoctor(*args, env=env)


def _fault_env(step: str, mode: str = "exit", **extra: str) -> dict:
    return dict(os.environ, **{FAULT_ENV: step, FAULT_MODE_ENV: mode}, **extra)


def _expected_rc(mode: str) -> int:
    return {"exit": FAULT_EXIT_CODE, "sigint": 130, "sigterm": 143}[mode]  # SIGTERM: a batch scheduler's stop


def _leftover_findings(*paths: Path):
    try:
        report = check_paths([str(p) for p in paths])
    except CkptError:
        return []
    return [f for f in report.findings if f.code in LEFTOVER_CODES]


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _bash(command: str) -> None:
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (command, result.stderr)


def _command(message: str, verb: str) -> str:
    """The shell command a finding gives after ``restore the original:`` / ``restore it:`` / ``delete it:``."""
    match = re.search(rf"{verb}: (.+?)(?:; or |$)", message)
    assert match, message
    return match.group(1)


def _assert_next_writers_refuse(capsys, save: Path) -> None:
    """With a leftover present, both write commands stop with one line before doing anything."""
    for args in (
        ["fix-args", save, "--in-place", "--set", "seq_length=99"],
        ["strip-frozen", save, "--in-place"],
    ):
        before = {p.name for p in save.iterdir()}
        rc, _, err = _run(capsys, *args)
        assert rc == 2 and REFUSAL in err and err.count("\n") == 1, (args, err)
        assert {p.name for p in save.iterdir()} == before


def _readme_restore_block() -> str:
    text = (REPO / "docs" / "recovery.md").read_text(encoding="utf-8")
    section = text.split("## An interrupted ckptdoctor write", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "cd ckpt/iter_0000010\n" in block and re.search(r"^stamp=\S+$", block, re.M)
    return block


def _readme_restore(iteration_dir: Path, stamp: str) -> None:
    """Run the docs' fix-args restore procedure literally (only the dir and the stamp substituted)."""
    block = _readme_restore_block().replace("cd ckpt/iter_0000010\n", f"cd {shlex.quote(str(iteration_dir))}\n")
    block = re.sub(r"^stamp=\S+$", f"stamp={stamp}", block, flags=re.M)
    _bash(block)


def _stamps(iteration_dir: Path) -> set[str]:
    """Run stamps of fix-args --in-place runs: from journals and backups."""
    stamps = {
        m.group(1) for p in iteration_dir.iterdir() if (m := re.match(r"^\.ckptdoctor-fixargs-(.+)\.json$", p.name))
    }
    stamps |= {p.name.split(".bak-", 1)[1] for p in iteration_dir.iterdir() if ".bak-" in p.name}
    return stamps


# --- fix-args --write --in-place: killed / interrupted at every step ------------------------------------------

FIX_IN_PLACE = {
    "core019_tp1": [
        "journal",
        "write:common_state",
        "backup:.metadata",
        "atomic:before-replace:.metadata",
        "write:.metadata",
        "done",
    ],
    "core016_tp1": ["journal", "backup:common.pt", "atomic:before-replace:common.pt", "write:common.pt", "done"],
}


@pytest.mark.parametrize("mode", ["exit", "sigint", "sigterm"])
@pytest.mark.parametrize(
    "case", [(n, s) for n, steps in FIX_IN_PLACE.items() for s in steps], ids=lambda c: f"{c[0]}-{c[1]}"
)
def test_fix_args_in_place_interrupted(capsys, copy_fixture, case, mode):
    name, step = case
    save = copy_fixture(name)
    it = save / ITER
    before = file_digests(it)
    result = _cli("fix-args", save, "--in-place", "--set", "seq_length=77", env=_fault_env(step, mode))
    assert result.returncode == _expected_rc(mode), result.stderr
    assert "Traceback" not in result.stderr
    found = _leftover_findings(save)
    journals = list(it.glob(".ckptdoctor-fixargs-*.json"))
    parts = list(it.glob(".*.ckptdoctor-part-*"))
    reported = {f.path for f in found}
    assert {str(p) for p in journals + parts} <= reported  # every leftover is a check finding
    if mode != "exit":
        assert not journals and not parts  # Ctrl-C (SIGTERM) waits for the few steps: the run completed
        assert ("interrupted" if mode == "sigint" else "terminated") in result.stderr
    if journals:
        (journal_finding,) = [f for f in found if f.path == str(journals[0])]
        assert journal_finding.code == "CKD150" and "restore the original: cd " in journal_finding.message
        if list(it.glob("*.bak-*")):
            assert "ln -f" in journal_finding.message
        _assert_next_writers_refuse(capsys, save)
    stamps = _stamps(it)
    if file_digests(it) != before:
        assert stamps, "the checkpoint changed but nothing says how to restore it"
    for stamp in stamps:
        _readme_restore(it, stamp)  # the docs' procedure (docs/recovery.md), literally, in whatever state the kill left
    for part in parts:
        _bash(_command(next(f.message for f in found if f.path == str(part)), "delete it"))
    assert file_digests(it) == before  # byte-identical, no extra file left


def test_fix_args_in_place_finding_restores_too(copy_fixture):
    """The restore commands in the CKD150 message (computed from the disk) work as well as the docs'."""
    save = copy_fixture("core019_tp1")
    it = save / ITER
    before = file_digests(it)
    result = _cli(
        "fix-args",
        save,
        "--in-place",
        "--set",
        "seq_length=77",
        env=_fault_env("atomic:before-replace:.metadata"),
    )
    assert result.returncode == FAULT_EXIT_CODE
    (finding,) = [f for f in _leftover_findings(it) if f.code == "CKD150"]
    assert ".bak-" in finding.message and "common_state.fixargs-" in finding.message
    _bash(_command(finding.message, "restore the original"))
    for leftover in _leftover_findings(it):  # the temp file of the interrupted .metadata write
        assert leftover.code == "CKD151"
        _bash(_command(leftover.message, "delete it"))
    assert file_digests(it) == before and not _leftover_findings(it)


@pytest.mark.parametrize("name", ["core019_tp1", "core016_tp1"])
def test_readme_restore_after_a_completed_run(capsys, copy_fixture, name):
    save = copy_fixture(name)
    it = save / ITER
    before = file_digests(it)
    rc, out, err = _run(capsys, "fix-args", save, "--in-place", "--set", "seq_length=77")
    assert rc == 0, err
    assert not _leftover_findings(save) and not list(it.glob(".ckptdoctor-*"))
    (stamp,) = _stamps(it)
    _readme_restore(it, stamp)
    assert file_digests(it) == before


# --- fix-args --write --output ------------------------------------------------------------------------------

FIX_OUTPUT = ["links", "write:common_state", "atomic:before-replace:.metadata", "write:.metadata"]


@pytest.mark.parametrize("mode", ["exit", "sigint", "sigterm"])
@pytest.mark.parametrize("step", FIX_OUTPUT)
def test_fix_args_output_interrupted(copy_fixture, tmp_path, step, mode):
    save = copy_fixture("core019_tp1")
    before = file_digests(save)
    out = tmp_path / "out"
    result = _cli("fix-args", save, "--output", out, "--set", "seq_length=77", env=_fault_env(step, mode))
    assert result.returncode == _expected_rc(mode), result.stderr
    assert file_digests(save) == before  # the source is byte-identical (no lock file, no leftover in it)
    assert not _leftover_findings(save)
    if mode != "exit":
        assert not out.exists()  # the half-written output was removed
    else:
        report = check_paths([str(out)])  # the partial output is no checkpoint: check says so
        assert report.counts["error"] >= 1


# --- strip-frozen --in-place ---------------------------------------------------------------------------------

STRIP_IN_PLACE = [
    "strip-frozen:staging-created",
    "strip-frozen:data-written",
    "atomic:before-replace:metadata.json",
    "strip-frozen:before-swap",
    "strip-frozen:before-exchange",
    "strip-frozen:after-exchange",
    "strip-frozen:before-backup-rename",
    "strip-frozen:after-backup-rename",
]
STRIP_NO_BACKUP = [
    "strip-frozen:after-exchange",
    "strip-frozen:before-backup-rename",
    "strip-frozen:after-backup-rename",
    "strip-frozen:before-delete",
]
STRIP_CASES = [(s, False) for s in STRIP_IN_PLACE] + [(s, True) for s in STRIP_NO_BACKUP]
# Reached only after an atomic exchange (the two-rename fallback puts the original straight under its backup name).
NEEDS_EXCHANGE = ("strip-frozen:after-exchange",)
BACKUP_RENAME = ("strip-frozen:before-backup-rename", "strip-frozen:after-backup-rename")


def _assert_strip_in_place_restorable(capsys, save: Path, before: dict[str, str], no_backup: bool) -> None:
    it = save / ITER
    found = _leftover_findings(save)
    hidden = [p for p in save.iterdir() if p.name.startswith(".")]
    assert {str(p) for p in hidden} == {f.path for f in found}  # every leftover is reported, nothing else
    if hidden:
        _assert_next_writers_refuse(capsys, save)
    errors = [f for f in found if f.code == "CKD150"]
    for f in errors:
        _bash(_command(f.message, "restore the original"))
    for f in found:
        if f.code == "CKD151" and Path(f.path).exists():
            _bash(_command(f.message, "delete it"))
    if not errors and file_digests(it) != before:  # completed: the original is the backup (docs/recovery.md table)
        backups = sorted(save.glob(f"{ITER}.bak-*"))
        if no_backup:
            assert not backups  # --no-backup was asked for: the stripped checkpoint is complete
            return
        assert len(backups) == 1
        _bash(
            f"mv {shlex.quote(str(it))} {shlex.quote(str(it))}.stripped && "
            f"mv {shlex.quote(str(backups[0]))} {shlex.quote(str(it))}"
        )
    assert file_digests(it) == before
    assert not [p for p in save.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("mode", ["exit", "sigint", "sigterm"])
@pytest.mark.parametrize("case", STRIP_CASES, ids=lambda c: c[0].split(":")[-1] + ("-no-backup" if c[1] else ""))
def test_strip_in_place_interrupted(capsys, copy_fixture, case, mode):
    step, no_backup = case
    save = copy_fixture("core019_peft_full_tp1")
    if step in NEEDS_EXCHANGE or (step in BACKUP_RENAME and not no_backup):
        require_exchange(save)  # without renameat2 exchange these fault points are never reached
    before = file_digests(save / ITER)
    result = _cli(
        "strip-frozen", save, "--in-place", *(["--no-backup"] if no_backup else []), env=_fault_env(step, mode)
    )
    assert result.returncode == _expected_rc(mode), result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    if mode != "exit" and step in ("strip-frozen:after-exchange", "strip-frozen:before-backup-rename"):
        # Ctrl-C is held back across the swap: the old tree got its backup (or delete) name first
        assert not [p for p in save.iterdir() if ".ckptdoctor-swap-" in p.name]
    _assert_strip_in_place_restorable(capsys, save, before, no_backup)


def test_strip_in_place_old_tree_survives_a_failing_backup_rename(capsys, copy_fixture, monkeypatch):
    """ENOSPC (or any error) renaming the old dir to its backup name after the swap: the original stays,
    the message names it, and check says how to restore it."""
    from ckptdoctor import atomic

    save = copy_fixture("core019_peft_full_tp1")
    before = file_digests(save / ITER)
    real = atomic.rename_noreplace

    def failing(src: Path, dst: Path) -> None:
        if ".bak-" in dst.name:
            raise CkptError(f"{src}: cannot rename to {dst.name} (No space left on device)")
        real(src, dst)

    monkeypatch.setattr(atomic, "rename_noreplace", failing)
    rc, _, err = _run(capsys, "strip-frozen", save, "--in-place")
    assert rc == 2 and err.count("\n") == 1 and "No space left on device" in err, err
    (staging,) = [p for p in save.iterdir() if ".ckptdoctor-swap-" in p.name]
    assert str(staging) in err and file_digests(staging) == before  # the original, complete, named in the message
    monkeypatch.undo()
    _assert_strip_in_place_restorable(capsys, save, before, no_backup=False)


# --- strip-frozen --output --------------------------------------------------------------------------------------

STRIP_OUTPUT = [
    "strip-frozen:staging-created",
    "strip-frozen:data-written",
    "atomic:before-replace:metadata.json",
    "strip-frozen:before-swap",
    "strip-frozen:output-renamed",
]


@pytest.mark.parametrize("mode", ["exit", "sigint", "sigterm"])
@pytest.mark.parametrize("step", STRIP_OUTPUT)
def test_strip_output_interrupted(copy_fixture, tmp_path, step, mode):
    save = copy_fixture("core019_peft_full_tp1")
    before = file_digests(save)
    out = tmp_path / "out"
    result = _cli("strip-frozen", save, "--output", out, env=_fault_env(step, mode))
    assert result.returncode == _expected_rc(mode), result.stderr
    assert file_digests(save) == before
    staging = [p for p in tmp_path.iterdir() if p.name.startswith(".out.ckptdoctor-")]
    if staging:  # killed before the rename: `check OUT` reports the unfinished output and how to remove it
        found = _leftover_findings(out)
        assert [f.path for f in found] == [str(staging[0])] and found[0].code == "CKD151"
        _bash(_command(found[0].message, "delete it"))
    else:
        assert mode != "exit" or step == "strip-frozen:output-renamed"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    if out.exists():
        assert check_paths([str(out)]).counts["error"] == 0


def test_strip_output_force_interrupted_keeps_old_output(copy_fixture, tmp_path):
    save = copy_fixture("core019_peft_full_tp1")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous output")
    result = _cli("strip-frozen", save, "--output", out, "--force", env=_fault_env("strip-frozen:old-output-aside"))
    assert result.returncode == FAULT_EXIT_CODE
    found = {f.code: f for f in _leftover_findings(out)}
    assert sorted(found) == ["CKD150", "CKD151"]  # the previous content (to put back), the new output (to drop)
    _bash(_command(found["CKD150"].message, "restore it"))
    _bash(_command(found["CKD151"].message, "delete it"))
    assert (out / "keep.txt").read_text() == "previous output"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# --- one writer at a time -------------------------------------------------------------------------------------


def _start_paused(args: list, step: str, seconds: float = 3.0) -> subprocess.Popen:
    """A writer that stops at ``step`` (holding its lock) and says so on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptdoctor", *map(str, args)],
        cwd=REPO,
        text=True,
        env=_fault_env(step, "sleep", **{FAULT_SLEEP_ENV: str(seconds)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    line = proc.stderr.readline()
    assert f"fault point {step}" in line, (line, proc.stderr.read())
    return proc


def test_second_writer_fails_at_once_and_first_backup_survives(copy_fixture):
    save = copy_fixture("core019_tp1")
    it = save / ITER
    original = (it / ".metadata").read_bytes()
    first = _start_paused(["fix-args", save, "--in-place", "--set", "seq_length=77"], "backup:.metadata")
    try:
        started = time.monotonic()
        for args in (
            ["fix-args", save, "--in-place", "--set", "seq_length=88"],
            ["fix-args", it, "--in-place", "--set", "seq_length=88"],
            ["strip-frozen", save, "--in-place", "--preset", "lora"],
        ):
            second = _cli(*args)
            assert second.returncode == 2, second.stderr
            assert LOCK_MESSAGE in second.stderr and str(it) in second.stderr
            assert second.stderr.count("\n") == 1
        assert time.monotonic() - started < 2.5  # failed at once, did not wait for the lock (3 s)
    finally:
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    (backup,) = it.glob(".metadata.bak-*")
    assert backup.read_bytes() == original  # the first writer's backup is intact
    assert not _leftover_findings(save)


def test_writers_started_together_never_destroy_a_backup(copy_fixture):
    save = copy_fixture("core019_tp1")
    it = save / ITER
    original = (it / ".metadata").read_bytes()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ckptdoctor",
                "fix-args",
                str(save),
                "--in-place",
                "--set",
                f"seq_length={n}",
            ],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for n in (77, 88)
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    for rc, err in results:
        assert rc == 0 or (rc == 2 and LOCK_MESSAGE in err), err
    backups = sorted(it.glob(".metadata.bak-*"))
    assert len(backups) == sum(rc == 0 for rc, _ in results)  # one per successful run, none overwritten
    assert original in [b.read_bytes() for b in backups]
    assert not _leftover_findings(save)


def test_strip_swap_keeps_the_name_locked(copy_fixture):
    """Paused right after the atomic swap: the name now holds the staging tree, which is locked too."""
    save = copy_fixture("core019_peft_full_tp1")
    require_exchange(save)
    before = file_digests(save / ITER)
    first = _start_paused(["strip-frozen", save, "--in-place"], "strip-frozen:after-exchange")
    try:
        second = _cli("fix-args", save, "--in-place", "--set", "seq_length=88")
        assert second.returncode == 2 and LOCK_MESSAGE in second.stderr, second.stderr
    finally:
        _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    (backup,) = save.glob(f"{ITER}.bak-*")
    assert file_digests(backup) == before
    assert not [p for p in save.iterdir() if p.name.startswith(".")]


def test_sigint_during_the_swap_is_deferred(copy_fixture):
    """A real SIGINT from outside while the swap is in progress: the run finishes the swap and the backup
    rename first, then stops with exit 130."""
    save = copy_fixture("core019_peft_full_tp1")
    require_exchange(save)
    before = file_digests(save / ITER)
    proc = _start_paused(["strip-frozen", save, "--in-place"], "strip-frozen:after-exchange", seconds=2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    (backup,) = save.glob(f"{ITER}.bak-*")
    assert file_digests(backup) == before
    assert not [p for p in save.iterdir() if p.name.startswith(".")]


def test_lock_files_are_not_findings_and_not_copied(capsys, copy_fixture, tmp_path):
    """The fallback lock file (filesystems that cannot flock a dir) is neither a finding nor carried over."""
    save = copy_fixture("core019_tp1")
    (save / f".{ITER}.ckptdoctor.lock").write_text("pid 1\n")
    (save / ITER / ".stale.ckptdoctor.lock").write_text("pid 1\n")
    report = check_paths([str(save)])
    assert not report.findings
    rc, _, err = _run(capsys, "fix-args", save, "--output", tmp_path / "out", "--set", "seq_length=77")
    assert rc == 0, err
    assert not list((tmp_path / "out").rglob("*.lock"))
    rc, _, err = _run(capsys, "fix-args", save, "--in-place", "--set", "seq_length=78")
    assert rc == 0, err


def test_a_symlink_planted_as_the_lock_file_is_not_followed(capsys, copy_fixture, tmp_path, monkeypatch):
    """On a filesystem that cannot flock a dir (the lock file fallback), a save dir from someone else may hold a
    symlink under the lock file's name: following it would create an (empty) file wherever it points. The
    write refuses, names the lock file, and creates nothing."""
    from ckptdoctor import locking

    real_lock_fd = locking._lock_fd

    def no_dir_flock(fd: int, exclusive: bool) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(next(iter(locking._NO_DIR_FLOCK)), "not supported here")
        real_lock_fd(fd, exclusive)

    monkeypatch.setattr(locking, "_lock_fd", no_dir_flock)
    save = copy_fixture("core019_tp1")
    victim = tmp_path / "victim"
    lock = save / f".{ITER}.ckptdoctor.lock"
    lock.symlink_to(victim)
    before = file_digests(save)
    rc, _, err = _run(capsys, "fix-args", save, "--in-place", "--set", "seq_length=78")
    assert rc == 2 and f"{lock}: the lock file is a symlink" in err, err
    assert not victim.exists()
    assert lock.is_symlink() and file_digests(save) == before


# --- failures are one line naming the file, and leave nothing half-done ----------------------------------------


@pytest.mark.parametrize("fail_on", ["common_state", ".metadata", "integrity.json"])
def test_fix_args_in_place_failure_rolls_back(capsys, copy_fixture, monkeypatch, fail_on):
    from ckptdoctor.ops.fix_args import write as fix_args_write

    save = copy_fixture("core019_tp1")
    it = save / ITER
    (it / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": {}}))
    before = file_digests(it)
    real = fix_args_write.write_atomic

    def full_disk(path: Path, data: bytes) -> None:
        if path.name.startswith(fail_on):
            raise CkptError(f"{path}: cannot write (No space left on device)")
        real(path, data)

    monkeypatch.setattr(fix_args_write, "write_atomic", full_disk)
    rc, _, err = _run(capsys, "fix-args", save, "--in-place", "--set", "seq_length=77")
    assert rc == 2 and err.count("\n") == 1 and "No space left on device" in err, err
    assert "nothing was changed" in err and "common_state.fixargs-" in err
    if fail_on != "common_state":
        assert ".metadata.bak-" in err  # the backup it made is named (and removed again)
    assert file_digests(it) == before  # no orphan data file, no backup, no journal
    assert not _leftover_findings(save)


def test_symlinked_iteration_dir_no_backup_is_refused(capsys, copy_fixture, tmp_path):
    save = copy_fixture("core019_peft_full_tp1")
    real = tmp_path / "real_iter"
    (save / ITER).rename(real)
    (save / ITER).symlink_to(real)
    before = file_digests(real)
    rc, _, err = _run(capsys, "strip-frozen", save, "--in-place", "--no-backup")
    assert rc == 2 and err.count("\n") == 1 and "symbolic link" in err and str(save / ITER) in err, err
    assert "internal error" not in err
    assert (save / ITER).is_symlink() and file_digests(real) == before
    assert sorted(p.name for p in save.iterdir()) == [ITER, "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("command", [["fix-args", "--set", "seq_length=77"], ["strip-frozen"]])
def test_output_under_a_file_is_one_line(capsys, copy_fixture, tmp_path, command):
    name = "core019_tp1" if command[0] == "fix-args" else "core019_peft_full_tp1"
    save = copy_fixture(name)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    rc, _, err = _run(capsys, command[0], save, *command[1:], "--output", blocker / "out")
    assert rc == 2 and err.count("\n") == 1 and str(blocker) in err and "internal error" not in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
@pytest.mark.parametrize("command", [["fix-args", "--set", "seq_length=77"], ["strip-frozen"]])
def test_unwritable_output_parent_is_one_line(capsys, copy_fixture, tmp_path, command):
    name = "core019_tp1" if command[0] == "fix-args" else "core019_peft_full_tp1"
    save = copy_fixture(name)
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        rc, _, err = _run(capsys, command[0], save, *command[1:], "--output", parent / "out")
    finally:
        parent.chmod(0o755)
    assert rc == 2 and err.count("\n") == 1 and str(parent) in err and "internal error" not in err, err


@pytest.mark.parametrize("command", [["fix-args", "--set", "seq_length=77"], ["strip-frozen"]])
def test_permission_error_creating_the_output_is_one_line(capsys, copy_fixture, tmp_path, monkeypatch, command):
    """PermissionError from mkdir (what a non-root user gets in a read-only dir) names the path, exit 2."""
    name = "core019_tp1" if command[0] == "fix-args" else "core019_peft_full_tp1"
    save = copy_fixture(name)
    parent = tmp_path / "ro"
    parent.mkdir()
    real_mkdir = os.mkdir

    def denied(path, *args, **kwargs):
        if str(path).startswith(str(parent)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", denied)
    rc, _, err = _run(capsys, command[0], save, *command[1:], "--output", parent / "out")
    assert rc == 2 and err.count("\n") == 1 and "Permission denied" in err and str(parent) in err, err
    assert "internal error" not in err and list(parent.iterdir()) == []


@pytest.mark.parametrize("where", ["save", "iter", "inside"])
def test_fix_args_output_in_the_source_is_refused(capsys, copy_fixture, where):
    save = copy_fixture("core019_tp1")
    before = file_digests(save)
    output = {"save": save, "iter": save / ITER, "inside": save / ITER / "out"}[where]
    rc, _, err = _run(capsys, "fix-args", save, "--output", output, "--force", "--set", "seq_length=77")
    assert rc == 2 and err.count("\n") == 1 and "source checkpoint" in err, err
    assert file_digests(save) == before and not (save / ITER / "out").exists()


def test_leftover_check_finding_and_refusal(capsys, copy_fixture):
    """A kill right after the swap: check names the displaced original (CKD150, exit 1) and the exact commands;
    the next writer refuses with one line until it is resolved; afterwards writing works again."""
    save = copy_fixture("core019_peft_full_tp1")
    require_exchange(save)
    before = file_digests(save / ITER)
    result = _cli("strip-frozen", save, "--in-place", env=_fault_env("strip-frozen:after-exchange"))
    assert result.returncode == FAULT_EXIT_CODE
    rc, out, _ = _run(capsys, "check", save)
    assert rc == 1 and "CKD150" in out and "holds the original" in out and "mv " in out
    rc, out, _ = _run(capsys, "rules", "CKD150")
    assert rc == 0 and "interrupted-write" in out
    _assert_next_writers_refuse(capsys, save)
    (finding,) = _leftover_findings(save)
    _bash(_command(finding.message, "restore the original"))
    assert file_digests(save / ITER) == before
    rc, _, err = _run(capsys, "strip-frozen", save, "--in-place")  # resolved: the next run goes ahead
    assert rc == 0, err


def test_an_interrupted_copy_fallback_is_removed_and_the_interrupt_goes_on(tmp_path, monkeypatch):
    """Where hard links fail (another filesystem), a backup or a linked file is copied: a Ctrl-C in the middle
    removes the partial copy and reaches the caller (it was swallowed: the caller went on without the file)."""
    import errno as errno_module

    from ckptdoctor import atomic

    src = tmp_path / "src.distcp"
    src.write_bytes(b"x" * 1000)

    def no_link(a, b):
        raise OSError(errno_module.EXDEV, "Invalid cross-device link")

    def interrupted(inp, out, length=0):
        out.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "link", no_link)
    monkeypatch.setattr(atomic.shutil, "copyfileobj", interrupted)
    calls = (
        lambda: atomic.link_or_copy(src, tmp_path / "copy.distcp"),
        lambda: atomic.backup_file(src, "20990101T000000"),
    )
    for call in calls:
        with pytest.raises(KeyboardInterrupt):
            call()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src.distcp"]


def test_a_symlinked_data_file_is_linked_as_its_target_not_as_the_symlink(copy_fixture, tmp_path):
    """A data file that is a relative symlink (shared storage, a deduplicated save) was hard-linked as the symlink
    itself: from an output dir at another depth it dangled, and the output was no checkpoint."""
    save = copy_fixture("core019_tp1")
    data = next((save / "iter_0000010").glob("*.distcp"))
    shared = save.parent / "shared.distcp"
    data.rename(shared)
    data.symlink_to(os.path.relpath(shared, data.parent))
    out = tmp_path / "deeper" / "out"
    proc = run_ckptdoctor("edit", str(save), "--rename", "final", "FINAL", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    written = out / "iter_0000010" / data.name
    assert not written.is_symlink() and written.read_bytes() == shared.read_bytes()
    assert run_ckptdoctor("check", str(out)).returncode == 0


def test_remove_tree_without_recursion_or_path_limits(tmp_path):
    """tree_removal.remove_tree: a dir nested past the recursion limit and past PATH_MAX goes; a symlink inside is
    removed, not followed (what it names stays)."""
    from ckptdoctor.tree_removal import remove_tree

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("kept")
    root = tmp_path / "tree"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    depth = max(sys.getrecursionlimit() + 100, 2100)  # 2-byte names: ~4,200 bytes of path, past PATH_MAX
    try:
        for level in range(depth):
            os.mkdir("aa", dir_fd=fd)
            inner = os.open("aa", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
            if level % 500 == 0:
                os.symlink(str(outside), "link", dir_fd=fd)
                with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
                    f.write("x")
    finally:
        os.close(fd)
    try:
        remove_tree(root)
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)  # a failed run leaves no tree for pytest's rmtree
    assert not root.exists() and (outside / "keep").read_text() == "kept"
    remove_tree(tmp_path / "missing", ignore_errors=True)
    with pytest.raises(FileNotFoundError):
        remove_tree(tmp_path / "missing")
