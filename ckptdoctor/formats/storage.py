"""One storage interface for checkpoint files: local paths, fsspec URLs (``s3://``, ``gs://``, ...) and
multi-storage-client profiles (``msc://profile/path``).

Readers never ask which backend holds a file: a local path is a :class:`pathlib.Path` read with ``os.pread``
as always; a URL becomes a :class:`~ckptdoctor.formats.remote.RemotePath`, which answers the same questions
(``is_file``, ``iterdir``, ``stat``, ``/``) from an :class:`ObjectStore`, and which
:func:`ckptdoctor.formats.files.open_regular` opens as a file reading byte ranges. :func:`as_path` is the one
place a user's string becomes one or the other.

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
from pathlib import Path
from typing import Any, Protocol, cast

from ckptdoctor.errors import CkptError

URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
RETRIES = 4  # attempts per request: 1 + 3 retries
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


class ObjectStore(ABC):
    """The shared part of the remote backends: listing cache, retries with backoff, error wording."""

    scheme: str

    def __init__(self) -> None:
        self._listings: dict[str, dict[str, Stat] | None] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @abstractmethod
    def _connect(self) -> None:
        """(Re)create the backend's client: once here, again in a forked worker (clients are not fork-safe)."""

    def _in_this_process(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._connect()

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
                    raise StorageUnavailable(f"{self.url(key)}: cannot {verb}: {permanent}") from None
                if attempt == RETRIES - 1:
                    raise StorageUnavailable(
                        f"{self.url(key)}: cannot {verb} after {RETRIES} attempts: {_one_line(exc)}"
                    ) from None
                TRANSFERS.retries += 1
                time.sleep(BACKOFF_S * (2**attempt))
        raise AssertionError("unreachable")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"


# --- from a user's string to a path ---------------------------------------------------------------------

_STORES: dict[str, ObjectStore] = {}
_STORES_LOCK = threading.Lock()


def is_url(text: str | os.PathLike) -> bool:
    return isinstance(text, str) and URL_RE.match(text) is not None


def as_path(raw: str | os.PathLike) -> Path:
    """A local :class:`~pathlib.Path`, or for a URL a :class:`~ckptdoctor.formats.remote.RemotePath` (``file://``
    is local).

    Typed as ``Path``: a RemotePath answers the part of the Path API readers use, so the code above ``formats/``
    handles both without asking which it holds; the few ``os`` calls are in :mod:`ckptdoctor.formats.files`.
    """
    from ckptdoctor.formats.remote import RemotePath

    if isinstance(raw, RemotePath) or not is_url(raw):
        return raw if isinstance(raw, RemotePath) else Path(raw)  # type: ignore[return-value]
    text = str(raw)
    if text[:7].lower() == "file://":
        return Path(text[len("file://") :])
    store, key = store_for(text)
    return cast(Path, RemotePath(store, key))


_MANGLED_URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):/(?!/)")  # what Path("s3://b/k") makes of a URL


def mangled_url(path: str | os.PathLike) -> str | None:
    """The URL a path option held before ``Path`` folded its ``//`` (``s3:/b/k`` -> ``s3://b/k``), or None for a
    real local path (one that exists, or does not look like a folded URL)."""
    text = str(path)
    if _MANGLED_URL_RE.match(text) and not Path(text).exists():
        return _MANGLED_URL_RE.sub(r"\1://", text, count=1)
    return None


def refuse_remote_write(path: Path, in_place: bool) -> None:
    """Writes are local only: a checkpoint on object storage is never changed in place (no atomic rename, no
    lock there), and an ``--output`` URL is not written to; one clear :class:`CkptError` each."""
    from ckptdoctor.formats.remote import RemotePath

    if isinstance(path, RemotePath):
        if in_place:
            raise CkptError(
                f"{path}: cannot be changed in place on object storage (no atomic rename or lock there); "
                "write a fixed copy to a local dir with --output DIR and upload it (metadata.json last)"
            )
        raise CkptError(
            f"{path}: writing a copy of a checkpoint on object storage is not supported; download it "
            "(e.g. aws s3 cp --recursive, or msc sync) and run on the local copy"
        )
    url = mangled_url(path)
    if url is not None:
        raise CkptError(
            f"{url}: --output to object storage is not supported; write to a local dir and upload it "
            "(metadata.json last: it marks the checkpoint complete)"
        )


def forget_stores() -> None:
    """Drop the stores made so far: the next URL makes a new one from the environment as it is then (a long-lived
    process whose credentials or endpoint changed; tests that start a server per test)."""
    with _STORES_LOCK:
        _STORES.clear()


def store_for(url: str) -> tuple[ObjectStore, str]:
    """The store serving ``url`` (one per scheme, or per MSC profile) and the key below its root."""
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "msc":
        profile, _, key = rest.partition("/")
        name = f"msc://{profile}"
    else:
        key, name = rest, f"{scheme}://"
    key = "/".join(part for part in key.split("/") if part not in ("", "."))
    with _STORES_LOCK:
        store = _STORES.get(name)
        if store is None:
            if scheme == "msc":
                from ckptdoctor.formats.msc_store import MscStore

                store = MscStore(profile)
            else:
                from ckptdoctor.formats.fsspec_store import FsspecStore

                store = FsspecStore(scheme)
            _STORES[name] = store
    return store, key
