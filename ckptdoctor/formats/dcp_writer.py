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
from ckptdoctor.formats import copy_worker, torch_dist
from ckptdoctor.formats.torch_dist import StorageLocation

Progress = Callable[[int], None]


@dataclass
class CopiedFile:
    name: str
    items: int
    bytes: int


def kept_storage(metadata: Any, keep: set[str]) -> dict[str, list[tuple[Any, Any]]]:
    """Source data file -> [(MetadataIndex, _StorageInfo)] of kept items, in :func:`layout_order`."""
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in torch_dist.storage_items(metadata).items():
        if torch_dist.index_fqn(index) in keep:
            by_file.setdefault(str(torch_dist.record_attr(info, "relative_path")), []).append((index, info))
    for items in by_file.values():
        items.sort(key=lambda pair: _range_of(pair[1]))
    return dict(sorted(by_file.items()))


def _range_of(info: Any) -> tuple[int, int]:
    return int(torch_dist.record_attr(info, "offset")), int(torch_dist.record_attr(info, "length"))


@dataclass
class FileCopy:
    """One new data file: the source file's kept byte ranges, copied back to back (adjacent ranges merged)."""

    name: str
    items: int
    ranges: list[tuple[int, int]]  # (source offset, length)
    bytes: int


def layout(by_file: dict[str, list[tuple[int, int]]]) -> list[FileCopy]:
    """The new data files of a compacted copy: each source file's kept items (offset, length), in (offset, length)
    order, back to back into a new file of the same name (an item's new offset is the lengths before it; equal
    ranges get equal bytes, so their order among themselves does not matter). Items adjacent in the source become
    one range (one kernel copy instead of one per item: the bytes written are the same)."""
    copies = []
    for name, items in by_file.items():
        ranges: list[tuple[int, int]] = []
        position = 0
        for offset, length in items:
            if ranges and sum(ranges[-1]) == offset:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
            elif length:
                ranges.append((offset, length))
            position += length
        copies.append(FileCopy(name, len(items), ranges, position))
    return copies


def plan_copies(by_file: dict[str, list[tuple[Any, Any]]]) -> list[FileCopy]:
    """:func:`layout` of :func:`kept_storage`'s items, each kept ``_StorageInfo`` stand-in repointed to its place.

    The storage is repointed before a byte is copied, so the new ``.metadata`` can be built while the copy runs.
    """
    ranges = {name: [_range_of(info) for _index, info in items] for name, items in by_file.items()}
    for name, items in by_file.items():
        position = 0
        for _index, info in items:
            length = _range_of(info)[1]
            torch_dist.set_storage(info, StorageLocation(name, position, length))
            position += length
    return layout(ranges)


