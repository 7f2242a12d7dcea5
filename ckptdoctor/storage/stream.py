"""Sequential, bounded-memory reads of many byte ranges.

``--deep`` visits every chunk of a checkpoint: tens of thousands of ranges. Opening the file for each one costs
more than reading its bytes, so each file is read front to back in windows through one reusable buffer (memory
is bounded by one window or one chunk; a remote file is fetched ahead by its storage backend). Each blob is then
decoded by :mod:`ckptdoctor.formats.archive`, the one ``torch.save`` archive reader.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ckptdoctor.errors import CkptError
from ckptdoctor.storage.files import open_regular

T = TypeVar("T")
DEFAULT_WINDOW = 1 << 20  # one syscall per MiB; a reused buffer, so no page faults per read


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


def _windows(
    files: Iterable[tuple[Path, Iterable[tuple[int, int, T]]]], window: int, take: Any
) -> Iterator[tuple[Path, int | CkptError, int, Any, list[tuple[int, int, T]]]]:
    """(path, window start or error, bytes read, buffer, ranges in it) for each read; ``take()`` gives a buffer."""
    for path, ranges in files:
        try:
            f = open_regular(path, buffering=0)  # closed below; raw reads into our buffers
        except CkptError as exc:
            yield path, exc, 0, None, []
            continue
        with f:
            plan = list(_plan(ranges, window))
            will_read = getattr(f, "will_read", None)
            if will_read is not None:  # a remote file: fetched ahead, coalesced, concurrently
                will_read([(start, length) for start, length, _ in plan])
            for start, length, group in plan:
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


def read_ranges(
    files: Iterable[tuple[Path, Iterable[tuple[int, int, T]]]], window: int = DEFAULT_WINDOW
) -> Iterator[tuple[Path, T | None, memoryview | CkptError]]:
    """Yield ``(path, tag, bytes)`` for every range of every file, reading each file front to back.

    Ranges of one file must be sorted by offset; neighbours are read together in windows of ``window`` bytes
    (or one chunk if larger) into one reused buffer. A memoryview is only valid until the next item: copy what
    you keep. A file that cannot be read, or ends before a range does, yields ``(path, None, CkptError)`` once,
    and its remaining ranges are skipped.
    """
    buffers = [bytearray(window)]
    yield from _serve(_windows(files, window, buffers.pop), buffers.append)


def _serve(windows: Iterable[tuple], give_back: Any) -> Iterator[tuple[Path, Any, memoryview | CkptError]]:
    for path, start, got, buf, group in windows:
        if isinstance(start, CkptError):
            yield path, None, start
        else:
            view = memoryview(buf)
            for offset, length, tag in group:
                if offset - start + length > got:
                    yield path, None, CkptError(f"{path}: truncated: range {offset}+{length} ends past the file's end")
                    break
                yield path, tag, view[offset - start : offset - start + length]
            view.release()
        if isinstance(buf, bytearray):
            give_back(buf)


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
