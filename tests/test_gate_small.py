"""Refusals before any work: a stranger's oversized file is refused on its size before a byte of it is read, and a
Ctrl-C in the first moments of a command (while the interpreter imports the CLI) exits 130 with one line."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, run_ckptdoctor

ITER = "iter_0000010"
HUGE = 2 << 30  # sparse: costs no disk
# Address space a child may add to what it inherits: far below the 1 GiB a read up to the pickle limit takes.
HEADROOM = 256 << 20

# --- 1. an oversized file is refused on its size, before it is read --------------------------------------------


def _enlarge(path: Path, size: int = HUGE) -> None:
    """``path`` keeps its real bytes at its start and grows to ``size`` (a hole: no disk, reads as zeros)."""
    with open(path, "r+b") as f:
        f.truncate(size)


def test_a_2gb_metadata_is_refused_on_its_size_before_it_is_read(copy_fixture):
    """A 2 GB (sparse) ``.metadata`` was read 1 GiB + 1 bytes into memory (up to the pickle limit) before being
    refused on its size, which fstat gives before any read: under a 256 MiB address-space limit that read was a
    MemoryError. Now refused with nothing read, in the message of the pickle limit, which names the file's real
    size (it named the 1 GiB + 1 read) and the limit."""
    save = copy_fixture("core019_tp2")
    metadata = save / ITER / ".metadata"
    _enlarge(metadata)
    refusal = f"pickle of {HUGE} bytes exceeds the limit of {1 << 30} bytes (raise it with --max-pickle-bytes)"

    inspect = run_ckptdoctor("inspect", save, memory_headroom=HEADROOM)
    assert inspect.returncode == 2 and inspect.stdout == "", inspect.stderr
    assert inspect.stderr == f"ckptdoctor: error: {metadata}: {refusal}\n"

    check = run_ckptdoctor("check", save, memory_headroom=HEADROOM)
    assert check.returncode == 1 and check.stderr == "", check.stderr
    assert f"{metadata}: CKD403 [error] DCP metadata: {refusal}" in check.stdout.splitlines()

    lower = run_ckptdoctor("--max-pickle-bytes", "1MiB", "inspect", save, memory_headroom=HEADROOM)  # the limit set
    assert lower.returncode == 2 and f"pickle of {HUGE} bytes exceeds the limit of {1 << 20} bytes" in lower.stderr


def test_an_oversized_common_pt_is_refused_on_its_size_before_it_is_read(copy_fixture):
    """``common.pt`` had the same read-then-refuse (read up to the pickle limit, then refused)."""
    save = copy_fixture("core016_tp1")  # common state in common.pt
    common = save / ITER / "common.pt"
    _enlarge(common)
    proc = run_ckptdoctor("inspect", save, memory_headroom=HEADROOM)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == (
        f"ckptdoctor: error: {common}: larger than the limit of {1 << 30} bytes (raise it with --max-pickle-bytes)\n"
    )


class _RemoteLike(io.RawIOBase):
    """A file the way storage.remote.RemoteFile is one: no descriptor, the size it was listed with."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def fileno(self) -> int:
        raise io.UnsupportedOperation("no file descriptor")

    def readinto(self, buffer: object) -> int:
        raise AssertionError("read")