class BackgroundCopy:
    """The copy of :func:`plan_copies`' files into ``dst_dir``, running while the caller goes on.

    The copy runs in a helper process (:mod:`ckptdoctor.formats.copy_worker`: its own interpreter, so its system
    calls never wait for this process's interpreter lock while the caller pickles), in threads of this process
    when no process can be started (``process=False`` forces that). ``jobs`` threads copy files; each file is
    fsynced as soon as it is written. Use it as a context manager: leaving the block by an exception (Ctrl-C
    included) stops the copy and waits for it (the helper is killed) before the exception goes on, so the
    caller's cleanup never races a writer. Inside the block, :meth:`result` waits for the copy and every fsync
    and raises the first failure (in file order). Every file's bytes are the same either way, for any ``jobs``.
    """

    def __init__(
        self,
        src_dir: Path,
        dst_dir: Path,
        copies: list[FileCopy],
        progress: Progress | None = None,
        jobs: int = 1,
        process: bool = True,
    ) -> None:
        import threading

        self._copies = copies
        self._progress = progress
        if progress is not None:
            lock = threading.Lock()

            def locked(n: int) -> None:
                with lock:
                    progress(n)

            self._progress = locked
        files = [(c.name, c.ranges) for c in copies]
        self._proc: Any = None
        self._copier: copy_worker.Copier | None = None
        self._error: str | None = None
        self._reader: threading.Thread | None = None
        self._other: list[str] = []  # helper output that is neither progress nor its error line
        self._progress_failure: Exception | None = None
        if process:
            self._proc = self._start_process(src_dir, dst_dir, files, jobs)
        if self._proc is None:
            self._copier = copy_worker.Copier(str(src_dir), str(dst_dir), files, jobs, self._progress)

    def _start_process(self, src_dir: Path, dst_dir: Path, files: list, jobs: int) -> Any:
        import json
        import subprocess
        import sys
        import threading

        plan = {
            "parent": os.getpid(),
            "src": str(src_dir),
            "dst": str(dst_dir),
            "files": files,
            "jobs": jobs,
            "progress": self._progress is not None,
        }
        if not sys.executable or not copy_worker.__file__:  # an embedded interpreter: copy in threads here
            return None
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", copy_worker.__file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # one pipe, always drained: the helper never blocks on a full one
            )
        except OSError:
            return None
        try:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(plan).encode())
                proc.stdin.close()
            except OSError:  # it died at once: its exit status and output say why (result() reports it)
                pass
            self._reader = threading.Thread(target=self._read, args=(proc,), name="ckptdoctor-copy-reader", daemon=True)
            self._reader.start()
        except BaseException:  # Ctrl-C before the caller holds this object: no helper may outlive it
            proc.kill()
            proc.wait()
            raise
        return proc

    def _read(self, proc: Any) -> None:
        """Drain the helper's output to its end: one line per copied block (progress), ``E <message>`` for its
        failure, anything else (a traceback) kept for the error message."""
        import json

        for line in proc.stdout:
            try:
                if line.startswith(b"E "):
                    self._error = str(json.loads(line[2:]))
                elif line.strip().isdigit():
                    if self._progress is not None and self._progress_failure is None:
                        self._progress(int(line))
                elif line.strip():
                    self._other.append(line.decode(errors="replace").rstrip())
            except Exception as exc:  # noqa: BLE001 - raised again by result(); the pipe is still drained
                self._progress_failure = self._progress_failure or exc

    def result(self) -> list[CopiedFile]:
        """Wait for every file to be copied and fsynced; the first failure (in file order) is raised."""
        if self._copier is not None:
            try:
                self._copier.wait()
            except copy_worker.CopyError as exc:
                raise CkptError(str(exc)) from None
        else:
            rc = self._proc.wait()
            assert self._reader is not None
            self._reader.join()
            self._proc.stdout.close()
            if rc != 0:
                if self._error is not None:
                    raise CkptError(self._error)
                why = self._other[-1] if self._other else f"exit status {rc}"
                raise CkptError(f"copying the kept items failed ({why})")
            if self._progress_failure is not None:
                raise self._progress_failure
        return [CopiedFile(c.name, c.items, c.bytes) for c in self._copies]

    def stop(self) -> None:
        """Stop copying (files not started are not created) and wait until nothing writes any more."""
        if self._copier is not None:
            self._copier.stop()
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        if self._reader is not None:
            self._reader.join()
        self._proc.stdout.close()

    def __enter__(self) -> BackgroundCopy:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.stop()


def _filter_plans(plans: Any, keep: set[str]) -> None:
    """Drop write items of removed keys from ``all_local_plans`` (Megatron keeps it for cached saves)."""
    if not isinstance(plans, list):
        return
    for plan in plans:
        items = torch_dist.record_attr(plan, "items")
        if isinstance(items, list):
            items[:] = [w for w in items if _item_fqn(w) in keep]


def _item_fqn(item: Any) -> str | None:
    """The key a cached write item names; None for a malformed one (a hostile pickle can put a dict there),
    which names no kept key and is dropped."""
    fqn = torch_dist.index_fqn(torch_dist.record_attr(item, "index"))
    return fqn if isinstance(fqn, str) else None


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
