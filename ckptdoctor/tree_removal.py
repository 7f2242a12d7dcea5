"""Removing a directory tree written or displaced by a write (``--no-backup``, a staging dir, a replaced output).

Apart from :mod:`ckptdoctor.atomic` (writes that must survive a crash): a removal only has to finish, whatever
the tree holds.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def remove_tree(path: Path, ignore_errors: bool = False) -> None:
    """``shutil.rmtree`` without recursion: Python 3.11's recurses once per level, so a dir nested past the
    recursion limit (a few KB of hostile tree inside a checkpoint) raised RecursionError, which ``ignore_errors``
    does not cover. This walks down and back up by dir fds (two open at most, no path-length limit), never
    following a symlink (a link is removed, not what it names). ``ignore_errors``: an OSError leaves the rest."""
    try:
        _remove_tree(path)
    except OSError:
        if not ignore_errors:
            raise


def _remove_tree(path: Path) -> None:
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or a symlink: removed itself
            os.unlink(path)
            return
        raise
    below: list[str] = []  # the dirs descended into, from ``path`` down
    try:
        while True:
            child, emptied = None, False
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
                    emptied = True
            if child is not None:
                inner = os.open(child, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = inner
                below.append(child)
            elif emptied:
                continue  # scan again: an empty scan is the proof the dir is empty
            elif below:
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                os.rmdir(below.pop(), dir_fd=fd)
            else:
                break
    finally:
        os.close(fd)
    os.rmdir(path)