def test_every_capped_reader_refuses_on_the_size_before_reading(tmp_path):
    """The readers of the other files a command reads whole (``metadata.json`` and ``integrity.json``: 64 MiB,
    ``run_config.yaml``: 16 MiB, ``train_state.pt``: 1 MiB, and a remote file's) read up to their cap before the cap
    refused the file. They refuse on the size now, nothing read (the file's position is where it was), each with the
    message it had."""
    from ckptdoctor.errors import CkptError
    from ckptdoctor.formats import run_config, train_state
    from ckptdoctor.storage import files

    path = tmp_path / "big"
    path.write_bytes(b"{}")
    _enlarge(path)
    for reader in (files.read_capped, files.read_releasable):
        with open(path, "rb", buffering=0) as f:
            with pytest.raises(files.TooLarge) as refused:
                reader(f, 1 << 20)
            assert (refused.value.size, refused.value.max_bytes, f.tell()) == (HUGE, 1 << 20, 0)
        with pytest.raises(files.TooLarge):
            reader(_RemoteLike(HUGE), 1 << 20)

    it = tmp_path / ITER
    it.mkdir()
    for name in ("metadata.json", "integrity.json"):
        (it / name).write_text("{}")
        _enlarge(it / name)
        with pytest.raises(json.JSONDecodeError, match=f"larger than {files.MAX_JSON_BYTES} bytes"):
            files.read_json(it / name)
    (it / "run_config.yaml").write_text("model:\n")
    _enlarge(it / "run_config.yaml")
    with pytest.raises(CkptError, match=f"run_config.yaml: larger than {run_config.MAX_RUN_CONFIG_BYTES} bytes"):
        run_config.read_run_config(it)
    state = it / "train_state.pt"
    state.write_bytes((FIXTURES / "bridge_train_state" / "train_state_step10.pt").read_bytes())
    _enlarge(state)
    cap = train_state.MAX_TRAIN_STATE_BYTES
    with pytest.raises(CkptError, match=f"train_state.pt: larger than {cap} bytes: not a train state file"):
        train_state.read_train_state_step(state)
    with pytest.raises(CkptError, match=f"train_state.pt: larger than {cap} bytes; not read"):
        train_state.read_train_state_bytes(state)


# --- 2. a Ctrl-C while the CLI starts ----------------------------------------------------------------------------

CHECK = ("check", str(FIXTURES / "core019_tp2"))
INTERRUPTED = "ckptdoctor: interrupted\n"
CONSOLE_SCRIPT = Path(sys.executable).parent / "ckptdoctor"
ENTRY_POINTS = {
    "console script": [str(CONSOLE_SCRIPT)],
    "python -m ckptdoctor": [sys.executable, "-m", "ckptdoctor"],
}
DELAYS = [1.5 * (i / 29) ** 2 for i in range(30)]  # 0 to 1.5 s, denser at the start (0, 2 ms, 7 ms, 16 ms, ...)
PACKAGE = REPO / "ckptdoctor"


_DROPPED_BY_THE_INTERPRETER = (
    "Failed checking if argv[0] is an import path entry\n",
    "Exception ignored in: <function _get_module_lock.<locals>.cb",
    "Error processing line ",
)


def _outcome(proc: subprocess.Popen, out: str, err: str, complete: str) -> str | None:
    """How one interrupted run ended, where that is an answer to the signal; None where it is a failure."""
    if proc.returncode == 130 and err == INTERRUPTED and out in ("", complete):
        return "130"
    if proc.returncode == 0 and out == complete and err == "":
        return "finished before the signal"
    if proc.returncode == -signal.SIGINT and out == err == "":
        # before the interpreter installed its handler: killed by the signal, as Ctrl-C kills a C program (a shell
        # shows 130 too); nothing of Python or ours has run
        return "killed before Python's handler"
    ours = {f for f in re.findall(r'File "([^"]+)"', err) if Path(f).is_relative_to(PACKAGE)}
    if (
        proc.returncode == 0
        and out == complete
        and "KeyboardInterrupt" in err
        and not ours
        and err.startswith(_DROPPED_BY_THE_INTERPRETER)
    ):
        # hit in the interpreter's start or in its import system before the package armed its deferral, where CPython
        # prints the error, drops it and runs the command to its end; nothing of the package had run. Seen in CI:
        # - "Failed checking if argv[0] is an import path entry": zipimport asked whether argv[0] (the console script)
        #   is an archive (Modules/main.c, pymain_get_importer);
        # - "Exception ignored in: <function _get_module_lock.<locals>.cb": a weakref callback of the import system
        #   (a module lock's, as an import finishes), 7 ms after spawn;
        # - "Error processing line 1 of .../__editable__.ckptdoctor-0.1.0.pth": site ran the editable install's .pth
        #   line (a KeyboardInterrupt in a class body's __set_name__ becomes a RuntimeError, which site reports as
        #   "Remainder of file ignored" and goes on), 16 ms after spawn
        return "dropped by the interpreter's start, then run"
    if err.rstrip().endswith("KeyboardInterrupt") and out == "" and ours <= {str(PACKAGE / "__init__.py")}:
        # before the package armed its deferral: in the interpreter's own start (site and the .pth files of
        # site-packages, runpy or the console script finding the package), out of the package's reach (a
        # KeyboardInterrupt in site is "Fatal Python error: init_import_site", exit 1), or in the few statements of
        # the package's __init__ before it arms (microseconds: they import nothing, see the test below)
        return "before the deferral was armed"
    return None


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_sigint_at_any_moment_of_a_fresh_check_exits_130_with_one_line(entry):
    """SIGINT to a fresh ``ckptdoctor check`` at 30 delays from 0 to 1.5 s after it was spawned: each run ends with
    exit 130 and one line, or had finished before the signal came (its whole output), or was hit before anything of
    this package ran (see :func:`_outcome`). Never a traceback through our code, never exit 1 (``check``'s
    findings) for an interrupt."""
    argv = [*ENTRY_POINTS[entry], *CHECK]
    if entry == "console script" and not CONSOLE_SCRIPT.exists():
        pytest.skip(f"no console script at {CONSOLE_SCRIPT} (not installed into this interpreter's environment)")
    whole = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0 and whole.stderr == "", whole.stderr
    seen: dict[str, int] = {}
    for delay in DELAYS:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            proc.wait(timeout=delay)  # (its output is a line or two: no pipe fills)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        outcome = _outcome(proc, out, err, whole.stdout)
        assert outcome is not None, f"SIGINT {delay * 1000:.0f} ms after spawn: exit {proc.returncode}\n{err}"
        seen[outcome] = seen.get(outcome, 0) + 1
    assert seen.get("130", 0) >= 1, seen  # the signal met the command running: the test tested something


