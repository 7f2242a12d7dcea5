"""The storage interface: what a remote backend answers (:class:`Storage`), the shared part of every backend
(:class:`ObjectStore`), and the one store per backend in a process (:func:`shared_store`).

A URL's :class:`~ckptdoctor.storage.remote.RemotePath` asks its store; the backends
(:mod:`~ckptdoctor.storage.fsspec_store`, :mod:`~ckptdoctor.storage.msc_store`) subclass :class:`ObjectStore` and
import nothing of ckptdoctor but this module and :mod:`ckptdoctor.errors`; the dispatcher
(:mod:`~ckptdoctor.storage.dispatch`) picks one for a URL.

An object store has no directories: a "directory" is a key prefix with objects below it. Each listing is made
once per run (one LIST per directory, cached: a read-only command sees one snapshot), and every size and
existence question about a name is answered from its parent's listing, so locating a checkpoint costs a few
LIST requests and no HEADs. Reads are ranged GETs; a transient failure is retried with backoff; a failure that
retries do not cure is one :class:`StorageUnavailable` naming the URL (exit 2); a missing object is an
``OSError`` like a missing local file, so the checks that report missing files report it the same way.
"""

from __future__ import annotations

import builtins
import errno
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, Protocol

from ckptdoctor.errors import CkptError

RETRIES = 4  # attempts per request: 1 + 3 retries
STREAM_BLOCK = 16 << 20  # a streamed copy's ranged GET: large enough for throughput, small enough for memory
BACKOFF_S = 0.2  # first retry after 0.2 s, then 0.4, 0.8


class StorageUnavailable(CkptError):
    """Remote storage failed in a way no retry cured (server unreachable, no credentials, access denied).

    Not a problem of the checkpoint: commands stop with this one message (exit 2) rather than report findings.
    """


@dataclass(frozen=True)
class Stat:
    """One name in a listing: an object (with its size) or a prefix ("directory")."""

    name: str
    size: int
    is_dir: bool


class Storage(Protocol):
    """What every reader needs of a storage backend (keys are ``/``-separated paths below the store's root)."""

    def list(self, key: str) -> dict[str, Stat]:
        """The names directly below ``key``; ``FileNotFoundError`` when nothing is there."""
        ...

    def stat(self, key: str) -> Stat | None:
        """The object or prefix ``key``, or None."""
        ...

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer at the object's end)."""
        ...

    def read_small_file(self, key: str, max_bytes: int) -> bytes:
        """A whole small object, at most ``max_bytes + 1`` bytes (so callers can tell it is too long)."""
        ...

    def url(self, key: str) -> str:
        """The URL a user would write for ``key`` (in every message)."""
        ...


@dataclass
class TransferLog:
    """What a process asked of remote storage: requests and body bytes received (for ``--stats`` and tests)."""

    lists: int = 0
    gets: int = 0
    bytes: int = 0
    retries: int = 0

    def __post_init__(self) -> None:
        self.lock = threading.Lock()

    def add_get(self, nbytes: int) -> None:
        with self.lock:
            self.gets += 1
            self.bytes += nbytes


TRANSFERS = TransferLog()


# Held while a forked worker replaces a store's client; made anew in each child (a lock held by a parent's thread at
# the fork would stay held in the child forever).
_RECONNECTING = [threading.Lock()]
os.register_at_fork(after_in_child=lambda: _RECONNECTING.__setitem__(0, threading.Lock()))


