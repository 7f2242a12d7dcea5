"""From a user's string to a path: a local :class:`pathlib.Path`, or a URL's
:class:`~ckptdoctor.storage.remote.RemotePath` on the backend its scheme names.

Readers never ask which backend holds a file: a local path is read with ``os.pread`` as always; a remote path
answers the same questions (``is_file``, ``iterdir``, ``stat``, ``/``) from its store, and
:func:`ckptdoctor.storage.files.open_regular` opens it as a file reading byte ranges. :func:`as_path` is the one
place a user's string becomes one or the other; :func:`store_for` the one place a scheme picks a backend
(fsspec for ``s3://``, ``gs://``, ...; multi-storage-client for ``msc://profile/path``), whose client library is
imported only when such a URL is given.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import cast

from ckptdoctor.storage.fsspec_store import FsspecStore
from ckptdoctor.storage.interface import ObjectStore, shared_store
from ckptdoctor.storage.msc_store import MscStore
from ckptdoctor.storage.remote import RemotePath

URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_url(text: str | os.PathLike) -> bool:
    return isinstance(text, str) and URL_RE.match(text) is not None


def as_path(raw: str | os.PathLike) -> Path:
    """A local :class:`~pathlib.Path`, or for a URL a :class:`~ckptdoctor.storage.remote.RemotePath` (``file://``
    is local).

    Typed as ``Path``: a RemotePath answers the part of the Path API readers use, so the code above ``storage/``
    handles both without asking which it holds; the few ``os`` calls are in :mod:`ckptdoctor.storage.files`.
    """
    if isinstance(raw, RemotePath) or not is_url(raw):
        return raw if isinstance(raw, RemotePath) else Path(raw)  # type: ignore[return-value]
    text = str(raw)
    if text[:7].lower() == "file://":
        return Path(text[len("file://") :])
    store, key = store_for(text)
    return cast(Path, RemotePath(store, key))


def store_for(url: str) -> tuple[ObjectStore, str]:
    """The store serving ``url`` (one per scheme, or per MSC profile) and the key below its root."""
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme == "msc":
        profile, _, key = rest.partition("/")
        store = shared_store(MscStore, profile)
    else:
        key, store = rest, shared_store(FsspecStore, scheme)
    return store, "/".join(part for part in key.split("/") if part not in ("", "."))
