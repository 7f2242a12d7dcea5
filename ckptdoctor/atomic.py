"""Crash-safe file writes: temp file + fsync + rename, backups, hard-link-or-copy of unchanged files.

Every file ckptdoctor writes goes through here. ``fault_point`` lets tests stop the process between
write steps (``CKPTDOCTOR_FAULT_AT=<step>``) to prove the source stays loadable or restorable: by default
it exits at once like a kill; with ``CKPTDOCTOR_FAULT_MODE=sigint`` (``sigterm``) it sends itself SIGINT (Ctrl-C)
(SIGTERM) instead.

Names ckptdoctor creates beside user data are never derived from the pid alone (a later run with the same
pid must not mistake them for its own): they carry a timestamp and a random token, and are created with
``O_EXCL`` / ``mkdir`` / ``RENAME_NOREPLACE`` so that nothing existing is ever overwritten.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ckptdoctor.errors import CkptError
from ckptdoctor.write_guard import refuse_remote_write

FAULT_ENV = "CKPTDOCTOR_FAULT_AT"
FAULT_MODE_ENV = "CKPTDOCTOR_FAULT_MODE"  # "exit" (default: like SIGKILL), "sigint" (Ctrl-C), "sigterm", "sleep"
FAULT_SLEEP_ENV = "CKPTDOCTOR_FAULT_SLEEP"  # seconds to pause in "sleep" mode (tests start a rival writer then)
FAULT_EXIT_CODE = 97

# Hidden names ckptdoctor creates (see ckptdoctor.rules.leftovers, which reports them when a run is cut short).
PART_MARK = ".ckptdoctor-part-"  # a temp file inside a dir: ``.<name>.ckptdoctor-part-<token>``


def fault_point(step: str) -> None:
    """Test hook: when ``CKPTDOCTOR_FAULT_AT`` names this step, exit abruptly (no cleanup, like a kill); with
    ``CKPTDOCTOR_FAULT_MODE=sigint`` deliver SIGINT to this process (like Ctrl-C at this point); with ``sleep``
    say so on stderr and pause (``CKPTDOCTOR_FAULT_SLEEP`` seconds), then go on."""
    if os.environ.get(FAULT_ENV) == step:
        mode = os.environ.get(FAULT_MODE_ENV, "exit")
        if mode in ("sigint", "sigterm"):
            os.kill(os.getpid(), signal.SIGINT if mode == "sigint" else signal.SIGTERM)
            return
        if mode == "sleep":
            sys.stderr.write(f"fault point {step}: sleeping\n")
            sys.stderr.flush()
            time.sleep(float(os.environ.get(FAULT_SLEEP_ENV, "3")))
            return
        os._exit(FAULT_EXIT_CODE)


def token() -> str:
    """A short random token for unique names."""
    return secrets.token_hex(4)


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _exclusive_temp(path: Path) -> tuple[Path, int]:
    """A new temp file beside ``path`` (created with O_EXCL, never an existing one) and its descriptor."""
    while True:
        tmp = path.with_name(f".{path.name}{PART_MARK}{token()}")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            continue


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the complete new one, never a mix."""

    def fill(fd: int) -> bool:
        with memoryview(data) as view:
            while view:
                view = view[os.write(fd, view) :]
        return True

    write_atomic_with(path, fill)


def write_atomic_with(path: Path, fill: Callable[[int], bool], check: Callable[[Path], bool] | None = None) -> bool:
    """:func:`write_atomic` of what ``fill`` writes to the descriptor it is given (a writer that streams), kept only
    where ``fill`` and then ``check`` (of the complete, fsynced temp file) answer True; False (nothing left) else."""
    tmp: Path | None = None
    try:
        tmp, fd = _exclusive_temp(path)
        try:
            keep = fill(fd)
            if keep:
                os.fsync(fd)
        finally:
            os.close(fd)
        if not keep or (check is not None and not check(tmp)):
            tmp.unlink()
            return False
        fault_point(f"atomic:before-replace:{path.name}")
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise CkptError(f"{path}: cannot write ({exc.strerror})") from None
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise
    fsync_dir(path.parent)
    return True


def timestamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%dT%H%M%S")


def backup_name(path: Path, stamp: str) -> Path:
    return path.with_name(f"{path.name}.bak-{stamp}")


