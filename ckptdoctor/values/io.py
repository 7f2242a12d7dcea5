"""Streaming plumbing for ``diff --values``: kept file descriptors, bytes in flight, progress, lazy torch.

Each worker (:mod:`ckptdoctor.parallel`: a forked process or a torchrun rank) has its own :class:`Context` and
compares one key at a time, so memory stays bounded by the chunks of one key; :class:`InFlight` counts them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.torch_dist import check_range_length
from ckptdoctor.storage.files import open_handle
from ckptdoctor.storage.remote import RemotePath
from ckptdoctor.values import read

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint, Entry
    from ckptdoctor.values.health_tap import HealthTap


def _soft_fd_limit() -> int:
    try:
        import resource

        return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, ValueError, OSError):
        return 1024


class Files:
    """Open data files, reused across chunks (thousands of chunks share a few files); one per worker.

    ``os.pread`` on a kept descriptor saves an open/close and a path join per chunk, which on a 20,000-key
    checkpoint costs more than reading its small chunks.
    """

    # One key of a TP=64 checkpoint spans 64 files of A and more of B: the cache holds every file one key
    # reads (re-opening per chunk cost 125k os.open calls on a TP64 diff), within a quarter of RLIMIT_NOFILE.
    MAX_OPEN = max(64, min(1024, _soft_fd_limit() // 4))

    def __init__(self) -> None:
        self.fds: OrderedDict[tuple[int, str], Any] = OrderedDict()  # handles from storage.files.open_handle
        self.plans: dict[tuple[int, str], list[tuple[int, int]]] = {}

    def plan(self, ckpt: Checkpoint, entries: Iterable[Entry]) -> None:
        """The chunks about to be read (a run of keys), handed to each file when it is opened: object storage
        then fetches them in few coalesced requests, each range once."""
        if not isinstance(ckpt.iteration_dir, RemotePath):
            return  # a local file reads each range with pread: nothing to plan
        for entry in entries:
            for chunk in entry.chunks:
                if chunk.storage is not None:
                    where = (id(ckpt), chunk.storage.relative_path)
                    self.plans.setdefault(where, []).append((chunk.storage.offset, chunk.storage.length))

    def read(self, ckpt: Checkpoint, location: Any, max_length: int | None = None) -> bytes:
        """One byte range; refused when longer than ``max_length`` (``Entry.max_range_bytes``)."""
        name = (id(ckpt), location.relative_path)
        if max_length is not None and location.length > max_length:
            check_range_length(ckpt.iteration_dir / location.relative_path, location, max_length)  # raises
        fd = self.fds.get(name)
        try:
            if fd is None:
                if len(self.fds) >= self.MAX_OPEN:
                    self.fds.popitem(last=False)[1].close()
                fd = self.fds[name] = open_handle(
                    ckpt.iteration_dir / location.relative_path, self.plans.pop(name, None)
                )
            else:
                self.fds.move_to_end(name)
            data = fd.pread(location.length, location.offset)
        except OSError as exc:
            raise CkptError(f"{ckpt.iteration_dir / location.relative_path}: cannot read ({exc.strerror})") from None
        if len(data) != location.length:
            path = ckpt.iteration_dir / location.relative_path
            raise CkptError(f"{path}: truncated: range {location.offset}+{location.length} ends past the file's end")
        return data

    def close(self) -> None:
        while self.fds:
            self.fds.popitem()[1].close()


class InFlight:
    """Bytes of chunk data one worker holds, counted (``peak``: the most at once, reported as ``peak_in_flight``).

    Each worker (a forked process or torchrun rank, each with its own :class:`Context`) holds one key's chunks at a
    time, which bounds its memory; this only measures it (``limit`` is kept for callers that pass one).
    """

    def __init__(self, limit: int = 1 << 62) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0

    def acquire(self, n: int) -> None:
        self.used += n
        if self.used > self.peak:
            self.peak = self.used

    def release(self, n: int) -> None:
        self.used -= n


class ReadCounter:
    """Bytes read so far, per side; each read is also passed to ``advance`` (a progress bar's)."""

    def __init__(self, advance: Callable[[int], None] | None) -> None:
        self.a = 0
        self.b = 0
        self.advance = advance

    def add(self, side: str, n: int) -> None:
        if side == "a":
            self.a += n
        else:
            self.b += n
        if self.advance is not None:
            self.advance(n)


class Torch:
    """torch, imported on first need (a diff of byte-identical chunks never needs it) and run on one thread.

    Chunk compares are short and memory-bound: an OpenMP fork/join per call cost 10x the compare itself
    (3.9 s vs 0.45 s for 540 MB of 200 KB chunks on a busy 2-core host). The thread count is restored after.
    """

    def __init__(self) -> None:
        self.torch: Any = None
        self.threads: int | None = None
        self.lock = threading.Lock()

    def get(self) -> Any:
        with self.lock:
            if self.torch is None:
                torch = read.require_torch("comparing tensor values")
                self.threads = torch.get_num_threads()
                torch.set_num_threads(1)
                self.torch = torch
        return self.torch

    def restore(self) -> None:
        if self.torch is not None and self.threads is not None:
            self.torch.set_num_threads(self.threads)


class Context:
    """What one worker needs: its read counter, the in-flight cap and torch; its own file descriptors."""

    def __init__(self, read: ReadCounter, inflight: InFlight, torch: Torch) -> None:
        self.read = read
        self.inflight = inflight
        self.torch = torch
        self.files = Files()
        # byte ranges read ahead for the key being compared ((side, id(chunk)) -> bytes), taken by the first use
        self.preread: dict[tuple[str, int], bytes] = {}
        self.health: HealthTap | None = None  # diff --values --stats: every chunk read is measured too
