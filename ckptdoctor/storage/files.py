"""Opening a checkpoint's files: regular files only.

A name in a checkpoint dir can be a FIFO, a device or a directory; ``open()`` on a FIFO blocks until a writer
appears (a hang), and reading a device can return endless bytes. Every reader opens through here, and lists
through here: a URL's :class:`~ckptdoctor.storage.remote.RemotePath` is opened as a file of ranged reads.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import mmap
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ckptdoctor.errors import CkptError
from ckptdoctor.storage.interface import StorageUnavailable
from ckptdoctor.storage.remote import RemotePath


def open_regular(path: str | os.PathLike | RemotePath, buffering: int = -1) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (never blocking on a FIFO); else :class:`CkptError`."""
    if isinstance(path, RemotePath):
        try:
            return path.open_file()  # type: ignore[return-value]
        except OSError as exc:
            raise CkptError(f"{path}: cannot read ({exc.strerror})") from None
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
    except BaseException:
        os.close(fd)
        raise
    # Not in the try: the file object owns the descriptor. A signal handled right after this call frees it, which
    # closes the descriptor; closing it again failed (EBADF, reported instead of the interrupt) or closed another file.
    return os.fdopen(fd, "rb", buffering=buffering)


class TooLarge(Exception):
    """A file whose size, known before any byte of it is read (``fstat``, or a remote object's listed size), is over
    the limit a reader was given: refused with nothing read. Each reader words the refusal as its own (see its
    callers); a file that only grows past the limit while it is read comes back as ``max_bytes + 1`` bytes instead."""

    def __init__(self, size: int, max_bytes: int) -> None:
        super().__init__(f"{size} bytes, over the limit of {max_bytes} bytes")
        self.size = size
        self.max_bytes = max_bytes


def known_size(f: BinaryIO) -> int | None:
    """The size of an open file before reading it: a local file's ``fstat``, a remote file's from the stat it was
    opened with; None where neither is known."""
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        size = getattr(f, "size", None)  # storage.remote.RemoteFile
        return size if isinstance(size, int) else None


def read_capped(f: BinaryIO, max_bytes: int) -> bytes:
    """At most ``max_bytes + 1`` bytes of ``f`` (so the caller can tell a file that grew over the limit while it was
    read), without reserving more memory than the file holds: ``read(n)`` allocates ``n`` up front, and a 1 GiB
    pickle limit must not cost a 7 MB ``.metadata`` a 1 GiB allocation (which an address-space limit refuses).
    Raises :class:`TooLarge` where the file's size is over ``max_bytes`` before anything is read: a 2 GB file is
    refused on its size, not after the first GiB of it was read into memory."""
    size = known_size(f)
    if size is None:
        return f.read(max_bytes + 1)
    if size > max_bytes:
        raise TooLarge(size, max_bytes)
    data = f.read(size + 1)
    if len(data) <= size:
        return data
    return data + f.read(max_bytes - len(data) + 1)  # it grew while read: up to the limit


RELEASABLE_MIN_BYTES = 4 << 20  # below this a file is read as bytes (a map's pages are no saving there)


def read_releasable(f: BinaryIO, max_bytes: int) -> bytes | mmap.mmap:
    """:func:`read_capped`, but a large regular file (:data:`RELEASABLE_MIN_BYTES` up to ``max_bytes``) comes in
    an anonymous memory map of its own, exactly as long as what was read, which nothing else sees: the memo pruning
    reader may give its pages back to the system as it translates them (``release``), so that a large
    ``.metadata`` is not held whole while its objects are built. Anything else (small, not a plain file, changed in
    size while read) is :func:`read_capped`'s bytes; a file over the limit is :class:`TooLarge`, nothing read."""
    try:
        size = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return read_capped(f, max_bytes)  # a remote file: refused on its listed size there
    if size > max_bytes:
        raise TooLarge(size, max_bytes)
    if not max(1, RELEASABLE_MIN_BYTES) <= size < max_bytes:  # (an empty map is an error)
        return read_capped(f, max_bytes)
    start = f.tell()
    mapped = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # private: a page given back is freed (shared: kept)
    got = 0
    try:
        with memoryview(mapped) as view:
            while got < size:  # a raw file may read short
                more = f.readinto(view[got:])  # type: ignore[attr-defined]
                if not more:
                    break
                got += more
        whole = got == size and not f.read(1)
    except BaseException:
        mapped.close()
        raise
    if whole:
        return mapped
    mapped.close()
    f.seek(start)  # it shrank or grew while read: read again, as bytes
    return read_capped(f, max_bytes)


