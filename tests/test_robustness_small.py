"""Small robustness items (issue #9, item 8), each through the CLI: exit code and output.

* trackers get Megatron-LM's verdict (``int(text.strip())``), non-ASCII digits are refused;
* an unreadable data file is a ``check`` finding, an unlistable iteration dir a one-line error;
* SIGINT (a real signal to a real process) exits 130 with one line, wherever it lands;
* control characters read from a checkpoint are escaped in every text output and error line.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO

from ckptdoctor.cli import main
from ckptdoctor.text_safety import escape

TRACKER = "latest_checkpointed_iteration.txt"
ITER = "iter_0000010"


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptdoctor: error: "), err
    assert "internal error" not in err and "Traceback" not in err
    return lines[0]


# --- 1. trackers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["+10", " 10 ", "1_0", "0010", "\t10\r\n", "10\n"])
def test_tracker_megatron_accepts_resolves_like_megatron(capsys, copy_fixture, text):
    assert int(text.strip()) == 10  # what Megatron-LM's read_metadata computes
    save = copy_fixture("core019_tp1")
    (save / TRACKER).write_text(text)
    rc, out, err = _run(capsys, "inspect", save, "--format", "json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["iteration_dir"] == str(save / ITER)
    assert report["tracker"]["value"] == "10"
    rc, out, err = _run(capsys, "check", "--isolated", save)
    assert rc == 0, out + err
    assert out.strip() == "All checks passed (1 checkpoint)."


@pytest.mark.parametrize("text", ["\u0661\u0660", "\uff11\uff10", "1\u0660"])  # Arabic-Indic, fullwidth, mixed
def test_tracker_non_ascii_digits_are_an_error_naming_the_tracker(capsys, copy_fixture, text):
    assert int(text) == 10  # Python (and so Megatron) would accept them: they are refused on purpose
    save = copy_fixture("core019_tp1")
    tracker = save / TRACKER
    tracker.write_text(text, encoding="utf-8")
    for command in ("inspect", "diff"):
        args = [command, save] + ([FIXTURES / "core019_tp1"] if command == "diff" else [])
        rc, out, err = _run(capsys, *args)
        assert rc == 2 and out == ""
        line = _one_error_line(err)
        assert f"{tracker}: tracker holds" in line and "non-ASCII" in line
    rc, out, err = _run(capsys, "check", "--isolated", save)
    assert rc == 1, out + err
    assert f"{tracker}: CKD120 [error] tracker holds" in out and "non-ASCII" in out


@pytest.mark.parametrize("text", ["0", "-10", "1 0", "10.0"])
def test_tracker_megatron_refuses_is_an_error(capsys, copy_fixture, text):
    save = copy_fixture("core019_tp1")
    (save / TRACKER).write_text(text)
    rc, out, err = _run(capsys, "inspect", save)
    assert rc == 2 and str(save / TRACKER) in _one_error_line(err)
    rc, out, _ = _run(capsys, "check", "--isolated", save)
    assert rc == 1 and f"{save / TRACKER}: CKD120" in out


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_tracker_that_is_not_a_regular_file_is_named_as_such(capsys, copy_fixture, kind):
    """Megatron reads the tracker only when os.path.isfile says so; the error says why it was not read."""
    save = copy_fixture("core019_tp1")
    tracker = save / TRACKER
    tracker.unlink()
    os.mkfifo(tracker) if kind == "fifo" else tracker.mkdir()
    rc, out, err = _run(capsys, "inspect", save)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert f"{save}: save dir whose {TRACKER} is not a regular file" in line and ITER in line
    rc, out, _ = _run(capsys, "check", "--isolated", save)  # the warning says so too (it said "no tracker")
    assert rc == 1 and f"{save}: CKD122 [warning] {TRACKER} is not a regular file; Megatron would not resume" in out
    tracker.rmdir() if kind == "dir" else tracker.unlink()
    rc, out, err = _run(capsys, "inspect", save)
    assert f"{save}: save dir without {TRACKER}" in _one_error_line(err)


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_metadata_json_that_is_not_a_regular_file_is_unreadable_not_invalid_json(capsys, copy_fixture, kind):
    save = copy_fixture("core019_tp1")
    path = save / ITER / "metadata.json"
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    rc, out, err = _run(capsys, "inspect", save)
    assert rc == 2 and f"{path}: cannot read (" in _one_error_line(err)
    rc, out, _ = _run(capsys, "check", "--isolated", save)
    assert rc == 1 and f"{path}: CKD102 [error] cannot read (" in out and "JSON" not in out


# --- 2. unreadable files and dirs -----------------------------------------------------------------------


def test_data_file_that_is_a_directory_is_a_finding(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    data = save / ITER / "__1_0.distcp"
    data.unlink()
    data.mkdir()
    rc, out, _ = _run(capsys, "check", "--isolated", save)
    assert rc == 1
    assert f"{data}: CKD113 [error] unreadable (not a regular file)" in out


def test_data_file_without_read_permission_is_a_finding(capsys, copy_fixture, monkeypatch):
    # Tests run as root, for whom mode 000 is readable: os.open fails as it would for another user.
    save = copy_fixture("core019_tp2")
    data = save / ITER / "__1_0.distcp"
    real_open = os.open

    def deny(path, flags, *args, **kwargs):
        if os.fspath(path) == str(data):
            raise PermissionError(errno.EACCES, "Permission denied", str(data))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    rc, out, _ = _run(capsys, "check", "--isolated", save)
    assert rc == 1
    assert f"{data}: CKD113 [error] unreadable (Permission denied)" in out
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "json", save)
    assert rc == 1
    assert {"code": "CKD113", "path": str(data)}.items() <= json.loads(out)["findings"][0].items()


def _deny_dir(monkeypatch, directory: Path) -> None:
    """Make ``directory`` behave like mode 000 for a non-root user: no listing, no stat or open inside."""
    denied = str(directory)

    def blocked(path, inside_only: bool) -> bool:
        if isinstance(path, int):
            return False
        path = os.fsdecode(os.fspath(path))
        return path.startswith(denied + os.sep) or (not inside_only and path == denied)

    def wrap(name: str, inside_only: bool):
        real = getattr(os, name)

        def guarded(path=".", *args, **kwargs):
            if blocked(path, inside_only):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, guarded)

    wrap("listdir", False)
    wrap("scandir", False)
    wrap("stat", True)
    wrap("lstat", True)
    wrap("open", True)


@pytest.mark.parametrize(
    "how", ["inspect-iteration-dir", "inspect-save-dir", "check-iteration-dir", "check-save-dir", "diff"]
)
def test_unlistable_iteration_dir_is_one_error_naming_it(capsys, copy_fixture, monkeypatch, how):
    save = copy_fixture("core019_tp1")
    iteration_dir = save / ITER
    _deny_dir(monkeypatch, iteration_dir)
    command, target = how.split("-", 1) if how != "diff" else ("diff", "save-dir")
    path = iteration_dir if target == "iteration-dir" else save
    args = [command] + (["--isolated"] if command == "check" else []) + [path]
    if command == "diff":
        args.append(FIXTURES / "core019_tp1")
    rc, out, err = _run(capsys, *args)
    assert rc == 2 and out == "", out
    assert _one_error_line(err) == f"ckptdoctor: error: {iteration_dir}: cannot list (Permission denied)"


def test_unlistable_save_dir_is_one_error_naming_it(capsys, copy_fixture, monkeypatch):
    save = copy_fixture("core019_tp1")
    _deny_dir(monkeypatch, save)
    for args in (["inspect", save], ["check", "--isolated", save]):
        rc, out, err = _run(capsys, *args)
        assert rc == 2 and out == ""
        assert _one_error_line(err) == f"ckptdoctor: error: {save}: cannot list (Permission denied)"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads mode 000 files")
def test_mode_000_for_a_real_user(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    data = save / ITER / "__1_0.distcp"
    data.chmod(0)
    try:
        rc, out, _ = _run(capsys, "check", "--isolated", save)
        assert rc == 1 and f"{data}: CKD113 [error] unreadable" in out
    finally:
        data.chmod(0o644)
    (save / ITER).chmod(0)
    try:
        for args in (["inspect", save / ITER], ["check", "--isolated", save / ITER], ["inspect", save]):
            rc, _, err = _run(capsys, *args)
            assert rc == 2 and str(save / ITER) in _one_error_line(err)
    finally:
        (save / ITER).chmod(0o755)


# --- 3. SIGINT --------------------------------------------------------------------------------------------

# The child is ``python -m ckptdoctor ...`` (runpy, as -m does) after a patch that makes it wait, at a known
# place, for the signal: it writes READY to stderr, then sleeps. The parent sends a real SIGINT.
_CHILD = """
import runpy, sys, time

