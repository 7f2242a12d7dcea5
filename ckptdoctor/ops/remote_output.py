"""Writes that touch object storage: the new checkpoint is built locally, with every local safety, then delivered
to its ``--output``, completing it last.

* ``--output`` on object storage: the writer writes into a private staging dir (temp files, fsync, the lock, the
  read-back checks), and only a finished dir is delivered.
* A source on object storage (``fix-args``, ``edit`` without ``--compact``, ``seal -o``: O(metadata) writes): a
  private local copy of it stands in for the source. Its metadata files (``.metadata``, ``metadata.json``,
  ``common.pt``, ``integrity.json``, trackers, Bridge files) are downloaded; each data file is a sparse file of its
  size holding only its bytes items (common state, RNG and extra state: what the gate and an args rewrite read),
  its tensor bytes never fetched. The local writer runs on that copy as on any local checkpoint, hard-linking what
  it keeps, so at delivery every staged file that is a link to the copy is known to be the source's own object
  unchanged: it is copied on the server when the output is in the same bucket or MSC profile (S3 CopyObject), and
  streamed through this process otherwise (another bucket or profile, or a local dir), ``jobs`` at a time. Only
  the files the write changed are uploaded. The source is never written.

No object store offers an atomic rename or a lock, so objects land in Megatron's order: data files first, then
the other files, the ``.metadata`` last of them, then each iteration dir's ``metadata.json`` (rank 0 writes it
last: it marks the save complete), then the tracker. A run that stops midway leaves no ``metadata.json``, which
every loader and ``check`` reads as an incomplete save. A local ``--output`` is filled in a hidden staging dir
beside it and renamed into place at the end. The private copies are removed in every case.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor import atomic
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.train_state import BRIDGE_TRACKER_NAME
from ckptdoctor.locate import TRACKER_NAME
from ckptdoctor.ops.staging import SwapState, swap_output
from ckptdoctor.progress import Progress
from ckptdoctor.rules import leftovers
from ckptdoctor.storage.dispatch import as_path, store_for
from ckptdoctor.storage.remote import RemotePath
from ckptdoctor.storage.transfer import carry_object, copies_on_server
from ckptdoctor.tree_removal import remove_tree
from ckptdoctor.write_guard import mangled_url

_COMPLETES = "metadata.json"
_INDEX = ".metadata"
_DATA_SUFFIX = ".distcp"
_STEP = "deliver"
_FETCHES = 8  # concurrent requests filling a remote source's local copy (small files, bytes items' ranges)


def output_url(output: Path | str | None) -> str | None:
    """The URL ``--output`` names (click's Path turns ``s3://b/k`` into ``s3:/b/k``), or None for a local dir."""
    if output is None:
        return None
    text = str(output)
    return text if "://" in text else mangled_url(text)


def _rank(relative: str) -> int:
    name = relative.rpartition("/")[2]
    if name in (TRACKER_NAME, BRIDGE_TRACKER_NAME) and "/" not in relative:
        return 4
    return {_COMPLETES: 3, _INDEX: 2}.get(name, 0 if name.endswith(_DATA_SUFFIX) else 1)


def upload_order(root: Path) -> list[Path]:
    """Every file below ``root``: data files, other files, the ``.metadata`` files, the ``metadata.json`` files
    (they mark a save complete), then the trackers."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return sorted(files, key=lambda p: (_rank(p.relative_to(root).as_posix()), p.relative_to(root).as_posix()))


@dataclass(frozen=True)
class Origin:
    """The source object a file of the local copy stands for."""

    remote: RemotePath
    size: int
    sparse: bool  # a data file's stand-in: only its bytes items are here, the rest is on object storage


@dataclass
class SourceCopy:
    """A checkpoint on object storage, made local for an O(metadata) write (see the module doc)."""

    base: RemotePath  # the save dir, or the iteration dir's parent
    local: Path  # its local copy
    checkpoint: RemotePath  # the save dir, or the iteration dir: what no output may overlap
    origins: dict[tuple[int, int], Origin] = field(default_factory=dict)  # (st_dev, st_ino) of a copied file

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> SourceCopy:
        """Download ``checkpoint``'s metadata files and lay out its data files as sparse stand-ins."""
        location = checkpoint.location
        iteration_dir = location.iteration_dir
        base = location.save_dir if location.save_dir is not None else iteration_dir.parent
        if not isinstance(base, RemotePath) or not isinstance(iteration_dir, RemotePath):
            raise CkptError(f"{iteration_dir}: not on object storage")
        root = Path(tempfile.mkdtemp(prefix="ckptdoctor-source-"))
        copy = cls(base, root / (base.name or "source"), base if location.save_dir is not None else iteration_dir)
        try:
            copy._fill(checkpoint, iteration_dir)
        except BaseException:
            copy.cleanup()
            raise
        return copy

    def _fill(self, checkpoint: Checkpoint, iteration_dir: RemotePath) -> None:
        store = iteration_dir.store
        local_iter = self.local / iteration_dir.name
        local_iter.mkdir(parents=True)
        if checkpoint.location.save_dir is not None:
            for name in (TRACKER_NAME, BRIDGE_TRACKER_NAME):
                found = store.stat(f"{self.base.key}/{name}")
                if found is not None and not found.is_dir:
                    self._download(self.base / name, found.size, self.local / name)
        items: dict[str, list[tuple[int, int]]] = {}  # data file -> its bytes items' ranges
        for entry in checkpoint.entries.values():
            if entry.kind == "bytes":
                for chunk in entry.chunks:
                    if chunk.storage is not None:
                        where = chunk.storage
                        items.setdefault(where.relative_path, []).append((where.offset, where.length))
        tasks = []
        for relative, size in store.find(iteration_dir.key):
            dest = local_iter / relative
            dest.parent.mkdir(parents=True, exist_ok=True)
            # torch_dist's data files only: a legacy zarr chunk or .pt file is read as a file, so it is downloaded
            sparse = checkpoint.dcp is not None and relative.endswith(_DATA_SUFFIX)
            tasks.append((iteration_dir / relative, size, dest, items.get(relative, []) if sparse else None))
        with ThreadPoolExecutor(max_workers=_FETCHES) as pool:
            for _ in pool.map(lambda task: self._fetch(*task), tasks):
                pass
        self._check_links(local_iter)

    def _fetch(self, remote: RemotePath, size: int, dest: Path, ranges: list[tuple[int, int]] | None) -> None:
        if ranges is None:
            self._download(remote, size, dest)
        else:
            self._stand_in(remote, size, dest, ranges)

    def _download(self, remote: RemotePath, size: int, dest: Path) -> None:
        carry_object(remote, size, dest)
        self._record(dest, Origin(remote, size, sparse=False))

    def _stand_in(self, remote: RemotePath, size: int, dest: Path, ranges: list[tuple[int, int]]) -> None:
        with open(dest, "xb") as out:
            out.truncate(size)  # sparse: no disk space, the object's size for every size check
            for offset, length in sorted(ranges):
                out.seek(offset)
                out.write(remote.store.read_range(remote.key, offset, length))
        self._record(dest, Origin(remote, size, sparse=True))

    def _record(self, path: Path, origin: Origin) -> None:
        st = os.stat(path)
        self.origins[(st.st_dev, st.st_ino)] = origin

    def _check_links(self, local_iter: Path) -> None:
        """The staged output is told from the copy by hard links: refuse a temp dir where none can be made (the
        writer would copy a stand-in, and its zeros would be delivered as data)."""
        probe = local_iter.parent / ".ckptdoctor-link-probe"
        probe.write_bytes(b"")
        try:
            os.link(probe, local_iter.parent / ".ckptdoctor-link-probe-2")
        except OSError as exc:
            raise CkptError(
                f"{tempfile.gettempdir()}: cannot hard-link files there ({exc.strerror}); a write from object "
                "storage needs it (set TMPDIR to a local filesystem)"
            ) from None
        finally:
            for name in (".ckptdoctor-link-probe", ".ckptdoctor-link-probe-2"):
                (local_iter.parent / name).unlink(missing_ok=True)

    def local_path(self, given: str | Path) -> str:
        """The path in the local copy standing for ``given`` (the source as the user named it)."""
        path = as_path(str(given))
        if not isinstance(path, RemotePath) or not path.is_relative_to(self.base):
            raise CkptError(f"{given}: not below {self.base}")
        relative = path.relative_to(self.base) if path != self.base else ""
        return str(self.local / relative) if relative else str(self.local)

    def origin(self, path: Path) -> Origin | None:
        """The source object ``path`` is a hard link of, if it is one."""
        st = os.stat(path)
        return self.origins.get((st.st_dev, st.st_ino))

    def shown(self, text: str) -> str:
        return text.replace(str(self.local), str(self.base))

    def cleanup(self) -> None:
        remove_tree(self.local.parent, ignore_errors=True)


@dataclass
class Delivered:
    """What a delivery moved: objects copied on the server, streamed, uploaded from local files."""

    server_side: int = 0
    streamed: int = 0
    streamed_bytes: int = 0
    uploaded: list[str] = field(default_factory=list)
    bytes: int = 0  # bytes uploaded from local files

    def data_files_how(self) -> str | None:
        """How the source's data files reached the output (a writer's report says "hard-linked" of its staging
        dir): copied on the server, streamed, or both; None where none was carried that way."""
        ways = [
            way for count, way in ((self.server_side, "copied on the server"), (self.streamed, "streamed")) if count
        ]
        return " or ".join(ways) or None


@dataclass
class StagedOutput:
    """A local staging dir standing in for the ``--output`` ``target`` until :meth:`deliver`: a URL, or a local dir
    written from a source on object storage (``source``)."""

    target: str
    local: Path
    source: SourceCopy | None = None
    delivered: Delivered = field(default_factory=Delivered)

    @classmethod
    def of(cls, output: Path | str | None, source: SourceCopy | None = None) -> StagedOutput | None:
        """The staging of ``output``: always for a URL, for a local dir only when ``source`` is on object storage;
        None where the writer writes ``output`` itself."""
        url = output_url(output)
        if url is None and (source is None or output is None):
            return None
        if url is not None:
            target = url.rstrip("/")
            store_for(target)  # an unknown scheme or a missing backend: one line now, before any work
        else:
            target = str(output)
        staging = Path(tempfile.mkdtemp(prefix="ckptdoctor-upload-"))
        name = target.rstrip("/").rpartition("/")[2] or "output"
        return cls(target, staging / name, source)

    @property
    def remote(self) -> bool:
        return output_url(self.target) is not None

    def refuse_existing(self, force: bool) -> None:
        """An ``--output`` URL that already holds objects is refused (as a non-empty local dir is); so is an output
        that is, holds or lies inside the source."""
        destination = as_path(self.target)
        if self.source is not None:
            source = self.source.checkpoint
            if isinstance(destination, RemotePath) and (
                destination.is_relative_to(source) or source.is_relative_to(destination)
            ):
                raise CkptError(
                    f"{self.target}: is, contains or lies inside the source checkpoint {source}; choose another "
                    "--output (a checkpoint on object storage is not changed in place)"
                )
        if isinstance(destination, RemotePath):
            try:
                present = destination.store.list(destination.key)
            except FileNotFoundError:
                present = {}
            if present and not force:
                raise CkptError(
                    f"{self.target}: already holds objects; choose a new --output (or --force to write over them)"
                )
            return
        try:
            if destination.exists() and (not destination.is_dir() or any(destination.iterdir())) and not force:
                raise CkptError(f"{self.target}: exists and is not empty (use --force to replace it)")
        except OSError as exc:
            raise CkptError(f"{exc.filename or self.target}: cannot use as output ({exc.strerror})") from None

    def plan(self) -> tuple[list[tuple[Path, Origin | None]], str | None]:
        """The staged files in delivery order, each with the source object it carries (None: upload or copy the
        local file); and the one line saying how the data files travel, None when no data file is carried."""
        files = [(path, self._carried(path)) for path in upload_order(self.local)] if self.local.exists() else []
        data = [origin for _, origin in files if origin is not None and origin.sparse]
        if not data or self.source is None:
            return files, None
        total = sum(o.size for o in data)
        destination = as_path(self.target)
        count = f"{len(data)} data file{'s' if len(data) != 1 else ''} ({_size(total)})"
        if copies_on_server(data[0].remote, destination):
            where = "the same MSC profile" if self.source.base.store.scheme == "msc" else "the same bucket"
            return files, f"copying {count} server-side: source and output are in {where}; uploading the changed files"
        if isinstance(destination, RemotePath):
            why = "different MSC profiles" if destination.store.scheme == "msc" else "different buckets"
            why = f"source and output are in {why}"
        else:
            why = "the output is a local dir"
        return files, f"copying {count} by streaming: {why}"

    def _carried(self, path: Path) -> Origin | None:
        if self.source is None:
            return None
        origin = self.source.origin(path)
        if origin is None and path.stat().st_blocks * 512 < path.stat().st_size and path.name.endswith(_DATA_SUFFIX):
            raise CkptError(  # a stand-in the writer copied instead of linking: never deliver its zeros
                f"{path.name}: a data file of the source was copied, not linked, while staging; nothing was written"
            )
        return origin

    def deliver(
        self, jobs: int = 1, progress: Progress | None = None, say: Callable[[str], None] | None = None
    ) -> None:
        """Deliver the staged dir to ``target`` (see the module doc); data first, ``metadata.json`` and the
        tracker last. Nothing when the command wrote nothing (nothing to fix, a refusal)."""
        files, line = self.plan()
        if not files:
            return
        if line is not None and say is not None:
            say(line)
        if self.remote:
            self._deliver_remote(files, jobs, progress)
        else:
            self._deliver_local(files, jobs, progress)

    def _transfer_data(
        self,
        files: list[tuple[Path, Origin | None]],
        dest_of: Callable[[str], RemotePath | Path],
        jobs: int,
        progress: Progress | None,
    ) -> None:
        data = [(p, o) for p, o in files if o is not None and o.sparse]
        if not data:
            return
        if progress is not None:
            progress.start("copying data files", sum(o.size for _, o in data))
        advance = progress.advance if progress is not None else None

        def one(item: tuple[Path, Origin]) -> bool:
            path, origin = item
            return carry_object(origin.remote, origin.size, dest_of(self._relative(path)), advance)

        try:
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                for (_, origin), on_server in zip(data, pool.map(one, data)):
                    if on_server:
                        self.delivered.server_side += 1
                    else:
                        self.delivered.streamed += 1
                        self.delivered.streamed_bytes += origin.size
        finally:
            if progress is not None:
                progress.finish()
        atomic.fault_point(f"{_STEP}:data")

    def _relative(self, path: Path) -> str:
        return path.relative_to(self.local).as_posix()

    def _deliver_remote(self, files: list[tuple[Path, Origin | None]], jobs: int, progress: Progress | None) -> None:
        store, key = store_for(self.target)
        destination = RemotePath(store, key)
        self._transfer_data(files, lambda relative: destination / relative, jobs, progress)
        for path, origin in files:
            if origin is not None and origin.sparse:
                continue
            relative = self._relative(path)
            dest = destination / relative
            if origin is not None and copies_on_server(origin.remote, dest):  # unchanged: no byte uploaded
                carry_object(origin.remote, origin.size, dest)
                self.delivered.server_side += 1
            else:
                store.put_file(str(path), dest.key)
                self.delivered.uploaded.append(f"{self.target}/{relative}")
                self.delivered.bytes += path.stat().st_size
            atomic.fault_point(f"{_STEP}:{path.name}")

    def _deliver_local(self, files: list[tuple[Path, Origin | None]], jobs: int, progress: Progress | None) -> None:
        output = Path(self.target)
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CkptError(f"{exc.filename or output.parent}: cannot create ({exc.strerror})") from None
        staging = atomic.make_unique_dir(output.parent, f".{output.name}{leftovers.TMP_MARK}")
        swap = SwapState()
        try:
            for path, _ in files:
                (staging / self._relative(path)).parent.mkdir(parents=True, exist_ok=True)
            self._transfer_data(files, lambda relative: staging / relative, jobs, progress)
            for path, origin in files:
                if origin is None or not origin.sparse:
                    atomic.link_or_copy(path, staging / self._relative(path))  # a copy is fsynced
            for directory in sorted({p.parent for p in staging.rglob("*")}, reverse=True):
                atomic.fsync_dir(directory)
            swap_output(output, staging, swap, _STEP)
        except BaseException as exc:
            if not swap.done:
                remove_tree(staging, ignore_errors=True)
            if isinstance(exc, OSError):
                raise CkptError(f"{exc.filename or staging}: cannot write ({exc.strerror})") from None
            raise

    def shown(self, text: str) -> str:
        """Output text with the staging dir named by the output, the source's local copy by its URL."""
        text = text.replace(str(self.local), self.target)
        return self.source.shown(text) if self.source is not None else text

    def cleanup(self) -> None:
        remove_tree(self.local.parent, ignore_errors=True)


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
