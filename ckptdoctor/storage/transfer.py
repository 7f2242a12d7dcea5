"""One object carried to where a write's output goes: copied on the server where the store can (the same bucket,
or the same MSC profile: S3 CopyObject, no byte through this process), else streamed through this process in
bounded ranged reads (another bucket or profile, or a local dir)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ckptdoctor.storage.remote import RemotePath

Advance = Callable[[int], None]


def copies_on_server(src: RemotePath, dest: RemotePath | Path) -> bool:
    """Whether ``src`` reaches ``dest`` by a server-side copy (else its bytes are streamed)."""
    return isinstance(dest, RemotePath) and src.store.copies_to(src.key, dest.store, dest.key)


def carry_object(src: RemotePath, size: int, dest: RemotePath | Path, advance: Advance | None = None) -> bool:
    """Copy the object ``src`` (``size`` bytes) to ``dest``, an object or a new local file; True when it was
    copied on the server. A stream to another store goes through a temp file (bounded memory; the upload is
    the backend's own, multipart where large); a local ``dest`` is created exclusively and fsynced."""
    if copies_on_server(src, dest):
        assert isinstance(dest, RemotePath)
        src.store.copy(src.key, dest.key)
        if advance is not None:
            advance(size)
        return True
    if isinstance(dest, RemotePath):
        with tempfile.NamedTemporaryFile(prefix="ckptdoctor-stream-") as spool:
            src.store.download(src.key, size, spool, advance)
            spool.flush()
            dest.store.put_file(spool.name, dest.key)
        return False
    with open(dest, "xb") as out:
        src.store.download(src.key, size, out, advance)
        out.flush()
        os.fsync(out.fileno())
    return False