class ObjectStore(ABC):
    """The shared part of the remote backends: listing cache, retries with backoff, error wording."""

    scheme: str
    args: tuple[str, ...]  # what :func:`shared_store` made it from: a worker process makes its own from these

    def __init__(self) -> None:
        self._listings: dict[str, dict[str, Stat] | None] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process uses (or makes) its own store of the same name
        return (shared_store, (type(self), *self.args))

    @abstractmethod
    def _connect(self) -> None:
        """(Re)create the backend's client: once here, again in a forked worker (clients are not fork-safe)."""

    def _in_this_process(self) -> None:
        """In a forked worker, make this process's own client before any request: every thread of the worker
        waits for it (a thread that went on with the parent's client while another reconnected shared the parent's
        open connections with the other processes: replies to another process's ranged GETs, wrong bytes)."""
        pid = os.getpid()
        if self._pid == pid:
            return
        with _RECONNECTING[0]:
            if self._pid != pid:
                self._lock = threading.Lock()
                self._connect()
                self._pid = pid  # last: only now may the other threads use the client

    # --- what a backend implements ---
    @abstractmethod
    def url(self, key: str) -> str: ...

    @abstractmethod
    def _ls(self, key: str) -> list[Stat]:
        """Names directly below ``key`` (``FileNotFoundError`` or an empty list when none)."""

    @abstractmethod
    def _get(self, key: str, offset: int, length: int) -> bytes:
        """One ranged GET."""

    @abstractmethod
    def _put(self, local: str, key: str) -> None:
        """Upload one local file to ``key`` (one object, replaced whole)."""

    def _copy(self, src: str, dst: str) -> None:
        """Copy the object ``src`` to ``dst`` on the server (no byte passes through this process)."""
        raise NotImplementedError

    def copies_to(self, src: str, other: ObjectStore, dst: str) -> bool:
        """Whether ``src`` here can be copied to ``dst`` of ``other`` on the server: the same store (one MSC
        profile; for fsspec, one bucket) and a backend that has a copy. Anywhere else the bytes are streamed."""
        return other is self and type(self)._copy is not ObjectStore._copy

    def _classify(self, exc: BaseException) -> str | None:
        """A permanent failure's wording (no retry), or None for a transient one. Backends add their own."""
        if isinstance(exc, PermissionError):
            return f"access denied ({exc})"
        return None

    # --- the interface ---
    def list(self, key: str) -> dict[str, Stat]:
        with self._lock:
            if key in self._listings:
                found = self._listings[key]
                if found is None:
                    raise FileNotFoundError(errno.ENOENT, "no such object or prefix", self.url(key))
                return found
        try:
            entries: dict[str, Stat] | None = {s.name: s for s in self._retrying(key, lambda: self._ls(key))} or None
        except FileNotFoundError:
            entries = None
        TRANSFERS.lists += 1
        with self._lock:
            self._listings[key] = entries
        if entries is None:
            raise FileNotFoundError(errno.ENOENT, "no such object or prefix", self.url(key))
        return entries

    def _find(self, key: str) -> builtins.list[tuple[str, int]]:  # ``list`` is the method above
        """Every object below ``key`` (path relative to it, size): one recursive listing, paged."""
        raise NotImplementedError

    def list_tree(self, key: str) -> None:
        """List everything below ``key`` at once (a few paged requests, not one per directory), filling the
        listing cache for ``key`` and each prefix below it; for trees of many small dirs (legacy zarr)."""
        try:
            found = self._retrying(key, lambda: self._find(key))
        except (NotImplementedError, FileNotFoundError):
            return
        TRANSFERS.lists += 1
        tree: dict[str, dict[str, Stat]] = {key: {}}
        for relative, size in found:
            parts = relative.split("/")
            where = key
            for depth, part in enumerate(parts):
                below = f"{where}/{part}" if where else part
                is_dir = depth < len(parts) - 1
                tree.setdefault(where, {})[part] = Stat(part, 0 if is_dir else size, is_dir)
                where = below
        with self._lock:
            for prefix, entries in tree.items():
                self._listings[prefix] = entries or None

    def stat(self, key: str) -> Stat | None:
        if not key:
            return Stat("", 0, True)
        parent, _, name = key.rpartition("/")
        try:
            return self.list(parent).get(name)
        except FileNotFoundError:
            return None

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        data = self._retrying(key, lambda: self._get(key, offset, length))
        TRANSFERS.add_get(len(data))
        return data

    def read_small_file(self, key: str, max_bytes: int) -> bytes:
        found = self.stat(key)
        if found is None or found.is_dir:
            why = "a directory" if found is not None else "no such object"
            raise FileNotFoundError(errno.ENOENT if found is None else errno.EISDIR, why, self.url(key))
        return self.read_range(key, 0, min(found.size, max_bytes + 1))

    def put_file(self, local: str, key: str) -> None:
        """Upload ``local`` to ``key``, with the read path's retries and one-line errors."""
        self._retrying(key, lambda: self._put(local, key), "write")
        self._forget(key)

    def copy(self, src: str, dst: str) -> None:
        """Server-side copy of ``src`` to ``dst`` (see :meth:`copies_to`), with retries and one-line errors."""
        self._retrying(dst, lambda: self._copy(src, dst), "write")
        self._forget(dst)

    def download(self, key: str, size: int, out: IO[bytes], advance: Callable[[int], None] | None = None) -> None:
        """Stream the object ``key`` (``size`` bytes) into ``out`` in ranged GETs of :data:`STREAM_BLOCK` bytes:
        memory stays bounded however large the object; ``advance`` is told each block's bytes."""
        offset = 0
        while offset < size:
            block = self.read_range(key, offset, min(STREAM_BLOCK, size - offset))
            if not block:
                raise OSError(errno.EIO, f"object ended at byte {offset} of {size}", self.url(key))
            out.write(block)
            offset += len(block)
            if advance is not None:
                advance(len(block))

    def find(self, key: str) -> builtins.list[tuple[str, int]]:
        """Every object below ``key``: (path relative to it, size), sorted; one recursive listing where the
        backend has one, else a walk of the cached listings."""
        if type(self)._find is not ObjectStore._find:
            return sorted(self._retrying(key, lambda: self._find(key)))
        out: builtins.list[tuple[str, int]] = []
        pending = [""]
        while pending:
            relative = pending.pop()
            for name, found in self.list(f"{key}/{relative}".rstrip("/") if relative else key).items():
                below = f"{relative}/{name}" if relative else name
                if found.is_dir:
                    pending.append(below)
                else:
                    out.append((below, found.size))
        return sorted(out)

    def _forget(self, key: str) -> None:
        """Drop the cached listings a new object at ``key`` changes (its parent prefixes)."""
        with self._lock:
            parts = key.split("/")
            for depth in range(len(parts)):
                self._listings.pop("/".join(parts[:depth]), None)

    def _retrying(self, key: str, call: Callable[[], Any], verb: str = "read") -> Any:
        self._in_this_process()
        for attempt in range(RETRIES):
            try:
                return call()
            except FileNotFoundError as exc:
                raise FileNotFoundError(errno.ENOENT, "no such object", self.url(key)) from exc
            except Exception as exc:
                permanent = self._classify(exc)
                if permanent is not None:
                    raise StorageUnavailable(
                        f"{self.url(key)}: cannot {verb}: {without_credentials(permanent)}"
                    ) from None
                if attempt == RETRIES - 1:
                    raise StorageUnavailable(
                        f"{self.url(key)}: cannot {verb} after {RETRIES} attempts: {_one_line(exc)}"
                    ) from None
                TRANSFERS.retries += 1
                time.sleep(BACKOFF_S * (2**attempt))
        raise AssertionError("unreachable")


_URL_CREDENTIALS_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]*@")


def without_credentials(text: str) -> str:
    """``text`` with the user and password of every URL in it left out (an endpoint configured as
    ``https://user:secret@host`` shows up in the backends' error messages)."""
    return _URL_CREDENTIALS_RE.sub(r"\1***@", text)


def _one_line(exc: BaseException) -> str:
    text = without_credentials(" ".join(str(exc).split())) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"


# --- one store per backend and name, per process ---------------------------------------------------------

_STORES: dict[tuple[Callable[..., ObjectStore], tuple[str, ...]], ObjectStore] = {}
_STORES_LOCK = threading.Lock()


def shared_store(kind: Callable[..., ObjectStore], *args: str) -> ObjectStore:
    """The store ``kind(*args)`` of this process (one per scheme, or per MSC profile), made on first use: every
    path of it shares its listing cache and its client."""
    with _STORES_LOCK:
        store = _STORES.get((kind, args))
        if store is None:
            store = _STORES[(kind, args)] = kind(*args)
        return store


def forget_stores() -> None:
    """Drop the stores made so far: the next URL makes a new one from the environment as it is then (a long-lived
    process whose credentials or endpoint changed; tests that start a server per test)."""
    with _STORES_LOCK:
        _STORES.clear()