def read_small_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The whole of a small text file (a config, a run config), read only as a regular file (a FIFO is an error,
    never a hang) of at most ``max_bytes``; else :class:`CkptError` naming it."""
    try:
        with open_regular(path) as f:
            raw = read_capped(f, max_bytes)
    except OSError as exc:
        raise CkptError(f"{path}: cannot read ({exc.strerror})") from None
    except TooLarge:
        raise CkptError(f"{path}: larger than {max_bytes} bytes; not read") from None
    if len(raw) > max_bytes:  # it grew over the limit while read
        raise CkptError(f"{path}: larger than {max_bytes} bytes; not read")
    return raw


MAX_JSON_BYTES = 64 << 20  # metadata.json, integrity.json (a line per file), .zarray: far below this


def read_json(path: str | os.PathLike | RemotePath, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a small JSON file of a checkpoint (``metadata.json``, ``integrity.json``, ``.zarray``, ...).

    Raises ``OSError`` when it cannot be read as a regular file (a FIFO is an error, never a hang) and
    ``json.JSONDecodeError`` for every content problem, including a file over ``max_bytes``, nesting deep
    enough to exhaust the parser's recursion (``[[[[...]]]]``) and an int of more than 40 digits (no checkpoint
    JSON holds one; thousands of digits overflow every float and Python's printing), so callers' existing
    handlers cover all of it.
    """
    try:
        with open_regular(path) as f:
            raw = read_capped(f, max_bytes)
    except StorageUnavailable:
        raise  # the storage failed, not the file: the command stops (exit 2), no finding about the checkpoint
    except CkptError as exc:
        raise OSError(errno.EINVAL, str(exc).rsplit("(", 1)[-1].rstrip(")")) from None
    except TooLarge:
        raise json.JSONDecodeError(f"larger than {max_bytes} bytes", "", 0) from None
    if len(raw) > max_bytes:  # it grew over the limit while read
        raise json.JSONDecodeError(f"larger than {max_bytes} bytes", "", 0)
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_json_int)
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"not UTF-8 ({exc.reason})", "", exc.start) from None
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except _LongInt as exc:
        raise json.JSONDecodeError(f"an integer of {exc.args[0]} digits", "", 0) from None


class _LongInt(ValueError):
    pass


MAX_JSON_INT_DIGITS = 40  # int64 has 19; an int of thousands of digits overflows floats and Python's printing


def _json_int(text: str) -> int:
    if len(text) > MAX_JSON_INT_DIGITS:
        raise _LongInt(len(text.lstrip("-")))
    return int(text)


class Handle:
    """A data file kept open for many reads at given offsets (``os.pread`` on a kept descriptor)."""

    def __init__(self, path: Path) -> None:
        with open_regular(path) as f:
            self.fd = os.dup(f.fileno())

    def pread(self, length: int, offset: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def close(self) -> None:
        os.close(self.fd)


def open_handle(path: Path | RemotePath, planned: list[tuple[int, int]] | None = None) -> Handle | Any:
    """A file for repeated ranged reads (``pread(length, offset)``, ``close()``); :class:`CkptError` if it
    cannot be opened. ``planned``: the (offset, length) ranges the reader will ask for, in any order; a remote
    file coalesces them into few requests, each range fetched once (a local file reads each with ``pread``)."""
    if isinstance(path, RemotePath):
        handle = open_regular(path)
        if planned:
            handle.plan(planned)  # type: ignore[attr-defined]
        return handle
    return Handle(path)


def list_names(directory: Path | RemotePath) -> list[str]:
    """``os.listdir`` for a local dir or a remote prefix (``OSError`` when it cannot be listed)."""
    if isinstance(directory, RemotePath):
        return directory.listdir()
    return os.listdir(directory)


def list_tree(directory: Path | RemotePath) -> None:
    """A hint that everything below ``directory`` will be listed: one recursive listing of a remote prefix
    (instead of one per sub-directory); nothing for a local dir."""
    if isinstance(directory, RemotePath):
        directory.store.list_tree(directory.key)


def file_sizes(directory: Path | RemotePath) -> dict[str, int]:
    """Regular files directly in ``directory`` and their sizes (one scandir, or one listing: no opens)."""
    if isinstance(directory, RemotePath):
        return {name: size for name, (size, is_dir) in directory.sizes().items() if not is_dir}
    files: dict[str, int] = {}
    with os.scandir(directory) as it:
        for dirent in it:
            size = _listed_size(dirent)
            if size is not None:
                files[dirent.name] = size
    return files


def _listed_size(dirent: os.DirEntry[str]) -> int | None:
    """The size of a listed regular file; None for anything else, or for a file removed since the listing (another
    writer's temp file renamed into place while a checkpoint is read: not an error of the reader's)."""
    if not dirent.is_file():
        return None
    try:
        return dirent.stat().st_size
    except FileNotFoundError:
        return None


def tree_bytes(directory: Path | RemotePath) -> tuple[int, int]:
    """The total size and the number of the regular files under ``directory``, subdirs included (no opens: one
    scandir per dir, or the listings of a remote prefix). A symlinked file counts as its target; a symlinked dir
    is not entered (it is another tree's)."""
    total = count = 0
    if isinstance(directory, RemotePath):
        list_tree(directory)
        stack = [directory]
        while stack:
            below = stack.pop()
            for name, (size, is_dir) in below.sizes().items():
                if is_dir:
                    stack.append(below / name)
                else:
                    total, count = total + size, count + 1
        return total, count
    local = [directory]
    while local:
        with os.scandir(local.pop()) as it:
            for dirent in it:
                if dirent.is_dir(follow_symlinks=False):
                    local.append(Path(dirent.path))
                elif (listed := _listed_size(dirent)) is not None:
                    total, count = total + listed, count + 1
    return total, count


def check_regular(path: Path | RemotePath) -> None:
    """Raise ``OSError`` unless ``path`` can be opened as a regular file (``FileNotFoundError`` when missing);
    never blocks on a FIFO."""
    if isinstance(path, RemotePath):
        path.open_file().close()
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
    finally:
        os.close(fd)