def free_stamp(directory: Path, names: list[str] | set[str]) -> str:
    """A backup stamp for which no ``<name>.bak-<stamp>`` exists yet in ``directory`` (a token is added
    when a backup from the same second is already there)."""
    stamp = timestamp()
    while any(os.path.lexists(backup_name(directory / n, stamp)) for n in names):
        stamp = f"{timestamp()}-{token()}"
    return stamp


def backup_file(path: Path, stamp: str, into: Path | None = None) -> Path:
    """Keep the current ``path`` as ``<name>.bak-<stamp>`` beside it (or in the dir ``into``): a hard link,
    instant, no bytes copied.

    Never overwrites anything: an existing backup name is an error, and the copy used where hard links are
    not supported is created with O_EXCL.
    """
    backup = _backup_path(path, stamp, into)
    try:
        os.link(path, backup)
    except FileExistsError:
        raise CkptError(f"{backup}: backup already exists; refusing to overwrite it") from None
    except OSError as link_error:
        if link_error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise CkptError(f"{path}: cannot back up to {backup.name} ({link_error.strerror})") from None
        _copy_exclusive(path, backup)
    fsync_dir(backup.parent)
    return backup


def _backup_path(path: Path, stamp: str, into: Path | None) -> Path:
    backup = backup_name(path, stamp)
    return backup if into is None else into / backup.name


def keep_previous(path: Path, stamp: str, into: Path | None = None) -> Path | None:
    """Keep what ``path`` holds before it is replaced, as ``<name>.bak-<stamp>`` beside it (or in the dir
    ``into``): a regular file hard-linked (:func:`backup_file`), anything else there (a FIFO, a dir, a link) moved
    to that name; None where nothing is."""
    if path.is_file() and not path.is_symlink():
        return backup_file(path, stamp, into)
    if not (path.exists() or path.is_symlink()):
        return None
    backup = _backup_path(path, stamp, into)
    rename_noreplace(path, backup)
    fsync_dir(path.parent)
    if into is not None:
        fsync_dir(into)
    return backup


def _copy_exclusive(src: Path, dst: Path, what: str = "backup") -> None:
    """Copy ``src`` to a new file ``dst`` (fails if ``dst`` exists, never follows a link there), fsynced; a
    partial copy is removed. ``what`` names ``dst`` in errors."""
    doing = "back up" if what == "backup" else "copy"
    try:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except FileExistsError:
        raise CkptError(f"{dst}: {what} already exists; refusing to overwrite it") from None
    except OSError as exc:
        raise CkptError(f"{src}: cannot {doing} to {dst.name} ({exc.strerror})") from None
    try:
        with open(fd, "wb") as out, open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, 8 << 20)
            out.flush()
            os.fsync(out.fileno())
        shutil.copystat(src, dst)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            dst.unlink()
        if isinstance(exc, OSError):
            raise CkptError(f"{src}: cannot {doing} to {dst.name} ({exc.strerror})") from None
        raise
        raise


def restore_from_backup(backup: Path, path: Path) -> None:
    """Put ``backup`` (a hard link or copy) back under ``path`` atomically; the backup stays."""
    tmp = path.with_name(f".{path.name}{PART_MARK}{token()}")
    try:
        os.link(backup, tmp)
    except OSError:
        shutil.copy2(backup, tmp)
    os.replace(tmp, path)


def link_or_copy(src: Path, dst: Path, replace: bool = False) -> str:
    """Hard-link ``src`` to ``dst`` (same filesystem) or copy it; returns "linked" or "copied".

    ``dst`` must not exist (an existing one is an error: nothing is written into it), but with ``replace``
    (an ``--output`` dir written into with ``--force``, perhaps half written by an interrupted run): then an
    existing ``dst`` that is ``src`` itself (linked by that run) is kept, another one is replaced by a rename,
    never written into (it may be a hard link of a file elsewhere)."""
    if replace and os.path.lexists(dst):
        with contextlib.suppress(OSError):
            if os.path.samefile(src, dst):
                return "linked"
        tmp = dst.with_name(f".{dst.name}{PART_MARK}{token()}")
        how = _link_or_copy_new(src, tmp)
        try:
            os.replace(tmp, dst)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise CkptError(f"{dst}: cannot replace ({exc.strerror})") from None
        return how
    return _link_or_copy_new(src, dst)


