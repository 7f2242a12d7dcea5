"""``--output`` on object storage: write the new checkpoint locally, then upload it, completing it last.

No object store offers an atomic rename or a lock, so the new checkpoint is written (with every local safety:
temp files, fsync, the lock, the read-back checks) into a private staging dir, and only a finished dir is
uploaded, in Megatron's own order: data and common state first, then each iteration dir's ``metadata.json``
(rank 0 writes it last: it marks the save complete), then the tracker. A run that stops midway leaves no
``metadata.json``, which every loader and ``check`` reads as an incomplete save. The staging dir is removed.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor.errors import CkptError
from ckptdoctor.locate import TRACKER_NAME
from ckptdoctor.storage.dispatch import store_for
from ckptdoctor.tree_removal import remove_tree
from ckptdoctor.write_guard import mangled_url

_COMPLETES = "metadata.json"


def output_url(output: Path | str | None) -> str | None:
    """The URL ``--output`` names (click's Path turns ``s3://b/k`` into ``s3:/b/k``), or None for a local dir."""
    if output is None:
        return None
    text = str(output)
    return text if "://" in text else mangled_url(text)


def upload_order(root: Path) -> list[Path]:
    """Every file below ``root``: data and other files, then the ``metadata.json`` files, then the tracker."""
    files = sorted(p for p in root.rglob("*") if p.is_file())

    def rank(path: Path) -> int:
        return 2 if path.name == TRACKER_NAME else 1 if path.name == _COMPLETES else 0

    return sorted(files, key=lambda p: (rank(p), str(p.relative_to(root))))


@dataclass
class RemoteOutput:
    """A local staging dir standing in for ``url`` until :meth:`upload`."""

    url: str
    local: Path
    uploaded: list[str] = field(default_factory=list)
    bytes: int = 0

    @classmethod
    def of(cls, output: Path | str | None) -> RemoteOutput | None:
        url = output_url(output)
        if url is None:
            return None
        url = url.rstrip("/")
        store_for(url)  # an unknown scheme or a missing backend: one line now, before any work
        staging = Path(tempfile.mkdtemp(prefix="ckptdoctor-upload-"))
        return cls(url, staging / url.rpartition("/")[2])

    def refuse_existing(self, force: bool) -> None:
        """An ``--output`` URL that already holds objects is refused (as a non-empty local dir is)."""
        store, key = store_for(self.url)
        try:
            present = store.list(key)
        except FileNotFoundError:
            present = {}
        if present and not force:
            raise CkptError(f"{self.url}: already holds objects; choose a new --output (or --force to write over them)")

    def upload(self) -> None:
        if not self.local.exists():  # the command wrote nothing (nothing to fix, a refusal)
            return
        store, key = store_for(self.url)
        for path in upload_order(self.local):
            relative = path.relative_to(self.local).as_posix()
            store.put_file(str(path), f"{key}/{relative}")
            self.uploaded.append(f"{self.url}/{relative}")
            self.bytes += path.stat().st_size

    def shown(self, text: str) -> str:
        """Output text with the staging dir named by its URL."""
        return text.replace(str(self.local), self.url)

    def cleanup(self) -> None:
        remove_tree(self.local.parent, ignore_errors=True)
