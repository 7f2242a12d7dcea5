"""One writer per checkpoint: an advisory ``flock`` on the iteration dir itself.

Every write command (``fix-args --write``, ``strip-frozen``) holds an exclusive lock on the iteration dir it
replaces (``--in-place``) and a shared one on the source it reads (``--output``); a second writer fails at
once with one line naming the checkpoint instead of racing the first one's backups and renames.

The lock is taken on the directory (``flock`` of a descriptor of the iteration dir), so nothing is created:
a read-only source can be locked, an ``--output`` run leaves its source byte-identical even when killed, and
there is no lock file for ``check`` to report or for a copy to carry over. ``strip-frozen --in-place`` also
locks its staging dir before the atomic swap, so a second writer finds a locked dir under the name before,
during and after the swap. Where a filesystem cannot ``flock`` a directory (some network filesystems), an
exclusive lock falls back to a lock file beside the dir, ``<parent>/.<dir name>.ckptdoctor.lock``, removed
when released. The kernel drops the locks of a process that dies, so a kill never leaves a stale lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor.errors import CkptError
from ckptdoctor.write_guard import refuse_remote_write

try:
    import fcntl
except ImportError:  # no flock (Windows): writes run unlocked there
    fcntl = None  # type: ignore[assignment]

LOCK_SUFFIX = ".ckptdoctor.lock"


def lock_file_path(directory: Path) -> Path:
    """The fallback lock file of ``directory`` (beside it, keyed by its real path)."""
    real = Path(os.path.realpath(directory))
    return real.parent / f".{real.name}{LOCK_SUFFIX}"


def is_lock_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(LOCK_SUFFIX)


def _busy(directory: Path) -> CkptError:
    return CkptError(
        f"{directory}: another ckptdoctor command is writing this checkpoint (it holds the lock); "
        "run again when it has finished"
    )


_NO_DIR_FLOCK = (errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)


@dataclass
class _Held:
    fds: list[int]
    exclusive: bool
    lock_file: Path | None = None
    count: int = 1
    extra: list[int] = field(default_factory=list)


_held: dict[str, _Held] = {}  # real dir path -> the lock this process holds (re-entrant)


def _lock_fd(fd: int, exclusive: bool) -> None:
    fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)


def _lock_file(directory: Path) -> tuple[int, Path]:
    """The fallback: an exclusive flock on a lock file beside ``directory``, verified to still be linked."""
    path = lock_file_path(directory)
    while True:
        try:
            # O_NOFOLLOW: a symlink planted under the lock file's name (a save dir from someone else) would make
            # this open create an empty file wherever it points
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            if path.is_symlink():
                raise CkptError(f"{path}: the lock file is a symlink; refusing to follow it (remove it)") from None
            raise CkptError(f"{path}: cannot create the lock file ({exc.strerror})") from None
        try:
            _lock_fd(fd, True)
        except BlockingIOError:
            os.close(fd)
            raise _busy(directory) from None
        except OSError as exc:
            os.close(fd)
            raise CkptError(f"{path}: cannot lock ({exc.strerror})") from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd, path
        except FileNotFoundError:
            pass
        os.close(fd)  # removed by its last holder between our open and our flock: take the new one


def _open_dir(directory: Path) -> int:
    try:
        return os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CkptError(f"{directory}: cannot open to lock ({exc.strerror})") from None


@contextlib.contextmanager
def checkpoint_lock(directory: Path, *, exclusive: bool = True, optional: bool = False) -> Iterator[None]:
    """Hold the lock of ``directory`` (an iteration dir or an output dir) for the ``with`` block.

    Re-entrant within one process. Raises :class:`CkptError` (one line, exit 2) when another process holds
    it. ``optional``: go on unlocked where the filesystem cannot lock (a shared lock on a read-only source).
    Every write takes one, so a checkpoint on object storage is refused here (``exclusive``: in place).
    """
    refuse_remote_write(directory, in_place=exclusive)
    if fcntl is None:
        yield
        return
    key = os.path.realpath(directory)
    held = _held.get(key)
    if held is not None:
        if exclusive and not held.exclusive:
            raise CkptError(f"{directory}: internal lock misuse (shared lock held, exclusive wanted)")
        held.count += 1
        try:
            yield
        finally:
            held.count -= 1
        return
    fd = _open_dir(directory)
    lock_file: Path | None = None
    fds = [fd]
    try:
        _lock_fd(fd, exclusive)
    except BlockingIOError:
        os.close(fd)
        raise _busy(directory) from None
    except OSError as exc:
        os.close(fd)
        fds = []
        if exc.errno not in _NO_DIR_FLOCK:
            raise CkptError(f"{directory}: cannot lock ({exc.strerror})") from None
        if exclusive or not optional:
            file_fd, lock_file = _lock_file(directory)
            fds = [file_fd]
    held = _Held(fds, exclusive, lock_file)
    _held[key] = held
    try:
        yield
    finally:
        del _held[key]
        _release(held)


def _release(held: _Held) -> None:
    if held.lock_file is not None:
        with contextlib.suppress(OSError):
            if os.fstat(held.fds[0]).st_ino == os.stat(held.lock_file).st_ino:
                os.unlink(held.lock_file)
    for fd in held.fds + held.extra:
        with contextlib.suppress(OSError):
            os.close(fd)


def also_lock(owner: Path, directory: Path) -> None:
    """While ``owner``'s exclusive lock is held, lock ``directory`` too (released with it). Used for the
    staging dir that ``strip-frozen --in-place`` swaps in: the name stays locked across the swap."""
    held = _held.get(os.path.realpath(owner))
    if held is None or not held.exclusive:
        return
    fd = _open_dir(directory)
    try:
        _lock_fd(fd, True)
    except OSError:
        os.close(fd)  # a fresh dir nobody else knows about: only an unsupported flock fails here
        return
    held.extra.append(fd)
