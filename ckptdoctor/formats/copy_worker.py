"""The byte copy of a compacting write (``edit --compact``, ``strip-frozen``), run as its own process.

Each new data file gets the listed ``(source offset, length)`` ranges of the source file of the same name, back
to back (``os.copy_file_range`` where the kernel offers it, a bounded read/write loop otherwise), is created with
``O_EXCL`` and fsynced as soon as it is written (a pool of threads: one at a time costs a journal commit each).

:mod:`ckptdoctor.formats.dcp_writer` starts this file as a script (``python -I -S``, standard library only, so it
starts in milliseconds) while it builds and checks the new ``.metadata``: a copy in threads of that process
would wait for the interpreter lock after every system call while the pickling holds it. The plan comes as JSON
on stdin; stdout carries one line per copied block (bytes, for the progress bar) and, on failure, one line
``E <message>`` (the first failure in file order) before exit status 1. The process ignores SIGINT (its parent
decides, and kills it) and dies with its parent (Linux ``PR_SET_PDEATHSIG``), so it never writes into a staging
dir that nobody will rename. The same functions run in threads when a process cannot be started.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

BLOCK = 8 << 20  # bytes per copy step: bounded memory, and the progress callback's granularity
SYNC_THREADS = 16  # fsyncs in flight


class CopyError(Exception):
    """A failure, its message as the user sees it (``<path>: <what>``)."""


class Cancelled(Exception):
    """The copy was stopped because the caller failed (or was interrupted) meanwhile."""


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


def copy_range(
    src_fd: int,
    dst_fd: int,
    offset: int,
    length: int,
    state: dict,
    progress: Callable[[int], None] | None,
    cancel: threading.Event,
) -> None:
    """Copy ``length`` bytes at ``offset`` of src to dst's current position, one block at a time."""
    remaining = length
    while remaining:
        if cancel.is_set():
            raise Cancelled
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
            raise CopyError(f"range {offset}+{remaining} ends past the file's end")
        offset += done
        remaining -= done
        if progress is not None:
            progress(done)


def copy_file(
    src_dir: str,
    dst_dir: str,
    name: str,
    ranges: list[tuple[int, int]],
    state: dict,
    progress: Callable[[int], None] | None,
    cancel: threading.Event,
) -> None:
    """One new data file: the source file's ``ranges`` back to back, created (never an existing file)."""
    if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        # the reader refuses such names (torch_dist.inside_path); a second guard where files are created
        raise CopyError(f"{name!r}: not a file name inside the checkpoint; refusing to copy it")
    src_path, dst_path = os.path.join(src_dir, name), os.path.join(dst_dir, name)
    try:
        src_fd = os.open(src_path, os.O_RDONLY)
    except OSError as exc:
        raise CopyError(f"{src_path}: cannot read ({exc.strerror})") from None
    try:
        dst_fd = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        os.close(src_fd)
        raise CopyError(f"{dst_path}: cannot create ({exc.strerror})") from None
    try:
        for offset, length in ranges:
            try:
                copy_range(src_fd, dst_fd, offset, length, state, progress, cancel)
            except CopyError as exc:
                raise CopyError(f"{src_path}: {exc}") from None
    except OSError as exc:
        raise CopyError(f"{dst_path}: cannot write ({exc.strerror})") from None
    finally:
        os.close(src_fd)
        os.close(dst_fd)


def sync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise CopyError(f"{path}: cannot sync ({exc.strerror})") from None


class Copier:
    """Copy every file of ``files`` ([(name, ranges)]) with ``jobs`` threads, fsyncing each once written.

    :meth:`wait` raises the first failure in file order; :meth:`stop` stops the copy (files not started are not
    created) and waits for every thread.
    """

    def __init__(
        self,
        src_dir: str,
        dst_dir: str,
        files: list[tuple[str, list[tuple[int, int]]]],
        jobs: int = 1,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.src_dir, self.dst_dir, self.files = src_dir, dst_dir, files
        self.state: dict = {}  # whether the kernel copy works here, learnt on the first block
        self.cancel = threading.Event()
        self.progress = progress
        self.syncs: dict[str, Future] = {}
        self.sync_pool = ThreadPoolExecutor(max_workers=max(1, min(SYNC_THREADS, len(files))))
        self.copy_pool = ThreadPoolExecutor(max_workers=max(1, min(jobs, len(files))))
        self.futures: list[Future] = []
        try:
            for name, ranges in files:
                self.futures.append(self.copy_pool.submit(self._copy, name, ranges))
        except BaseException:  # Ctrl-C before the caller holds this object: no thread may go on writing
            self.stop()
            raise

    def _copy(self, name: str, ranges: list[tuple[int, int]]) -> None:
        if self.cancel.is_set():
            raise Cancelled
        copy_file(self.src_dir, self.dst_dir, name, ranges, self.state, self.progress, self.cancel)
        self.syncs[name] = self.sync_pool.submit(sync, os.path.join(self.dst_dir, name))

    def wait(self) -> None:
        for future in self.futures:
            future.result()
        self.copy_pool.shutdown()
        for name, _ranges in self.files:
            self.syncs[name].result()
        self.sync_pool.shutdown()

    def stop(self) -> None:
        self.cancel.set()
        for future in self.futures:
            future.cancel()
        self.copy_pool.shutdown(wait=True)
        for pending in self.syncs.values():
            pending.cancel()
        self.sync_pool.shutdown(wait=True)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent dies (a killed ckptdoctor leaves no writer behind)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def main() -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    plan = json.loads(sys.stdin.buffer.read())
    _die_with_parent(int(plan["parent"]))
    out = sys.stdout
    lock = threading.Lock()

    def progress(n: int) -> None:
        with lock:
            out.write(f"{n}\n")
            out.flush()

    files = [(name, [(int(o), int(n)) for o, n in ranges]) for name, ranges in plan["files"]]
    copier = Copier(plan["src"], plan["dst"], files, int(plan["jobs"]), progress if plan["progress"] else None)
    try:
        copier.wait()
    except CopyError as exc:
        copier.stop()
        with lock:
            out.write("E " + json.dumps(str(exc)) + "\n")
            out.flush()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
