"""Write a subset of a torch_dist checkpoint: kept items byte-copied into new data files, a new ``.metadata``.

Nothing is decoded: every kept chunk or bytes item is one ``torch.save`` blob (or raw bytes) at a byte range,
and a range copied verbatim is the same item. Copies stream in bounded blocks (``os.copy_file_range`` where
the kernel offers it, a read/write loop otherwise), so memory stays flat whatever the checkpoint size.

Each source data file's kept items go, in source order, into a new file of the same name, so writer ranks
(``__<rank>_<n>.distcp``) still read the same. The new ``.metadata`` is the source object (safe-pickle
stand-ins) with dropped keys removed and storage repointed; it pickles back to the real torch classes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.formats import torch_dist
from ckptdoctor.formats.torch_dist import StorageLocation

BLOCK = 8 << 20  # bytes per copy step: bounded memory, and the progress callback's granularity

Progress = Callable[[int], None]


@dataclass
class CopiedFile:
    name: str
    items: int
    bytes: int


def kept_storage(metadata: Any, keep: set[str]) -> dict[str, list[tuple[Any, Any]]]:
    """Source data file -> [(MetadataIndex, _StorageInfo)] of kept items, in source byte order."""
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in torch_dist.storage_items(metadata).items():
        if torch_dist.index_fqn(index) in keep:
            by_file.setdefault(str(torch_dist.record_attr(info, "relative_path")), []).append((index, info))
    for items in by_file.values():
        items.sort(key=lambda pair: int(torch_dist.record_attr(pair[1], "offset")))
    return dict(sorted(by_file.items()))


@dataclass
class FileCopy:
    """One new data file: the source file's kept byte ranges, copied back to back (adjacent ranges merged)."""

    name: str
    items: int
    ranges: list[tuple[int, int]]  # (source offset, length)
    bytes: int


def plan_copies(by_file: dict[str, list[tuple[Any, Any]]]) -> list[FileCopy]:
    """Lay out the new data files and repoint every kept ``_StorageInfo`` stand-in to its place in them.

    Each source file's kept items go, in source byte order, back to back into a new file of the same name;
    items that are adjacent in the source become one range (one kernel copy instead of one per item: the
    bytes written are the same). The storage is repointed before a byte is copied, so the new ``.metadata``
    can be built while the copy runs.
    """
    copies = []
    for name, items in by_file.items():
        ranges: list[tuple[int, int]] = []
        position = 0
        for _index, info in items:
            offset, length = int(torch_dist.record_attr(info, "offset")), int(torch_dist.record_attr(info, "length"))
            if ranges and sum(ranges[-1]) == offset:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
            elif length:
                ranges.append((offset, length))
            torch_dist.set_storage(info, StorageLocation(name, position, length))
            position += length
        copies.append(FileCopy(name, len(items), ranges, position))
    return copies


def _copy_range(
    src_fd: int, dst_fd: int, offset: int, length: int, state: dict, progress: Progress | None, cancel: Any
) -> None:
    """Copy ``length`` bytes at ``offset`` of src to dst's current position, one block at a time."""
    remaining = length
    while remaining:
        if cancel.is_set():
            raise _Cancelled
        step = min(BLOCK, remaining)
        done = 0
        if state.get("kernel", hasattr(os, "copy_file_range")):
            try:
                done = os.copy_file_range(src_fd, dst_fd, step, offset)
            except OSError:  # cross-device on old kernels, or a filesystem without it: fall back for good
                state["kernel"] = False
        if not state.get("kernel", True) or not hasattr(os, "copy_file_range"):
            data = os.pread(src_fd, step, offset)
            _write_all(dst_fd, memoryview(data))
            done = len(data)
        if done <= 0:
            raise CkptError(f"range {offset}+{remaining} ends past the file's end")
        offset += done
        remaining -= done
        if progress is not None:
            progress(done)


class _Cancelled(Exception):
    """The copy was stopped because the caller failed (or was interrupted) meanwhile."""


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _sync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise CkptError(f"{path}: cannot sync ({exc.strerror})") from None


SYNC_THREADS = 16  # fsyncs in flight: one at a time costs a journal commit each (seconds for thousands of files)


