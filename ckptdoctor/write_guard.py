"""Writers write local files only: the one refusal of a write whose target is on object storage.

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
    """Writers write local files only: a checkpoint on object storage is never changed in place (no atomic rename,
    no lock there: a stopped run could leave it half written), and a writer handed a remote path (strip-frozen,
    repair, edit --compact) stops; one clear :class:`CkptError` each. The O(metadata) writes from
    object storage (fix-args, edit without --compact, seal -o) write a local copy and deliver it
    (:mod:`ckptdoctor.ops.remote_output`), so they never reach this refusal with a remote path."""
    if not is_local(path):
        if in_place:
            raise CkptError(
                f"{path}: cannot be changed in place on object storage (no atomic rename or lock there); "
                "write a fixed copy with -o/--output: a URL in the same bucket or MSC profile copies the data "
                "files on the server, another URL or a local dir streams them"
            )
        raise CkptError(
            f"{path}: this command does not write from object storage (fix-args, edit without --compact and "
            "seal -o do); download it (e.g. aws s3 cp --recursive, or msc sync) and run on the local copy"
        )
    url = mangled_url(path)
    if url is not None:
        raise CkptError(
            f"{url}: --output to object storage is not supported; write to a local dir and upload it "
            "(metadata.json last: it marks the checkpoint complete)"
        )
