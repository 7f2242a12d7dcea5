"""A path on object storage that answers what readers ask of a :class:`pathlib.Path`, and a file over it.

:class:`RemotePath` has the subset of the ``Path`` API the readers use (``/``, ``name``, ``parent``,
``is_file``, ``iterdir``, ``stat``, ...), answered from cached listings of its :class:`ObjectStore`; its
``str()`` is the URL, so every message names the URL the user gave. It has no ``__fspath__``: an ``os``
function handed one fails loudly rather than reading a local file of the same name, and
:func:`ckptdoctor.write_guard.refuse_remote_write` tells it from a local path by that (it is no ``os.PathLike``).

:class:`RemoteFile` is a read-only, seekable raw file over ranged GETs. Given the ranges a reader will need
(:meth:`RemoteFile.will_read`), it coalesces them and fetches ahead concurrently (:mod:`.ranges`).
"""

from __future__ import annotations

import errno
import io
import stat as stat_module
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptdoctor.storage.interface import ObjectStore
from ckptdoctor.storage.ranges import PlannedReads, Prefetcher

SEQUENTIAL_STEP = 1 << 20  # a sequential reader's reads are planned in steps of at least this


@dataclass(frozen=True)
class RemoteStat:
    """What ``Path.stat()`` callers read: size and kind."""

    st_size: int
    st_mode: int


class RemotePath:
    """``<store>/<key>``: an object or a prefix of an object store."""

    __slots__ = ("store", "key")

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store = store
        self.key = key

    # --- pure path ---
    def __str__(self) -> str:
        return self.store.url(self.key)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process uses its own store of the same name
        return (RemotePath, (self.store, self.key))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.store is self.store and other.key == self.key

    def __hash__(self) -> int:
        return hash((id(self.store), self.key))

    def __lt__(self, other: RemotePath) -> bool:
        return self.key < other.key

    def __truediv__(self, name: str) -> RemotePath:
        parts = [p for p in str(name).split("/") if p not in ("", ".")]
        return RemotePath(self.store, "/".join([self.key, *parts] if self.key else parts))

    def joinpath(self, *names: str) -> RemotePath:
        out = self
        for name in names:
            out = out / name
        return out

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def stem(self) -> str:
        name = self.name
        return name.rpartition(".")[0] if "." in name.lstrip(".") else name

    @property
    def suffix(self) -> str:
        name = self.name
        return "." + name.rpartition(".")[2] if "." in name.lstrip(".") else ""

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.store, self.key.rpartition("/")[0])

    @property
    def parents(self) -> list[RemotePath]:
        out, path = [], self
        while path.key:
            path = path.parent
            out.append(path)
        return out

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.key.split("/")) if self.key else ()

    def as_posix(self) -> str:
        return str(self)

    def resolve(self) -> RemotePath:
        return self

    def absolute(self) -> RemotePath:
        return self

    def relative_to(self, other: RemotePath) -> str:
        if not isinstance(other, RemotePath) or other.store is not self.store:
            raise ValueError(f"{self} is not below {other}")
        if not other.key:
            return self.key
        if not self.key.startswith(other.key + "/"):
            raise ValueError(f"{self} is not below {other}")
        return self.key[len(other.key) + 1 :]

    def is_relative_to(self, other: RemotePath) -> bool:
        """``other`` is this path or a prefix above it, in the same store (``Path.is_relative_to``)."""
        return (
            isinstance(other, RemotePath)
            and other.store is self.store
            and (not other.key or self.key == other.key or self.key.startswith(other.key + "/"))
        )

    # --- questions answered from listings ---
    def exists(self) -> bool:
        return self.store.stat(self.key) is not None

    def is_file(self) -> bool:
        found = self.store.stat(self.key)
        return found is not None and not found.is_dir

    def is_dir(self) -> bool:
        found = self.store.stat(self.key)
        return found is not None and found.is_dir

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> RemoteStat:
        found = self.store.stat(self.key)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        mode = stat_module.S_IFDIR | 0o555 if found.is_dir else stat_module.S_IFREG | 0o444
        return RemoteStat(found.size, mode)

    def listdir(self) -> list[str]:
        return list(self.store.list(self.key))

    def iterdir(self) -> Iterator[RemotePath]:
        for name in self.store.list(self.key):
            yield self / name

    def sizes(self) -> dict[str, tuple[int, bool]]:
        """name -> (size, is a dir), from one listing."""
        return {name: (s.size, s.is_dir) for name, s in self.store.list(self.key).items()}

    def open_file(self) -> RemoteFile:
        found = self.store.stat(self.key)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        if found.is_dir:
            raise IsADirectoryError(errno.EISDIR, "a directory", str(self))
        return RemoteFile(self, found.size)

    def read_bytes(self, max_bytes: int = 1 << 30) -> bytes:
        """The whole object (a small one: at most ``max_bytes + 1`` bytes are read)."""
        return self.store.read_small_file(self.key, max_bytes)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)


class RemoteFile(io.RawIOBase):
    """A read-only, seekable file over ranged GETs of one object."""

    def __init__(self, path: RemotePath, size: int) -> None:
        super().__init__()
        self.path = path
        self.size = size
        self.pos = 0
        self.prefetch: Prefetcher | None = None
        self.planned: PlannedReads | None = None
        self.last_end = -1  # where the previous read ended: a second read from there is a sequential scan

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.path} is remote: no file descriptor")

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def will_read(self, ranges: list[tuple[int, int]]) -> None:
        """The (offset, length) reads to come, in order: fetched ahead, coalesced, concurrently."""
        self.prefetch = Prefetcher(self.path.store, self.path.key, ranges, self.size)

    def plan(self, ranges: list[tuple[int, int]]) -> None:
        """The (offset, length) reads to come, in any order: each coalesced request is fetched once."""
        if self.planned is not None:
            self.planned.close()
        self.planned = PlannedReads(self.path.store, self.path.key, ranges, self.size)

    def pread(self, length: int, offset: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        if offset == self.last_end and self.prefetch is None and self.planned is None and length:
            # reading on from where the last read ended (hashing a file): fetch the rest ahead, concurrently
            step = max(length, SEQUENTIAL_STEP)
            self.will_read([(start, min(step, self.size - start)) for start in range(offset, self.size, step)])
        self.last_end = offset + length
        if self.planned is not None:
            data = self.planned.take(offset, length)
            if data is not None:
                return data
        if self.prefetch is not None:
            data = self.prefetch.take(offset, length)
            if data is not None:
                return data
        return self.path.store.read_range(self.path.key, offset, length)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.pread(len(view), self.pos)
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        data = self.pread(size, self.pos)
        self.pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(max(0, self.size - self.pos))

    def close(self) -> None:
        if self.planned is not None:
            self.planned.close()
            self.planned = None
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None
        super().close()
