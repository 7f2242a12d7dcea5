"""Opening a checkpoint's files: regular files only.

A name in a checkpoint dir can be a FIFO, a device or a directory; ``open()`` on a FIFO blocks until a writer
appears (a hang), and reading a device can return endless bytes. Every reader opens through here.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

from ckptdoctor.errors import CkptError


def open_regular(path: str | os.PathLike, buffering: int = -1) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (never blocking on a FIFO); else :class:`CkptError`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CkptError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise CkptError(f"{Path(path)}: cannot read ({kind})")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise
