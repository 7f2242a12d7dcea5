"""Crash-safe file writes: temp file + fsync + rename, backups, hard-link-or-copy of unchanged files.

Every file ckptdoctor writes goes through here. ``fault_point`` lets tests kill the process between
write steps (``CKPTDOCTOR_FAULT_AT=<step>``) to prove the source stays loadable.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import os
import shutil
import sys
from pathlib import Path

from ckptdoctor.errors import CkptError

FAULT_ENV = "CKPTDOCTOR_FAULT_AT"
FAULT_EXIT_CODE = 97


def fault_point(step: str) -> None:
    """Test hook: exit abruptly (no cleanup, like a kill) when ``CKPTDOCTOR_FAULT_AT`` names this step."""
    if os.environ.get(FAULT_ENV) == step:
        os._exit(FAULT_EXIT_CODE)


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the complete new one, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CkptError(f"{path}: cannot write ({exc.strerror})") from None
    fsync_dir(path.parent)


def timestamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%dT%H%M%S")


def backup_file(path: Path, stamp: str) -> Path:
    """Keep the current ``path`` as ``<name>.bak-<stamp>`` (a hard link: instant, no bytes copied)."""
    backup = path.with_name(f"{path.name}.bak-{stamp}")
    if backup.exists():
        raise CkptError(f"{backup}: backup already exists; refusing to overwrite it")
    try:
        os.link(path, backup)
    except OSError:
        try:
            shutil.copy2(path, backup)
            with open(backup, "rb+") as f:
                os.fsync(f.fileno())
        except OSError as exc:
            raise CkptError(f"{path}: cannot back up to {backup.name} ({exc.strerror})") from None
    fsync_dir(path.parent)
    return backup


def link_or_copy(src: Path, dst: Path) -> str:
    """Hard-link ``src`` to ``dst`` (same filesystem) or copy it; returns "linked" or "copied"."""
    try:
        os.link(src, dst)
        return "linked"
    except OSError:
        try:
            shutil.copy2(src, dst)
        except OSError as exc:
            raise CkptError(f"{src}: cannot copy to {dst} ({exc.strerror})") from None
        return "copied"


def prepare_output_dir(output: Path, force: bool = False) -> None:
    """Refuse an output dir that exists and is not empty (unless ``force``); create it otherwise."""
    if output.exists():
        if not output.is_dir():
            raise CkptError(f"{output}: exists and is not a directory")
        if any(output.iterdir()) and not force:
            raise CkptError(f"{output}: exists and is not empty (use --force to write into it)")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CkptError(f"{output}: cannot create ({exc.strerror})") from None


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported.

    Readers see either the old or the new directory under each name, never a missing one.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False  # this filesystem or kernel cannot exchange: the caller falls back to two renames
    raise CkptError(f"{a}: cannot swap with {b.name} ({os.strerror(err)})")