def wait():
    if getattr(wait, "done", False):  # once: after the signal, the exit path may pass here again
        return
    wait.done = True
    sys.stderr.write("READY\\n")
    sys.stderr.flush()
    time.sleep(60)
    sys.stderr.write("NOT INTERRUPTED\\n")

WHERE = {where!r}
if WHERE == "command":  # in the middle of the deep pass
    import ckptdoctor.rules.deep_decode as deep_decode
    deep_decode.check_deep = lambda state, advance=None, *more: wait() or []
elif WHERE == "progress-callback":  # in the callback the deep pass calls for each chunk
    import ckptdoctor.rules.deep_decode as deep_decode
    real = deep_decode.check_deep
    def check_deep(state, advance=None, *more):
        def slow(n):
            advance(n)
            wait()
        return real(state, slow, *more)
    deep_decode.check_deep = check_deep
elif WHERE == "progress-bar":  # inside the progress display, while it draws
    import ckptdoctor.commands.progress_bar as bar_module
    real = bar_module.ProgressBar._draw
    def _draw(self, now):
        real(self, now)
        if self._done:
            wait()
    bar_module.ProgressBar._draw = _draw
elif WHERE == "click-dispatch":  # inside click, while it resolves the subcommand
    import click.core
    real = click.core.Group.resolve_command
    def resolve_command(self, ctx, args):
        wait()
        return real(self, ctx, args)
    click.core.Group.resolve_command = resolve_command
