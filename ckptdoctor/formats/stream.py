"""Sequential, bounded-memory reads of many byte ranges, and a lean reader for ``torch.save`` zip directories.

``--deep`` visits every chunk of a checkpoint: tens of thousands of ranges. Opening the file and parsing the
archive with :mod:`zipfile` for each one costs more than reading its bytes, so each file is read front to back
in windows through two reusable buffers, one filled by a read-ahead thread while the other is parsed (memory
is bounded by two windows or two chunks), and each blob's zip directory is parsed with :mod:`struct` directly.
Archives this reader does not handle (zip64, compressed members, comments) raise :class:`UnsupportedZip`;
callers fall back to ``zipfile``.
"""

from __future__ import annotations

import queue
import struct
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.files import open_regular

T = TypeVar("T")
DEFAULT_WINDOW = 1 << 20  # one syscall per MiB; a reused buffer, so no page faults per read

_EOCD = struct.Struct("<4s4H2LH")  # signature, disk, cd disk, entries here, entries total, cd size, cd offset, comment
_CDIR = struct.Struct("<4s6H3L5H2L")  # central directory file header (46 bytes)
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header (30 bytes)


def _plan(ranges: Iterable[tuple[int, int, T]], window: int) -> Iterator[tuple[int, int, list[tuple[int, int, T]]]]:
    """Group ranges sorted by offset into reads: (start, length, ranges inside it); length >= the longest range."""
    start = end = -1
    group: list[tuple[int, int, T]] = []
    for rng in ranges:
        offset, length, _ = rng
        if group and offset >= start and offset + length <= start + max(window, end - start):
            group.append(rng)
            end = max(end, offset + length)
            continue
        if group:
            yield start, end - start, group
        start, end, group = offset, offset + length, [rng]
    if group:
        yield start, end - start, group


_DONE = object()


def _windows(files: Iterable[tuple[Path, Iterable[tuple[int, int, T]]]], window: int,
             take: Any) -> Iterator[tuple[Path, int | CkptError, int, Any, list[tuple[int, int, T]]]]:
    """(path, window start or error, bytes read, buffer, ranges in it) for each read; ``take()`` gives a buffer."""
    for path, ranges in files:
        try:
            f = open_regular(path, buffering=0)  # closed below; raw reads into our buffers
        except CkptError as exc:
            yield path, exc, 0, None, []
            continue
        with f:
            for start, length, group in _plan(ranges, window):
                buf = take()
                if len(buf) < length:  # a chunk larger than the window: grow this buffer (it is reused after)
                    buf = bytearray(length)
                try:
                    f.seek(start)
                    got = _read_into(f, buf, length)
                except OSError as exc:
                    yield path, CkptError(f"{path}: cannot read ({exc.strerror})"), 0, buf, []
                    break
                yield path, start, got, buf, group
                if got < length:
                    break


def read_ranges(files: Iterable[tuple[Path, Iterable[tuple[int, int, T]]]], window: int = DEFAULT_WINDOW,
                read_ahead: bool = False) -> Iterator[tuple[Path, T | None, memoryview | CkptError]]:
    """Yield ``(path, tag, bytes)`` for every range of every file, reading each file front to back.

    Ranges of one file must be sorted by offset. With ``read_ahead`` a background thread reads the next
    window while the caller works on the current one (reads release the GIL), through two reusable buffers:
    at most two windows (each ``window`` bytes, or one chunk if larger) are in memory. A memoryview is only
    valid until the next item: copy what you keep. A file that cannot be read, or ends before a range does,
    yields ``(path, None, CkptError)`` once, and its remaining ranges are skipped.
    """
    pool: queue.Queue[bytearray] = queue.Queue()
    for _ in range(2 if read_ahead else 1):
        pool.put(bytearray(window))
    if not read_ahead:
        yield from _serve(_windows(files, window, pool.get), pool, window)
        return
    ready: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def reader() -> None:
        try:
            for item in _windows(files, window, pool.get):
                if stop.is_set():
                    return
                ready.put(item)
        finally:
            ready.put(_DONE)

    thread = threading.Thread(target=reader, name="ckptdoctor-read-ahead", daemon=True)
    thread.start()
    try:
        yield from _serve(iter(ready.get, _DONE), pool, window)
    finally:
        stop.set()
        while thread.is_alive():  # unblock the reader if the caller stopped early
            try:
                ready.get_nowait()
            except queue.Empty:
                pass
            pool.put(bytearray(0))
            thread.join(timeout=0.05)


