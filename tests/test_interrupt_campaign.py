"""Regressions found by the randomized interrupt campaign (SIGKILL / SIGINT / SIGTERM at random instants of
every write command, in place and with --output): each reproduced deterministically at a fault point.
Fast: no torch or megatron-core is needed (the children run the CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, run_ckptdoctor

from ckptdoctor.atomic import FAULT_ENV, FAULT_EXIT_CODE, FAULT_MODE_ENV, link_or_copy
from ckptdoctor.errors import CkptError
from ckptdoctor.ops.check import check_paths


def _fault_env(step: str, mode: str = "exit") -> dict:
    return dict(os.environ, **{FAULT_ENV: step, FAULT_MODE_ENV: mode})


def _leftovers(path: Path) -> list[str]:
    return sorted(Path(f.path).name for f in check_paths([str(path)]).findings if f.code == "CKD151")


def test_check_of_an_output_save_dir_names_the_staging_dir_of_an_interrupted_write(copy_fixture, tmp_path):
    """A killed ``strip-frozen --output`` leaves its staging dir beside the output; the rerun succeeds and does
    not touch it. ``check`` on the output save dir must name it (it only did when the output was missing or
    when the parent dir was checked), or the unfinished copy stays behind unreported."""
    save = copy_fixture("core019_peft_full_tp1")
    out = tmp_path / "out"
    killed = run_ckptdoctor("strip-frozen", save, "--output", out, env=_fault_env("strip-frozen:data-written"))
    assert killed.returncode == FAULT_EXIT_CODE, killed.stderr
    staging = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.ckptdoctor-tmp-")]
    assert len(staging) == 1
    assert _leftovers(out) == staging  # the output is missing: reported (as before)

    rerun = run_ckptdoctor("strip-frozen", save, "--output", out)
    assert rerun.returncode == 0, rerun.stderr
    assert _leftovers(out) == staging  # the output exists now: still reported, with its rm command
    assert _leftovers(out / "iter_0000010") == []  # an iteration dir's own leftovers are its siblings only
    assert _leftovers(tmp_path) == staging  # once, however it is reached


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_after_the_package_is_imported_and_before_the_cli_exits_130_with_one_line():
    """``python -m ckptdoctor``: runpy imports the package, then runs __main__.py, which imports ckptdoctor.cli.
    A Ctrl-C landing in between (after the package, before ckptdoctor.cli installed its handler) was a
    KeyboardInterrupt traceback (campaign: 3 of 40 SIGINTs at random instants of fix-args). The package
    itself now defers it, as ckptdoctor.cli does for its own imports. Simulated at that exact point: argv as
    the interpreter sets it while runpy locates the module."""
    main_py = REPO / "ckptdoctor" / "__main__.py"
    code = (
        "import os, runpy, signal, sys\n"
        f"sys.orig_argv = [sys.executable, '-m', 'ckptdoctor', 'inspect', {str(FIXTURES / 'core019_tp1')!r}]\n"
        f"sys.argv = ['-m', 'inspect', {str(FIXTURES / 'core019_tp1')!r}]\n"
        "import ckptdoctor\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"  # handled at the next bytecode: before ckptdoctor.cli exists
        f"sys.argv[0] = {str(main_py)!r}\n"
        "runpy.run_module('ckptdoctor', run_name='__main__', alter_sys=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 130, result.stderr
    assert result.stderr == "ckptdoctor: interrupted\n" and result.stdout == ""


def test_importing_the_package_as_a_library_leaves_sigint_alone():
    code = (
        "import signal, sys\nimport ckptdoctor\nassert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    other = "import sys\nsys.argv[0] = '-m'\nsys.orig_argv = [sys.executable, '-m', 'otherpkg']\n" + code
    result = subprocess.run([sys.executable, "-c", other], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_fix_args_output_force_after_a_killed_run_finishes_the_output(copy_fixture, tmp_path):
    """A killed ``fix-args --write --output OUT`` leaves OUT half written (links, a new data file, no
    metadata.json); the rerun refuses it and says to use --force. With --force it failed:
    ``__0_0.distcp: cannot copy to OUT/.../__0_0.distcp (None)`` (the link existed: copy2 onto itself)."""
    save = copy_fixture("core019_convert_tp4")
    out = tmp_path / "out"
    killed = run_ckptdoctor("fix-args", save, "--output", out, env=_fault_env("write:.metadata"))
    assert killed.returncode == FAULT_EXIT_CODE, killed.stderr
    assert (out / "iter_0000010" / "__0_0.distcp").exists() and not (out / "iter_0000010" / "metadata.json").exists()
    refused = run_ckptdoctor("fix-args", save, "--output", out)
    assert refused.returncode == 2 and "use --force" in refused.stderr
    rerun = run_ckptdoctor("fix-args", save, "--output", out, "--force")
    assert rerun.returncode == 0, rerun.stderr
    report = check_paths([str(out)])
    assert report.counts["error"] == 0, report.findings
    # at most the killed run's own unreferenced data file (CKD115, with its repair command)
    assert {f.code for f in report.findings} <= {"CKD115"}


def test_link_or_copy_never_writes_into_an_existing_file(tmp_path):
    src, other = tmp_path / "src", tmp_path / "other"
    src.write_bytes(b"new")
    other.write_bytes(b"someone else's bytes")
    dst = tmp_path / "dst"
    os.link(other, dst)  # dst shares its inode with a file elsewhere
    with pytest.raises(CkptError, match="exists"):
        link_or_copy(src, dst)
    assert dst.read_bytes() == other.read_bytes() == b"someone else's bytes"
    assert link_or_copy(src, dst, replace=True) == "linked"
    assert dst.read_bytes() == b"new" and other.read_bytes() == b"someone else's bytes"
    assert os.path.samefile(src, dst)
    assert link_or_copy(src, dst, replace=True) == "linked"  # already src itself: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "other", "src"]  # no temp file left


@pytest.mark.parametrize("mode", ["--in-place", "--output"])
def test_fix_args_rerun_after_a_kill_before_the_journal_is_removed_refuses(copy_fixture, tmp_path, mode):
    """Killed after its last file was replaced, before its journal was removed: the args read consistent, so the
    same command run again found nothing to change and exited 0, while check kept reporting CKD150 (whose
    restore steps undo that run). Like any write on a checkpoint with a leftover, it now refuses with one line."""
    save = copy_fixture("core019_convert_tp4")
    args = ["fix-args", save, "--in-place"]
    killed = run_ckptdoctor(*args, env=_fault_env("write:.metadata"))
    assert killed.returncode == FAULT_EXIT_CODE, killed.stderr
    assert "CKD150" in {f.code for f in check_paths([str(save)]).findings}
    rerun_args = args if mode == "--in-place" else [*args[:2], "--output", tmp_path / "out"]
    rerun = run_ckptdoctor(*rerun_args)
    assert rerun.returncode == 2, rerun.stdout
    assert "an interrupted ckptdoctor write left" in rerun.stderr and rerun.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_edit_rerun_after_a_kill_past_the_swap_names_the_leftover(copy_fixture):
    """edit --in-place killed right after its atomic swap: the edited tree is in place and the original is in the
    swap dir (CKD150). The same edit run again said ``the edit matches no key; nothing to change, nothing
    written``, as if the edit had completed; it now names the leftover and asks for check's restore steps."""
    save = copy_fixture("core019_tp2")
    args = ["edit", save, "--in-place", "--remove", "_extra_state"]
    killed = run_ckptdoctor(*args, env=_fault_env("edit:after-exchange"))
    assert killed.returncode == FAULT_EXIT_CODE, killed.stderr
    rerun = run_ckptdoctor(*args)
    assert rerun.returncode == 2
    assert "an interrupted ckptdoctor write left" in rerun.stderr and "matches no key" not in rerun.stderr
    assert rerun.stderr.count("\n") == 1


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("mode", ["--in-place", "--output"])
def test_a_signal_right_after_the_staging_dir_is_made_removes_it(copy_fixture, tmp_path, signum, mode):
    """The staging dir was created before the block that removes it on an interrupt, and the source's size was
    summed in between (a walk of every data file): a SIGTERM there (seen once in 140 random trials) left it."""
    save = copy_fixture("core019_tp2")
    args = [str(save), "--drop-section", "optimizer", mode] + ([str(tmp_path / "out")] if mode == "--output" else [])
    child = (
        "import os, signal, sys\n"
        "import ckptdoctor.ops.rewrite.write as key_write\n"
        "real = key_write._dir_bytes\n"
        "def interrupted(path):\n"
        f"    os.kill(os.getpid(), signal.{signum})\n"
        "    return real(path)\n"
        "key_write._dir_bytes = interrupted\n"
        "from ckptdoctor.cli import main\n"
        f"sys.exit(main(['edit', *{args!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == (130 if signum == "SIGINT" else 143), result.stderr
    assert "Traceback" not in result.stderr
    hidden = [p.name for p in [*save.iterdir(), *tmp_path.iterdir()] if p.name.startswith(".")]
    assert hidden == [] and not (tmp_path / "out").exists()


def _answered(child: str, env: dict, mode: str) -> subprocess.CompletedProcess:
    """Run ``child`` (Python code that runs the CLI) and check that the signal the fault point sent (``mode``) was
    answered like any interrupt: exit 130 (SIGINT) or 143 (SIGTERM) and one line."""
    result = subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == (130 if mode == "sigint" else 143), result.stderr
    assert result.stderr == ("ckptdoctor: interrupted\n" if mode == "sigint" else "ckptdoctor: terminated\n")
    return result


@pytest.mark.parametrize("again", [False, True])
def test_an_interrupt_raised_where_python_ignores_exceptions_is_answered(copy_fixture, again):
    """A Ctrl-C handled while a weakref callback ran (an import's module lock has one) raised there, where Python
    prints ``Exception ignored in`` and goes on: strip-frozen --in-place wrote everything and exited 0, and with
    the handlers disarmed by that Ctrl-C a second one was ignored too (campaign: 1 of 270 SIGINTs). Simulated by
    running the fault point's SIGINT from a weakref callback; ``again``: a second SIGINT at a later step."""
    save = copy_fixture("core019_peft_full_tp1")
    before = sorted(p.name for p in save.iterdir())
    child = (
        "import os, sys, weakref\n"
        "from ckptdoctor import atomic\n"
        "real = atomic.fault_point\n"
        "class Dropped: pass\n"
        "def in_a_weakref_callback(step):\n"
        f"    if step != os.environ[{FAULT_ENV!r}]:\n"
        "        return real(step)\n"
        "    obj = Dropped()\n"
        "    ref = weakref.ref(obj, lambda _: real(step))\n"
        "    del obj\n"
        "    atomic.fault_point = real\n"
        f"    if {again!r}: os.environ[{FAULT_ENV!r}] = 'strip-frozen:before-swap'\n"
        "atomic.fault_point = in_a_weakref_callback\n"
        "from ckptdoctor.cli import main\n"
        f"sys.exit(main(['strip-frozen', {str(save)!r}, '--in-place']))\n"
    )
    result = _answered(child, _fault_env("strip-frozen:data-written", "sigint"), "sigint")
    after = sorted(p.name for p in save.iterdir())
    if again:  # stopped at the second one: nothing written
        assert after == before and check_paths([str(save)]).findings == []
    else:  # answered once the write was done: the new tree, its backup beside it
        assert len(after) == len(before) + 1 and "written" in result.stdout


@pytest.mark.parametrize("mode", ["sigint", "sigterm"])
@pytest.mark.parametrize("where", ["--in-place", "--output"])
def test_an_interrupt_python_wraps_in_another_exception_is_answered(copy_fixture, tmp_path, mode, where):
    """A Ctrl-C handled while a class statement ran a ``__set_name__`` (a dataclass field's, as a module imported
    mid-command defines one) reaches the CLI wrapped: Python 3.11 raises ``RuntimeError: Error calling
    __set_name__`` from it. edit --output answered ``internal error: RuntimeError`` (exit 2) instead of
    ``interrupted`` (campaign: 1 of 300 SIGINTs). Simulated by running the fault point from a ``__set_name__``."""
    save = copy_fixture("core019_tp2")
    out = [str(tmp_path / "out")] if where == "--output" else []
    child = (
        "import sys\n"
        "from ckptdoctor import atomic\n"
        "real = atomic.fault_point\n"
        "def in_a_class_statement(step):\n"
        "    class Descriptor:\n"
        "        def __set_name__(self, owner, name):\n"
        "            real(step)\n"
        "    class Owner:\n"
        "        attr = Descriptor()\n"
        "atomic.fault_point = in_a_class_statement\n"
        "from ckptdoctor.cli import main\n"
        f"sys.exit(main(['edit', {str(save)!r}, '--remove', '_extra_state', {where!r}, *{out!r}]))\n"
    )
    _answered(child, _fault_env("edit:data-written", mode), mode)
    assert check_paths([str(save)]).findings == [] and not (tmp_path / "out").exists()
    assert sorted(p.name for p in save.iterdir()) == sorted(p.name for p in (FIXTURES / "core019_tp2").iterdir())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names the descriptor through /proc/self/fd")
@pytest.mark.parametrize("mode", ["sigint", "sigterm"])
def test_an_interrupt_right_after_a_file_is_opened_closes_it_once(copy_fixture, tmp_path, mode):
    """storage.files.open_regular closed its descriptor on any exception, also when one was handled right after
    ``os.fdopen`` returned: the new file object, freed as the exception left, had closed it already, so the close
    failed and ``fix-args --write --output`` answered a SIGTERM during its proof read with ``common.pt: cannot read
    (Bad file descriptor)``, exit 2 (campaign: 1 of 255 SIGTERMs; with threads it could close another file). The
    signal is sent by the fault point while held, and handled once the file object exists (on the stack only)."""
    save, out = copy_fixture("core016_convert_tp4"), tmp_path / "out"
    child = (
        "import os, signal, sys\n"
        "from ckptdoctor import atomic\n"
        "real = os.fdopen\n"
        "held = {signal.SIGINT, signal.SIGTERM}\n"
        "def fdopen_interrupted(fd, *args, **kwargs):\n"
        f"    if os.readlink(f'/proc/self/fd/{{fd}}') != {str(out / 'iter_0000010' / 'common.pt')!r}:\n"
        "        return real(fd, *args, **kwargs)\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, held)\n"
        "    atomic.fault_point('open:common.pt')\n"
        "    return (real(fd, *args, **kwargs), signal.pthread_sigmask(signal.SIG_UNBLOCK, held))[0]\n"
        "os.fdopen = fdopen_interrupted\n"
        "from ckptdoctor.cli import main\n"
        f"sys.exit(main(['fix-args', {str(save)!r}, '--output', {str(out)!r}]))\n"
    )
    _answered(child, _fault_env("open:common.pt", mode), mode)