def test_the_package_arms_its_deferral_before_it_imports_anything():
    """What runs of the package before its deferral is armed is a few statements: importing ``signal`` there (the
    enum module with it, where nothing had imported it yet) kept the Python handler for 1 to 7 ms of each start, in
    which a Ctrl-C was a KeyboardInterrupt traceback. Every import after the package's own must find it armed."""
    code = (
        "import _signal, json, sys\n"
        "found = []\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        found.append((name, _signal.getsignal(2) is _signal.default_int_handler))\n"
        "sys.meta_path.insert(0, Spy())\n"
        f"sys.argv = [{str(CONSOLE_SCRIPT)!r}, 'check']\n"  # the console script's argv
        "import ckptdoctor.cli\n"
        "print(json.dumps(found))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found[0] == ["ckptdoctor", True] and len(found) > 10, found  # the package itself, then what the CLI needs
    assert [name for name, unarmed in found[1:] if unarmed] == [], found


# Line by line instead of by the clock: a helper interpreter imports what is not ckptdoctor's (click, runpy), then
# forks a child per trial; the child runs the CLI as its entry point does (the console script's code, or runpy as
# ``python -m`` does), with a trace function that sends SIGINT to itself at the n-th line of ours it reaches once
# the package's __init__ has run (its first statements, which arm the deferral, are what runs before that is
# possible). The lines counted are those of the CLI's start and end (the functions of cli.py, __main__.py and
# commands/__init__.py, and the first line of each module's body), where the process changes its handlers.
_LINE_HARNESS = r"""
import dis, io, json, os, runpy, sys, tempfile, traceback
import click, click.shell_completion  # not ours: loaded once, before the forks

MODE, SCRIPT, PKG = sys.argv[1], sys.argv[2], sys.argv[3]
ARGS = sys.argv[4:]
INIT = os.path.join(PKG, "__init__.py")
COUNTED = {os.path.join(PKG, "cli.py"), os.path.join(PKG, "__main__.py"), os.path.join(PKG, "commands", "__init__.py")}
NOP = dis.opmap["NOP"]


def child(n, at_fd):
    state = {"count": 0, "started": False, "modules": set()}

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call":
            return tracer if name.startswith(PKG) else None
        if event != "line":
            return tracer
        if not state["started"]:
            if name == INIT:
                return tracer
            state["started"] = True
        # a line that starts with a NOP (a `try:`) is no place a signal is handled: Python runs handlers only
        # where it checks for them (calls, function starts, loops), never at a NOP, which lies outside the try
        if name not in COUNTED or frame.f_code.co_code[frame.f_lasti] == NOP:
            return tracer
        if frame.f_code.co_name == "<module>":  # a module's body: its first line stands for the rest (all alike)
            if name in state["modules"]:
                return tracer
            state["modules"].add(name)
        state["count"] += 1
        if state["count"] == n:
            sys.settrace(None)
            os.write(at_fd, f"{os.path.relpath(name, PKG)}:{frame.f_lineno}".encode())
            os.kill(os.getpid(), 2)
        return tracer

    code = 1
    try:
        sys.settrace(tracer)
        if MODE == "console script":
            sys.argv = [SCRIPT, *ARGS]
            runpy.run_path(SCRIPT, run_name="__main__")
        else:  # what ``python -m MODULE`` does: argv[0] is "-m" while runpy imports the package
            sys.argv = ["-m", *ARGS]
            sys.orig_argv = [sys.executable, "-m", MODE, *ARGS]
            runpy._run_module_as_main(MODE)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # as the interpreter: the traceback, exit 1
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


results = []
for n in range(1, 10_000):
    at_r, at_w = os.pipe()
    with tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.close(at_r)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0), os.dup2(null, 1), os.dup2(err.fileno(), 2)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False))
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
            child(n, at_w)
        os.close(at_w)
        at = os.read(at_r, 4096).decode()
        os.close(at_r)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        err.seek(0)
        results.append({"n": n, "at": at, "code": status, "stderr": err.read().decode(errors="replace")})
    if not at:  # the run ended before its n-th line: every line was a trial
        break
print(json.dumps(results))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child per trial")
@pytest.mark.parametrize("entry", ["console script", "ckptdoctor", "ckptdoctor.cli"])
def test_sigint_at_each_line_of_the_cli_start_exits_130_with_one_line(entry):
    """The windows the clock rarely hits, each hit: ``run()`` armed its handlers before its ``try`` (a SIGINT between
    arming SIGINT and the ``try`` was ``_Interrupted`` out of ``run()``: a traceback and exit 1, ``check``'s
    "findings"), and ``python -m ckptdoctor.cli`` was no CLI process to the package (no deferral while it imported
    the CLI: a KeyboardInterrupt traceback)."""
    script = str(CONSOLE_SCRIPT) if CONSOLE_SCRIPT.exists() else str(REPO / "ckptdoctor" / "__main__.py")
    harness = [sys.executable, "-c", _LINE_HARNESS, entry, script, str(REPO / "ckptdoctor"), *CHECK]
    proc = subprocess.run(harness, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    trials, finished = results[:-1], results[-1]
    assert len(trials) > 30 and finished["code"] == 0, finished  # the lines of run(), main() and the import: all met
    failed = [t for t in trials if (t["code"], t["stderr"]) != (130, INTERRUPTED)]
    assert not failed, "\n".join(f"SIGINT at {t['at']}: exit {t['code']}\n{t['stderr']}" for t in failed[:5])


def test_outcome_of_an_interrupt_caught_by_the_interpreters_start():
    """CPython reports a KeyboardInterrupt raised while it checks whether argv[0] is a zip to import from, then runs
    the script to its end: that run is an answer (nothing of ours had run); the same report with a frame of the
    package in it, or with an exit other than 0, is not."""
    report = (
        "Failed checking if argv[0] is an import path entry\n"
        "Traceback (most recent call last):\n"
        '  File "<frozen zipimport>", line 94, in __init__\n'
        "KeyboardInterrupt\n"
    )
    finished = types.SimpleNamespace(returncode=0)
    assert _outcome(finished, "complete\n", report, "complete\n") is not None  # type: ignore[arg-type]
    failed = types.SimpleNamespace(returncode=1)
    assert _outcome(failed, "complete\n", report, "complete\n") is None  # type: ignore[arg-type]
    ours = report.replace("<frozen zipimport>", str(PACKAGE / "cli.py"))
    assert _outcome(finished, "complete\n", ours, "complete\n") is None  # type: ignore[arg-type]