class BackgroundCopy:
    """The copy of :func:`plan_copies`' files into ``dst_dir``, running in threads while the caller goes on.

    ``jobs`` threads copy files (the kernel copy releases the GIL); each file is fsynced as soon as it is
    written (a pool of :data:`SYNC_THREADS`), so the disk writes overlap the copying. Use it as a context
    manager: leaving the block by an exception (Ctrl-C included) stops the copy and waits for every thread
    before the exception goes on, so the caller's cleanup never races a thread still writing. Inside the
    block, :meth:`result` waits for the copy and every fsync and raises the first failure (in file order).
    Every file's bytes and the result's order are the same for any ``jobs``.
    """

    def __init__(
        self, src_dir: Path, dst_dir: Path, copies: list[FileCopy], progress: Progress | None = None, jobs: int = 1
    ) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self._src_dir, self._dst_dir, self._copies = src_dir, dst_dir, copies
        self._state: dict = {}  # whether the kernel copy works here, learnt on the first block
        self._cancel = threading.Event()
        self._progress = progress
        if progress is not None:
            lock = threading.Lock()

            def locked(n: int) -> None:
                with lock:
                    progress(n)

            self._progress = locked
        workers = max(1, min(jobs, len(copies)))
        self._sync_pool = ThreadPoolExecutor(max_workers=max(1, min(SYNC_THREADS, len(copies))))
        self._copy_pool = ThreadPoolExecutor(max_workers=workers)
        self._syncs: dict[str, Any] = {}
        self._futures = [self._copy_pool.submit(self._copy, copy) for copy in copies]

    def _copy(self, copy: FileCopy) -> CopiedFile:
        if self._cancel.is_set():
            raise _Cancelled
        written = _copy_file(self._src_dir, self._dst_dir, copy, self._state, self._progress, self._cancel)
        self._syncs[copy.name] = self._sync_pool.submit(_sync, self._dst_dir / copy.name)
        return written

    def result(self) -> list[CopiedFile]:
        """Wait for every file to be copied and fsynced; the first failure (in file order) is raised."""
        written = [future.result() for future in self._futures]
        self._copy_pool.shutdown()
        for copy in self._copies:
            self._syncs[copy.name].result()
        self._sync_pool.shutdown()
        return written

    def stop(self) -> None:
        """Stop copying (files not started are not created) and wait for every thread."""
        self._cancel.set()
        for future in self._futures:
            future.cancel()
        self._copy_pool.shutdown(wait=True)
        for sync in self._syncs.values():
            sync.cancel()
        self._sync_pool.shutdown(wait=True)

    def __enter__(self) -> BackgroundCopy:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.stop()


def copy_items(
    src_dir: Path,
    dst_dir: Path,
    by_file: dict[str, list[tuple[Any, Any]]],
    progress: Progress | None = None,
    jobs: int = 1,
) -> list[CopiedFile]:
    """Copy kept ranges into same-named files in ``dst_dir`` and repoint each ``_StorageInfo`` stand-in.

    ``dst_dir`` is a staging dir the caller renames into place, so files are written directly there
    (fsynced); a crash leaves only the staging dir behind, never a half-written checkpoint. ``jobs`` threads
    copy files concurrently (the kernel copy and writes release the GIL); every file's bytes and the result's
    order are the same for any ``jobs``. The first failure (in file order) is raised.
    """
    with BackgroundCopy(src_dir, dst_dir, plan_copies(by_file), progress, jobs) as copy:
        return copy.result()


def _copy_file(
    src_dir: Path, dst_dir: Path, copy: FileCopy, state: dict, progress: Progress | None, cancel: Any
) -> CopiedFile:
    """One data file's kept ranges, back to back in a new file of the same name."""
    src_path, dst_path = src_dir / copy.name, dst_dir / copy.name
    try:
        src_fd = os.open(src_path, os.O_RDONLY)
    except OSError as exc:
        raise CkptError(f"{src_path}: cannot read ({exc.strerror})") from None
    try:
        dst_fd = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        os.close(src_fd)
        raise CkptError(f"{dst_path}: cannot create ({exc.strerror})") from None
    try:
        for offset, length in copy.ranges:
            try:
                _copy_range(src_fd, dst_fd, offset, length, state, progress, cancel)
            except CkptError as exc:
                raise CkptError(f"{src_path}: {exc}") from None
    except OSError as exc:
        raise CkptError(f"{dst_path}: cannot write ({exc.strerror})") from None
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    return CopiedFile(copy.name, copy.items, copy.bytes)


def sync_files(paths: list[Path], threads: int = SYNC_THREADS) -> None:
    """fsync many files concurrently: one at a time costs a journal commit each (seconds for thousands)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths)))) as pool:
        list(pool.map(_sync, paths))


def _filter_plans(plans: Any, keep: set[str]) -> None:
    """Drop write items of removed keys from ``all_local_plans`` (Megatron keeps it for cached saves)."""
    if not isinstance(plans, list):
        return
    for plan in plans:
        items = torch_dist.record_attr(plan, "items")
        if isinstance(items, list):
            items[:] = [w for w in items if torch_dist.index_fqn(torch_dist.record_attr(w, "index")) in keep]


def restrict_metadata(metadata: Any, keep: Iterable[str]) -> None:
    """Edit a ``.metadata`` object (stand-ins) in place so that it lists exactly the ``keep`` keys."""
    keep = set(keep)
    state_dict_metadata = torch_dist.record_attr(metadata, "state_dict_metadata")
    for key in [k for k in state_dict_metadata if k not in keep]:
        del state_dict_metadata[key]
    storage = torch_dist.storage_items(metadata)
    for index in [i for i in storage if torch_dist.index_fqn(i) not in keep]:
        del storage[index]
    planner_data = torch_dist.record_attr(metadata, "planner_data")
    if isinstance(planner_data, dict):
        for key in [k for k in planner_data if k not in keep]:
            del planner_data[key]
    _filter_plans(torch_dist.record_attr(metadata, "all_local_plans"), keep)
