"""What a key rewrite (``strip-frozen``, ``edit``) is asked to do and what it wrote: the data types shared by the
staged write (:mod:`ckptdoctor.ops.rewrite.write`), the making of its ``.metadata`` and data files
(:mod:`ckptdoctor.ops.rewrite.metadata`) and the common-state hook (:mod:`ckptdoctor.ops.rewrite.common_state`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor.checkpoint import HeldMetadata
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import torch_dist
from ckptdoctor.formats.dcp_writer import CopiedFile
from ckptdoctor.formats.torch_dist import StorageLocation
from ckptdoctor.storage.files import file_sizes

Progress = Callable[[int], None] | None


@dataclass
class StripResult:
    output: str  # the dir written: a save dir (tracker + iteration dir) or an iteration dir
    iteration_dir: str
    in_place: bool
    backup: str | None
    files: list[CopiedFile]
    bytes_copied: int
    metadata_bytes: int
    output_bytes: int  # every file of the new iteration dir
    source_bytes: int  # every file of the source iteration dir
    carried: list[str] = field(default_factory=list)  # other files linked or copied over
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it was not carried
    resealed: bool = False  # the source had integrity.json: the output got a fresh one (sha256 of its own files)
    # the saved args rewritten in the output (save_trainable_params_only -> true); empty with --keep-args
    args_changed: list[dict] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class CommonWrite:
    """What the common-state rewrite of a key edit wrote into the staging dir, and where the new ``.metadata``
    must point the common-state item (core >= 0.19 keeps the common state as a ``.metadata`` item: its new bytes
    are a new data file)."""

    written: list[str]
    repoint: tuple[str, StorageLocation] | None = None  # (key, its new place)

    def apply(self, metadata: Any, where: Path) -> None:
        """Point the common-state item of a ``.metadata`` object (stand-ins) at its new place."""
        if self.repoint is None:
            return
        key, location = self.repoint
        entries = [
            info for index, info in torch_dist.storage_items(metadata).items() if torch_dist.index_fqn(index) == key
        ]
        if len(entries) != 1:
            raise CkptError(f"{where}: expected one storage entry for {key}")
        torch_dist.set_storage(entries[0], location)


@dataclass
class KeyEdit:
    """What a staged rewrite does to the source's keys; one writer for ``strip-frozen`` and ``edit``.

    ``compact``: byte-copy only the kept items into new data files (strip-frozen, ``edit --compact``);
    otherwise hard-link (or copy) the data files that still hold a kept item and write only a new
    ``.metadata`` (O(metadata); removed items stay in the files, unreferenced). ``common`` rewrites the common
    state into the staging dir before the ``.metadata`` is written and says what it wrote and where the common-state
    item now points (:class:`CommonWrite`); ``rewritten`` are the kept keys it writes afresh (not copied when
    compacting).
    ``step`` names the fault points (``<step>:data-written``, ...).
    """

    keep: set[str]
    renames: dict[str, str] = field(default_factory=dict)
    compact: bool = True
    step: str = "strip-frozen"
    common: Callable[[Path], CommonWrite] | None = None
    rewritten: set[str] = field(default_factory=set)
    # the source's .metadata object when the caller has read it already; the write takes it (and edits it)
    metadata: HeldMetadata | None = None
    jobs: int = 1  # threads copying data files when compacting (the output is the same for any number)


@dataclass
class CommonChange:
    """One change to the common state (``common.pt`` or ``common_state/shard_0_1``)."""

    what: str  # "drop" | "set-arg" | "drop-content-metadata"
    name: str
    old: Any = None
    new: Any = None
    reason: str = ""


def dir_bytes(directory: Path, data: bool = True) -> int:
    """The size of a checkpoint dir as strip-frozen reports it: every plain file directly in it (data files,
    ``.metadata``, ``common.pt``, ``metadata.json``, ...); ``data=False``: all but the ``.distcp`` data files."""
    return sum(size for name, size in file_sizes(directory).items() if data or not name.endswith(".distcp"))