def _serve(windows: Iterable[tuple], pool: queue.Queue, window: int
           ) -> Iterator[tuple[Path, Any, memoryview | CkptError]]:
    for path, start, got, buf, group in windows:
        if isinstance(start, CkptError):
            yield path, None, start
        else:
            view = memoryview(buf)
            for offset, length, tag in group:
                if offset - start + length > got:
                    yield path, None, CkptError(f"{path}: truncated: range {offset}+{length} ends past the file's end")
                    break
                yield path, tag, view[offset - start:offset - start + length]
            view.release()
        if isinstance(buf, bytearray):
            pool.put(buf)


def _read_into(f: Any, buf: bytearray, length: int) -> int:
    view = memoryview(buf)
    got = 0
    try:
        while got < length:
            n = f.readinto(view[got:length])
            if not n:
                break
            got += n
    finally:
        view.release()
    return got


class UnsupportedZip(ValueError):
    """An archive feature the lean reader leaves to :mod:`zipfile` (zip64, compression, a comment)."""


def zip_members(blob: memoryview | bytes) -> dict[str, tuple[int, int]]:
    """name -> (local header offset, size) of each stored member of a zip held in memory.

    Raises :class:`UnsupportedZip` for what it does not handle and ``ValueError`` for a damaged archive;
    :func:`member_data` locates a member's bytes.
    """
    size = len(blob)
    if size < _EOCD.size:
        raise ValueError("too short for a zip archive")
    sig, _, _, _, entries, cd_size, cd_offset, _ = _EOCD.unpack_from(blob, size - _EOCD.size)
    if sig != b"PK\x05\x06":
        raise UnsupportedZip("no end-of-directory record at the very end (comment or damage)")
    if entries == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        raise UnsupportedZip("zip64 archive")
    cd_end = cd_offset + cd_size
    if cd_end > size - _EOCD.size:
        raise ValueError("central directory lies past the end of the archive")
    members: dict[str, tuple[int, int]] = {}
    pos = cd_offset
    unpack = _CDIR.unpack_from
    for _ in range(entries):
        if pos + _CDIR.size > cd_end:
            raise ValueError("central directory is truncated")
        sig, _, _, _, method, _, _, _, compressed, plain, name_len, extra_len, comment_len, _, _, _, local = \
            unpack(blob, pos)
        if sig != b"PK\x01\x02":
            raise ValueError("bad central directory entry")
        if method != 0 or compressed != plain:
            raise UnsupportedZip("compressed member")
        if plain == 0xFFFFFFFF or local == 0xFFFFFFFF:
            raise UnsupportedZip("zip64 member")
        if local >= cd_offset:
            raise ValueError("member header past the central directory")
        name_start = pos + _CDIR.size
        members[str(blob[name_start:name_start + name_len], "utf-8", "replace")] = (local, plain)
        pos = name_start + name_len + extra_len + comment_len
    if pos > cd_end:
        raise ValueError("central directory entries overrun the directory")
    return members


def member_data(blob: memoryview | bytes, member: tuple[int, int], cd_limit: int | None = None) -> tuple[int, int]:
    """(data offset, size) of a member from :func:`zip_members`, checked against its local header."""
    local, size = member
    if local + _LOCAL.size > len(blob):
        raise ValueError("local header past the end of the archive")
    sig, _, _, _, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(blob, local)
    if sig != b"PK\x03\x04":
        raise ValueError("bad local header")
    start = local + _LOCAL.size + name_len + extra_len
    if start + size > (len(blob) if cd_limit is None else cd_limit):
        raise ValueError("member data runs past the end of the archive")
    return start, size
