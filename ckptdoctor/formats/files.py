"""Opening a checkpoint's files: regular files only.

A name in a checkpoint dir can be a FIFO, a device or a directory; ``open()`` on a FIFO blocks until a writer
appears (a hang), and reading a device can return endless bytes. Every reader opens through here.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

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


MAX_JSON_BYTES = 64 << 20  # metadata.json, integrity.json (a line per file), .zarray: far below this


def read_json(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a small JSON file of a checkpoint (``metadata.json``, ``integrity.json``, ``.zarray``, ...).

    Raises ``OSError`` when it cannot be read as a regular file (a FIFO is an error, never a hang) and
    ``json.JSONDecodeError`` for every content problem, including a file over ``max_bytes`` and nesting deep
    enough to exhaust the parser's recursion (``[[[[...]]]]``), so callers' existing handlers cover all of it.
    """
    try:
        with open_regular(path) as f:
            raw = f.read(max_bytes + 1)
    except CkptError as exc:
        raise OSError(errno.EINVAL, str(exc).rsplit("(", 1)[-1].rstrip(")")) from None
    if len(raw) > max_bytes:
        raise json.JSONDecodeError(f"larger than {max_bytes} bytes", "", 0)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"not UTF-8 ({exc.reason})", "", exc.start) from None
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
