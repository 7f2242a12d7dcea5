"""Shared test helpers: the real megatron-core fixtures and subprocess runners."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import locale
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
MANIFESTS = FIXTURES / "manifests"


def fixture_names() -> list[str]:
    return sorted(p.stem for p in MANIFESTS.glob("*.json") if (FIXTURES / p.stem).is_dir())


def manifest(name: str) -> dict:
    return json.loads((MANIFESTS / f"{name}.json").read_text())


@functools.cache
def shipped_schema(name: str) -> dict:
    """Command ``name``'s ``--format json`` schema, as the package ships it (``ckptdoctor schema NAME``)."""
    from ckptdoctor.commands.schema import schema_text

    return json.loads(schema_text(name))


def pytest_configure(config: pytest.Config) -> None:
    # A runner started in the background by a non-interactive shell (`./scripts/test.sh &`, nohup under a
    # subshell) inherits SIGINT ignored, and so would every child it starts: the Ctrl-C tests need it delivered.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


UNWRAPPED_COLUMNS = "100000"  # a width no line reaches: text as the renderers build it, before wrapping


@pytest.fixture(autouse=True)
def _output_unwrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests read a command's text line by line (a finding, a global's name, a fix line): they run it unwrapped,
    COLUMNS set wider than any line, in this process and in the children it starts. The wrapping itself is
    tests/test_wrap.py's, which sets or unsets COLUMNS per run. (Set explicitly: GNU readline, once imported, puts
    the terminal's COLUMNS into the C environment that subprocesses inherit though os.environ never shows it.)"""
    monkeypatch.setenv("COLUMNS", UNWRAPPED_COLUMNS)


_CURRENT_TEST: list[pytest.Item] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _CURRENT_TEST[:] = [item]  # for require_mcore's marker check (fixtures call it during setup)


@functools.cache
def _mcore_probe() -> tuple[object | None, str | None]:
    """Import megatron-core once per test run: (module, None) or (None, why not). A failed import is not
    retried (Python re-runs a failed import, torch included, every time it is asked)."""
    try:
        import megatron.core
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return megatron.core, None


def require_mcore():
    """Real megatron-core, or skip; CI sets CKPTDOCTOR_REQUIRE_MCORE=1 so a missing one fails.

    Only for tests marked ``@pytest.mark.mcore`` (they are what ``-m "not mcore"`` leaves out): calling it
    from an unmarked test fails, so the fast tier never starts megatron-core by accident.
    """
    item = _CURRENT_TEST[0] if _CURRENT_TEST else None
    if item is not None and item.get_closest_marker("mcore") is None:
        pytest.fail(f"{item.nodeid} needs megatron-core: mark it @pytest.mark.mcore", pytrace=False)
    module, why = _mcore_probe()
    if module is None:
        if os.environ.get("CKPTDOCTOR_REQUIRE_MCORE"):
            pytest.fail(f"CKPTDOCTOR_REQUIRE_MCORE is set but megatron-core does not import ({why})", pytrace=False)
        pytest.skip(f"megatron-core not installed ({why})")
    return module


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@functools.cache
def _exchange_supported(directory: str) -> bool:
    from ckptdoctor.atomic import exchange_paths

    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        a, b = Path(tmp, "a"), Path(tmp, "b")
        a.mkdir()
        b.mkdir()
        (a / "marker").touch()
        return exchange_paths(a, b) and (b / "marker").exists()


def require_exchange(directory: Path) -> None:
    """Skip where the filesystem holding ``directory`` lacks ``renameat2(RENAME_EXCHANGE)`` (non-Linux, some
    network and overlay filesystems): there strip-frozen --in-place falls back to two renames."""
    if not _exchange_supported(str(directory)):
        pytest.skip(f"{directory}: this filesystem cannot exchange two paths atomically (renameat2)")


@pytest.fixture
def exchange_supported(tmp_path) -> None:
    """Skip the test where tmp_path's filesystem lacks ``renameat2(RENAME_EXCHANGE)``."""
    require_exchange(tmp_path)


def unwrapped(text: str, indent: str = "    ", keep: tuple[str, ...] = ("    fix: ",)) -> str:
    """``text`` with each block's continuation lines (those starting with ``indent``, other than the ``keep`` ones:
    check's fix lines) joined back to the line they continue: the lines as they were before wrapping to the width
    (render/wrap.py), which depends on the length of a test's tmp path."""
    lines: list[str] = []
    for line in text.splitlines():
        if lines and line.startswith(indent) and not line.startswith(keep):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def squash(text: str) -> str:
    """``text`` with every run of whitespace one space: a phrase found whatever the width wrapped it to."""
    return " ".join(text.split())


def file_digests(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (hidden ones too, relative path) -> sha256: a tree compared before and after."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def run_main(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str, str]:
    """``ckptdoctor`` in this process: (exit code, stdout, stderr)."""
    from ckptdoctor.cli import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def copy_fixture(tmp_path):
    """Copy a fixture save dir into tmp_path (tests that break checkpoints work on copies)."""

    def _copy(name: str) -> Path:
        dest = tmp_path / name
        shutil.copytree(FIXTURES / name, dest)
        return dest

    return _copy


def patch_record(data_file: Path, location, at: int, new: bytes, crc: bool = True):
    """Write ``new`` at byte ``at`` of the storage record of the chunk stored at ``location`` (a StorageLocation)
    in ``data_file``, in place; with ``crc`` its CRC-32 fields (central directory and local header) are rewritten
    as a save of those bytes would write them, without it they are left as saved (a flipped bit). The record's
    archive member (its ``start`` is relative to the chunk)."""
    import struct
    import zlib

    from ckptdoctor.formats.archive import parse_archive

    data = bytearray(data_file.read_bytes())
    base = location.offset
    blob = bytes(data[base : base + location.length])
    (record,) = [m for name, m in parse_archive(blob, "chunk").members.items() if name.split("/")[-2:-1] == ["data"]]
    assert record.method == 0 and at >= 0 and at + len(new) <= record.size
    data[base + record.start + at : base + record.start + at + len(new)] = new
    if crc:
        value = zlib.crc32(data[base + record.start : base + record.start + record.size])
        struct.pack_into("<L", data, base + record.crc_at, value)
        local = struct.unpack_from("<L", data, base + record.crc_at + 26)[0]  # the header's local header offset
        struct.pack_into("<L", data, base + local + 14, value)
    data_file.write_bytes(bytes(data))
    return record


# Blocks imports of the named top-level packages in a child interpreter, proving they are not needed.
_BLOCKER = """
import sys
class _Block:
    def __init__(self, names): self.names = names
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in self.names:
            raise ImportError(f'blocked import: {name}')
        return None
sys.meta_path.insert(0, _Block(NAMES))
"""


def blocker(names) -> str:
    """Code that makes the named top-level packages unimportable in a child interpreter."""
    return _BLOCKER.replace("NAMES", repr(set(names)))


def run_cli(
    *args: str, block: tuple[str, ...] = (), cwd: Path = REPO, python: str = sys.executable, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``ckptdoctor`` in a child interpreter, optionally with some packages unimportable."""
    code = blocker(block) + (
        "from ckptdoctor.cli import main\n"
        f"rc = main({list(args)!r})\n"
        "mods = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]\n"
        "sys.stderr.write('\\nIMPORTED:' + ','.join(sorted(mods)) + '\\n')\n"
        "raise SystemExit(rc)\n"
    )
    return subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def run_cli_each(
    commands: list[list[str]], *, block: tuple[str, ...] = (), cwd: Path = REPO, python: str = sys.executable
) -> tuple[list[tuple[int, str, str]], list[str]]:
    """Each of ``commands`` through ``ckptdoctor``'s main in one child interpreter (optionally with some
    packages unimportable): (exit code, stdout, stderr) per command, and the torch/megatron modules imported
    by the end. One interpreter for many commands, where what is tested is what that interpreter lacks."""
    code = blocker(block) + (
        "import contextlib, io, json\n"
        "from ckptdoctor.cli import main\n"
        "results = []\n"
        f"for argv in {[[str(a) for a in c] for c in commands]!r}:\n"
        "    out, err = io.StringIO(), io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "        rc = main(argv)\n"
        "    results.append((rc, out.getvalue(), err.getvalue()))\n"
        "mods = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "json.dump({'results': results, 'imported': mods}, sys.stdout)\n"
    )
    proc = subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    return [tuple(r) for r in found["results"]], found["imported"]


def run_ckptdoctor(
    *args: object,
    env: dict | None = None,
    cwd: Path = REPO,
    timeout: float = 120,
    memory_headroom: int | None = None,
) -> subprocess.CompletedProcess:
    """``python -m ckptdoctor ARGS`` as a forked copy of this test process: a real process (its own pid, exit
    code, signals, locks, a kill at a fault point, an address-space limit) that runs the same entry point
    (:func:`ckptdoctor.cli.run`) without starting an interpreter and importing ckptdoctor again (~0.3 s a
    child on 2 cores). It starts from this process's state (modules already imported, torch perhaps among
    them): a test about what a fresh process imports, or about start-up, runs a real interpreter
    (:func:`run_cli`). ``memory_headroom``: bytes of address space the child may add to what it inherits
    (RLIMIT_AS). Returns what ``subprocess.run(..., capture_output=True, text=True)`` would; a child still
    running after ``timeout`` seconds is killed and ``subprocess.TimeoutExpired`` raised."""
    argv = [str(a) for a in args]
    shown = [sys.executable, "-m", "ckptdoctor", *argv]
    _load_every_command()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child ends in os._exit
            _forked_cli(argv, out.fileno(), err.fileno(), env, cwd, memory_headroom)
        returncode = _wait_child(pid, timeout, shown)
        streams = []
        for f in (out, err):
            f.seek(0)
            streams.append(
                io.TextIOWrapper(f, encoding=locale.getpreferredencoding(False)).read()
            )  # universal newlines, as text=True
    return subprocess.CompletedProcess(shown, returncode, *streams)


@functools.cache
def _load_every_command() -> None:
    """Import every subcommand's module here, once, so that forked children do not each import theirs (half
    of a child's time). None of them imports torch or numpy."""
    import click

    from ckptdoctor.cli import cli

    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        cli.get_command(ctx, name)


def _forked_cli(argv: list[str], out: int, err: int, env: dict | None, cwd: Path, headroom: int | None) -> None:
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        # what a fresh interpreter has: Python's SIGINT handler, default SIGTERM
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.chdir(cwd)
        if headroom is not None:
            resource.setrlimit(resource.RLIMIT_AS, (_address_space() + headroom,) * 2)
        encoding = locale.getpreferredencoding(False)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=encoding)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding=encoding, errors="backslashreplace", line_buffering=True
        )
        sys.argv = [str(REPO / "ckptdoctor" / "__main__.py"), *argv]  # as ``python -m`` sets it
        from ckptdoctor.cli import run

        run()  # ends in os._exit
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:  # as the interpreter does: the traceback, then die of SIGINT
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _address_space() -> int:
    """This process's virtual memory size in bytes (what RLIMIT_AS counts)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _wait_child(pid: int, timeout: float, args: list[str]) -> int:
    """The child's exit code (negative: the signal that ended it), or kill it and raise TimeoutExpired."""
    deadline = time.monotonic() + timeout
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(args, timeout)
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.005))
    finally:
        if pidfd is not None:
            os.close(pidfd)
