"""Writes are local only: the one refusal of a write whose target is on object storage.

A primitive beside :mod:`ckptdoctor.atomic` and :mod:`ckptdoctor.locking` (which call it first), importing only
:mod:`ckptdoctor.errors` and the standard library. It tells a remote path from a local one without knowing the
storage layer: a local path is one the operating system can open (a ``str`` or an ``os.PathLike``), and a URL's
:class:`~ckptdoctor.storage.remote.RemotePath` deliberately is neither (it has no ``__fspath__``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ckptdoctor.errors import CkptError

_MANGLED_URL_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):/(?!/)")  # what Path("s3://b/k") makes of a URL


def is_local(path: object) -> bool:
    """Whether ``path`` names a local file (the OS can open it): a URL's remote path is not one."""
    return isinstance(path, (str, bytes, os.PathLike))


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
    if not is_local(path):
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