sys.argv = ["ckptdoctor"] + sys.argv[1:]
runpy.run_module("ckptdoctor", run_name="__main__", alter_sys=True)
"""


def _interrupt(where: str, tty: bool, sig: int = signal.SIGINT) -> tuple[int, str]:
    """Run ``check --deep`` in a child, send it ``sig`` once it waits; its exit code and stderr after READY."""
    argv = [
        sys.executable,
        "-c",
        _CHILD.format(where=where),
        "check",
        "--deep",
        "--isolated",
        str(FIXTURES / "core019_tp1"),
    ]
    if tty:  # stderr on a terminal: check --deep draws its progress bar there
        import pty

        master, slave = pty.openpty()
        child = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
    else:
        child = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        master = child.stderr.fileno()
    try:
        seen = b""
        deadline = time.monotonic() + 60
        while b"READY" not in seen:
            assert time.monotonic() < deadline, seen
            ready, _, _ = select.select([master], [], [], 1)
            if ready:
                chunk = os.read(master, 4096)
                assert chunk, f"child ended before READY: {seen!r}"
                seen += chunk
        child.send_signal(sig)
        rest = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the pty's other side is closed
                break
            if not chunk:
                break
            rest += chunk
        code = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
        if tty:
            os.close(master)
        if child.stdout is not None:
            child.stdout.close()
        if child.stderr is not None:
            child.stderr.close()
    after = (seen.split(b"READY", 1)[1] + rest).decode("utf-8", "replace").replace("\r\n", "\n")
    return code, after


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("where", ["command", "click-dispatch"])
def test_sigint_exits_130_with_one_line(where):
    code, stderr = _interrupt(where, tty=False)
    assert code == 130, stderr
    assert stderr == "\nckptdoctor: interrupted\n", stderr  # the newline ends the READY line


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("where", ["command", "click-dispatch"])
def test_sigterm_exits_143_with_one_line(where):
    """SIGTERM (a batch scheduler ending the job, torchrun stopping its ranks) is answered like Ctrl-C: the
    run stops, cleans up what it was writing, says so in one line, and exits 128 + 15 as a shell reports it."""
    code, stderr = _interrupt(where, tty=False, sig=signal.SIGTERM)
    assert code == 143, stderr
    assert stderr == "\nckptdoctor: terminated\n", stderr


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and ptys")
@pytest.mark.parametrize("where", ["progress-callback", "progress-bar"])
def test_sigint_in_progress_bar_exits_130_with_one_line(where):
    code, stderr = _interrupt(where, tty=True)
    assert code == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr and "NOT INTERRUPTED" not in stderr
    assert "aborted" not in stderr
    lines = [line for line in stderr.split("\n") if line.strip()]
    assert lines[-1] == "ckptdoctor: interrupted", stderr
    assert stderr.count("ckptdoctor: interrupted") == 1


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("sig, code, line", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_a_signal_while_the_cli_starts_exits_with_one_line(sig, code, line):
    # As ``python -m ckptdoctor`` imports the CLI (argv[0] is the package's __main__.py): a SIGINT or SIGTERM that
    # arrives before run() is remembered and answered by it, instead of a KeyboardInterrupt traceback from an
    # import (SIGINT) or an exit with no word (SIGTERM).
    child = (
        "import os, signal, sys\n"
        f"sys.argv = [{str(REPO / 'ckptdoctor' / '__main__.py')!r}, 'inspect', {str(FIXTURES / 'core019_tp1')!r}]\n"
        "import ckptdoctor.cli\n"
        f"os.kill(os.getpid(), signal.{sig})\n"
        "ckptdoctor.cli.run()\n"
    )
    result = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == code, result.stderr
    assert result.stderr == f"ckptdoctor: {line}\n" and result.stdout == ""


# --- 4. control characters from a checkpoint --------------------------------------------------------------

HOSTILE = "\x1b[2J\x1b]0;pwned\x07RMS\nFAKE: all checks passed\u202e"
HOSTILE_NAME = "evil\x1b[31m_arg"
ESCAPED = "\\x1b[2J\\x1b]0;pwned\\x07RMS\\nFAKE: all checks passed\\u202e"


def _assert_terminal_safe(text: str) -> None:
    assert not any(ch in text for ch in "\x1b\x07\r\u202e\x9b"), repr(text)
    assert "\nFAKE" not in text, text


@pytest.fixture
def hostile(capsys, copy_fixture):
    """core019_tp1 with an arg value and an arg name holding terminal escapes and a newline."""
    save = copy_fixture("core019_tp1")
    rc, out, err = _run(
        capsys,
        "fix-args",
        save,
        "--set",
        f"normalization={HOSTILE}",
        "--set",
        f"{HOSTILE_NAME}=x\x1b[5mblink",
        "--force",
        "--in-place",
    )
    assert rc == 0, err
    _assert_terminal_safe(out)  # fix-args' own text output, quoting the new values
    assert ESCAPED in out and "evil\\x1b[31m_arg" in out
    return save


def test_escape_unit():
    assert escape("a\x1b[0mb\nc\td\r\x00\x7f\x9b\u2028\u202e") == "a\\x1b[0mb\\nc\\td\\r\\x00\\x7f\\x9b\\u2028\\u202e"
    assert escape("plain, ünïcödé, 中文 ok") == "plain, ünïcödé, 中文 ok"


def test_large_reports_rows_are_escaped_wherever_the_control_character_is():
    """escape_values' fast path for many rows of one dataclass: clean rows come back as the same list; one hostile
    string in any row and field (or a row of another class, or a nested value) still gets escaped."""
    from dataclasses import dataclass

    from ckptdoctor.text_safety import escape_values

    @dataclass
    class Row:
        key: str
        size: int
        reason: str | None

    @dataclass
    class Other:
        key: str

    rows = [Row(f"decoder.layers.{i}.mlp.weight", i, None if i % 2 else "frozen") for i in range(1000)]
    assert escape_values(rows) is rows
    for index, field in ((0, "key"), (517, "reason"), (999, "key")):
        hostile = list(rows)
        hostile[index] = Row(**{**vars(rows[index]), field: "evil\x1b[2J\u202e"})
        out = escape_values(hostile)
        assert getattr(out[index], field) == "evil\\x1b[2J\\u202e"
        assert out[:index] == rows[:index] and out[index + 1 :] == rows[index + 1 :]
    mixed = [*rows, Other("x\ny")]
    assert escape_values(mixed)[-1].key == "x\\ny"
    nested = [*rows[:100], Row("k", 1, ["a\x07"])]  # type: ignore[arg-type]  # a field holding a container
    assert escape_values(nested)[-1].reason == ["a\\x07"]


def test_large_reports_rows_with_list_fields_take_the_fast_path_and_are_escaped():
    """Rows whose fields hold lists or tuples of atoms (``check --health``'s ``shape``) are checked at C speed: clean
    ones come back as the same list; an unsafe string inside a row's list, or beside the lists in the same field,
    still gets escaped, and a deeper container takes the general path."""
    from dataclasses import dataclass

    from ckptdoctor import text_safety
    from ckptdoctor.text_safety import escape_values

    @dataclass(frozen=True)
    class Row:
        key: str
        shape: list
        dims: tuple
        note: object

    rows = [Row(f"decoder.layers.{i}.mlp.weight", [i, 4096], ("a", 2.5, None), None) for i in range(1000)]
    assert text_safety._clean_rows(rows)
    assert escape_values(rows) is rows

    hostile = list(rows)
    hostile[517] = Row("k", [1, "\x1b[31m"], (), None)
    assert not text_safety._clean_rows(hostile)
    out = escape_values(hostile)
    assert out[517].shape == [1, "\\x1b[31m"] and out[516] is rows[516]

    hostile = list(rows)
    hostile[3] = Row("k", [1], ("x\ny",), None)
    assert escape_values(hostile)[3].dims == ("x\\ny",)

    mixed = list(rows)  # one field holding lists and strings: the strings are checked too
    mixed[10] = Row("k", [1], (), [2, 3])
    mixed[11] = Row("k", [1], (), "evil\x1b[2J")
    assert escape_values(mixed)[11].note == "evil\\x1b[2J"
    mixed[11] = Row("k", [1], (), "fine")
    assert text_safety._clean_rows(mixed) and escape_values(mixed) is mixed

    deeper = list(rows)
    deeper[0] = Row("k", [[1, "\x07"]], (), None)
    assert not text_safety._clean_rows(deeper)
    assert escape_values(deeper)[0].shape == [[1, "\\x07"]]


def test_inspect_escapes_arg_values_json_keeps_them(capsys, hostile):
    rc, out, _ = _run(capsys, "inspect", hostile)
    assert rc == 0
    _assert_terminal_safe(out)
    assert f"normalization={ESCAPED}" in out
    rc, out, _ = _run(capsys, "inspect", hostile, "--format", "json")
    assert rc == 0 and "\x1b" not in out  # json.dumps escapes; the value itself is intact
    assert json.loads(out)["args"]["model shape"]["normalization"] == HOSTILE


def test_fix_args_escapes_old_and_new_values(capsys, hostile):
    rc, out, _ = _run(capsys, "fix-args", hostile, "--set", "normalization=RMSNorm")
    assert rc == 0
    _assert_terminal_safe(out)
    assert f"normalization: {ESCAPED} -> RMSNorm" in out


def test_diff_escapes_arg_names_and_values(capsys, hostile):
    rc, out, _ = _run(capsys, "diff", FIXTURES / "core019_tp1", hostile)
    assert rc == 1
    _assert_terminal_safe(out)
    assert f"normalization: RMSNorm -> {ESCAPED}" in out
    assert "evil\\x1b[31m_arg: x\\x1b[5mblink (only in B)" in out
    rc, out, _ = _run(capsys, "diff", FIXTURES / "core019_tp1", hostile, "--format", "json")
    assert rc == 1 and "\x1b" not in out  # json.dumps escapes; the values themselves are intact
    changes = {c["name"]: c for group in json.loads(out)["args"]["groups"].values() for c in group}
    assert changes["normalization"]["b"] == HOSTILE and changes[HOSTILE_NAME]["b"] == "x\x1b[5mblink"


def test_check_escapes_file_names(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    name = "__7_0\x1b[2J\nFAKE: All checks passed.distcp"
    (save / ITER / name).write_bytes((save / ITER / "__0_0.distcp").read_bytes())
    rc, out, _ = _run(capsys, "check", "--isolated", save)
    assert rc == 1
    _assert_terminal_safe(out)
    lines = out.splitlines()
    assert len(lines) == 3, out  # one finding, its fix, one summary: the name forged no line
    assert lines[0] == (
        f"{save / ITER}/__7_0\\x1b[2J\\nFAKE: All checks passed.distcp: CKD115 [warning] "
        "no .metadata entry references this file"
    )
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "json", save)
    assert json.loads(out)["findings"][0]["path"] == str(save / ITER / name)


def test_strip_frozen_escapes_file_names(capsys, copy_fixture, tmp_path):
    save = copy_fixture("core019_peft_full_tp1")
    os.mkfifo(save / ITER / "notes\x1b]0;pwned\x07\nFAKE")  # a special file: named in a "not carried" line
    rc, out, err = _run(capsys, "strip-frozen", save, "--output", tmp_path / "out")
    assert rc == 0, err
    _assert_terminal_safe(out)
    assert "not carried     notes\\x1b]0;pwned\\x07\\nFAKE: a special file" in out


def test_error_lines_are_escaped(capsys, tmp_path):
    save = tmp_path / "ckpt\x1b[2J\nFAKE"
    (save / ITER).mkdir(parents=True)
    (save / TRACKER).write_text("10")
    for args in (
        ["inspect", save],
        ["diff", save, FIXTURES / "core019_tp1"],
        ["fix-args", save],
        ["strip-frozen", save, "--dry-run"],
    ):
        rc, out, err = _run(capsys, *args)
        assert rc == 2 and out == ""
        line = _one_error_line(err)
        _assert_terminal_safe(err)
        assert "ckpt\\x1b[2J\\nFAKE" in line and "metadata.json missing" in line