def _link_or_copy_new(src: Path, dst: Path) -> str:
    # A symlinked source file: link its target. Linux's link() links the symlink itself, and a relative one
    # would then resolve from the output dir (dangling, or naming another file).
    target = Path(os.path.realpath(src)) if os.path.islink(src) else src
    try:
        os.link(target, dst)
        return "linked"
    except FileExistsError:
        raise CkptError(f"{dst}: exists; refusing to overwrite it") from None
    except OSError:  # another filesystem, or no hard links there: a copy, made as a backup's is
        pass
    _copy_exclusive(src, dst, "file")
    return "copied"


def prepare_output_dir(output: Path, force: bool = False) -> bool:
    """Refuse an output dir that exists and is not empty (unless ``force``); create it otherwise.

    Returns True when the dir was created here.
    """
    refuse_remote_write(output, in_place=False)
    try:
        if output.exists():
            if not output.is_dir():
                raise CkptError(f"{output}: exists and is not a directory")
            if any(output.iterdir()) and not force:
                raise CkptError(f"{output}: exists and is not empty (use --force to write into it)")
            return False
        output.mkdir(parents=True)
    except OSError as exc:
        raise CkptError(f"{exc.filename or output}: cannot create the output dir ({exc.strerror})") from None
    return True


def refuse_overlap(output: Path, protected: list[Path], hint: str) -> None:
    """Refuse an output that is, contains or lies inside one of the ``protected`` source paths."""
    target = output.resolve()
    for path in dict.fromkeys(p.resolve() for p in protected):
        if target == path or path in target.parents or target in path.parents:
            raise CkptError(f"{output}: is, contains or lies inside the source checkpoint {path}; {hint}")


def make_unique_dir(parent: Path, prefix: str) -> Path:
    """Create and return a new dir ``<parent>/<prefix><timestamp>-<token>`` (mkdir: never an existing one)."""
    refuse_remote_write(parent, in_place=True)
    while True:
        path = parent / f"{prefix}{timestamp()}-{token()}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise CkptError(f"{parent}: cannot create a staging dir ({exc.strerror})") from None


_RENAME_NOREPLACE = 1  # linux/fs.h
_RENAME_EXCHANGE = 2


def _renameat2(a: Path, b: Path, flags: int) -> int | None:
    """``renameat2``: 0 on success, the errno on failure, None where the call does not exist."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return None
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flags)
    return 0 if result == 0 else ctypes.get_errno()


_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM)


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported.

    Readers see either the old or the new directory under each name, never a missing one.
    """
    err = _renameat2(a, b, _RENAME_EXCHANGE)
    if err == 0:
        return True
    if err is None or err in _UNSUPPORTED:
        return False  # this filesystem or kernel cannot exchange: the caller falls back to two renames
    raise CkptError(f"{a}: cannot swap with {b.name} ({os.strerror(err)})")


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, failing (never replacing) when ``dst`` exists."""
    err = _renameat2(src, dst, _RENAME_NOREPLACE)
    if err == 0:
        return
    if err is not None and err not in _UNSUPPORTED:
        raise CkptError(f"{src}: cannot rename to {dst.name} ({os.strerror(err)})")
    if os.path.lexists(dst):  # no RENAME_NOREPLACE here; the caller holds the checkpoint lock
        raise CkptError(f"{src}: cannot rename to {dst.name} (it exists; refusing to replace it)")
    try:
        os.rename(src, dst)
    except OSError as exc:
        raise CkptError(f"{src}: cannot rename to {dst.name} ({exc.strerror})") from None


_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def defer_sigint() -> Iterator[None]:
    """Hold back Ctrl-C (SIGINT) and SIGTERM across a critical section; the first one received meanwhile is
    delivered once the section has ended (normally or not) to the handler that was in place (Python's default
    SIGINT handler: :class:`KeyboardInterrupt`). No-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def record(signum: int, frame: object) -> None:
        received.append(signum)

    previous = {signum: signal.signal(signum, record) for signum in _HELD_SIGNALS}
    try:
        yield
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)
        if received:
            first = signal.Signals(received[0])
            handler = previous[first]
            if callable(handler) and handler is not signal.default_int_handler:
                handler(first, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), first)
            elif handler != signal.SIG_IGN:
                raise KeyboardInterrupt
