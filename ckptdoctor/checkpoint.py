"""The Checkpoint model: entries, sections, data files, common state and args, built from metadata only.

Tensor bytes are never read here; :mod:`ckptdoctor.values.read` streams them when values are asked for.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.formats import torch_dist, zarr_meta
from ckptdoctor.formats.files import file_sizes
from ckptdoctor.formats.torch_dist import DcpChunk, DcpIndex, DcpItem
from ckptdoctor.formats.torch_zip import is_torch_zip, load_torch_zip
from ckptdoctor.locate import BACKEND_ZARR, CheckpointLocation, locate
from ckptdoctor.pickle_scan import current_limits
from ckptdoctor.torch_stand_ins import DtypeRef

SECTIONS = ("model", "optimizer", "rng", "rerun", "common", "other")
_SECTION_PREFIXES = (
    ("optimizer.", "optimizer"),
    ("optimizer/", "optimizer"),
    ("rng_state", "rng"),
    ("rerun_state_machine_state", "rerun"),
    ("common_state", "common"),
    ("train_state", "other"),
    ("modelopt_state", "other"),
)
_SECTION_FIRST_LETTERS = frozenset(prefix[0] for prefix, _ in _SECTION_PREFIXES)
COMMON_STATE_PREFIX = "common_state"


def section_of(key: str) -> str:
    """The checkpoint section a key belongs to; bare module keys (no prefix) are model keys."""
    # Runs for every key of a large checkpoint: most are model keys, rejected by their first letter.
    if key[:1] not in _SECTION_FIRST_LETTERS:
        return "model"
    for prefix, section in _SECTION_PREFIXES:
        if key.startswith(prefix):
            return section
    return "model"


_FRAMING_SLACK = 1 << 20


@dataclass
class Entry(DcpItem):
    """One saved item: a tensor (global shape, dtype, chunks) or a bytes item (ShardedObject, extra state).

    Built directly by the metadata reader (one per key: tens of thousands), saving a second object per key.
    """

    section: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.section = section_of(self.key)

    @property
    def nbytes(self) -> int:
        """Bytes on disk (serialized chunk sizes as stored)."""
        return sum(c.storage.length for c in self.chunks if c.storage is not None)

    @property
    def numel(self) -> int:
        if self.shape is None:
            return 0
        n = 1
        for d in self.shape:
            n *= d
        return n

    def max_range_bytes(self, chunk: DcpChunk) -> int:
        """The most bytes one stored range of this item can legitimately span: a tensor chunk's elements plus
        torch.save framing (zip headers, data.pkl, alignment: well under 1 MiB); a bytes item, the pickle size
        limit. A hostile ``.metadata`` cannot make a reader pull a 100 GB range into memory."""
        nbytes = self.chunk_nbytes(chunk)
        return current_limits().max_bytes if nbytes is None else nbytes + _FRAMING_SLACK

    def chunk_nbytes(self, chunk: DcpChunk) -> int | None:
        """A tensor chunk's element bytes (numel x itemsize); None for a bytes item or an unknown dtype."""
        itemsize = DtypeRef.get(self.dtype.removeprefix("torch.")).itemsize if self.dtype else None
        if self.kind != "tensor" or itemsize is None:
            return None
        numel = 1
        for size in chunk.sizes:
            numel *= size
        return numel * itemsize

    @property
    def is_extra_state(self) -> bool:
        return "_extra_state" in self.key


@dataclass
class Checkpoint:
    location: CheckpointLocation
    entries: dict[str, Entry]
    data_files: dict[str, int]  # relative path -> size in bytes, of files present on disk
    dcp: DcpIndex | None = None
    _common: Any = field(default=None, repr=False)
    _common_loaded: bool = field(default=False, repr=False)
    common_unlisted: list[str] = field(default_factory=list, repr=False)  # CKD402 globals of the common state

    @property
    def iteration_dir(self) -> Path:
        return self.location.iteration_dir

    def section_entries(self, section: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.section == section]

    @property
    def common_source(self) -> str | None:
        """Where the common (non-sharded) state lives: ``common.pt`` or the DCP bytes item's key."""
        if self.location.has_common_pt:
            return "common.pt"
        for key, entry in self.entries.items():
            if key.startswith(COMMON_STATE_PREFIX) and entry.kind == "bytes":
                return key
        return None

    def common_state(self) -> dict:
        """The common state dict (args, iteration, ...); raises :class:`CkptError` if unreadable."""
        if not self._common_loaded:
            self._common = self._load_common()
            self._common_loaded = True
        return self._common

    def _load_common(self) -> dict:
        source = self.common_source
        if source is None:
            raise CkptError(f"{self.iteration_dir}: no common state (neither common.pt nor a common_state item)")
        if source == "common.pt":
            path = self.iteration_dir / "common.pt"
            state = load_torch_zip(path, str(path), unlisted=self.common_unlisted)
            where = str(path)
        else:
            state = self.read_bytes_item(source, self.common_unlisted)
            where = f"{self.iteration_dir}: item {source}"
        if not isinstance(state, dict):
            raise CkptError(f"{where}: common state is a {type(state).__name__}, expected a dict")
        return state

    @property
    def args(self) -> Any:
        """The saved ``argparse.Namespace`` (or None when the common state holds no args)."""
        return self.common_state().get("args")

    def read_bytes_item(self, key: str, unlisted: list[str] | None = None) -> Any:
        """Decode a bytes item (ShardedObject, ``_extra_state``, ``common_state``) through the safe unpickler."""
        entry = self.entries[key]
        location = entry.chunks[0].storage if entry.chunks else None
        where = f"{self.iteration_dir}: item {key}"
        if location is None:
            raise CkptError(f"{where}: no storage entry in .metadata")
        data = torch_dist.read_range(self.iteration_dir, location, entry.max_range_bytes(entry.chunks[0]))
        return decode_object_bytes(data, where, unlisted)


def decode_object_bytes(data: bytes, where: str, unlisted: list[str] | None = None) -> Any:
    """A Megatron ShardedObject's bytes: ``torch.save([obj])`` (or of a BytesIO holding that), unwrapped."""
    if not is_torch_zip(data):
        return data
    obj = load_torch_zip(data, where, unlisted=unlisted)
    if isinstance(obj, io.BytesIO) and is_torch_zip(obj.getvalue()[:4]):
        obj = load_torch_zip(obj.getvalue(), where, unlisted=unlisted)
    if isinstance(obj, list) and len(obj) == 1:
        return obj[0]
    return obj


def list_data_files(iteration_dir: Path) -> dict[str, int]:
    """``.distcp`` data files present in an iteration dir, with their sizes (one scandir, no opens)."""
    return {name: size for name, size in file_sizes(iteration_dir).items() if name.endswith(".distcp")}


def open_checkpoint(path: str | Path, iteration: str | int | None = None) -> Checkpoint:
    """Locate and index a checkpoint from metadata; the one entry point operations use."""
    return _open_located(locate(path, iteration))


def _open_located(location: CheckpointLocation) -> Checkpoint:
    if location.backend == BACKEND_ZARR:
        entries, sizes = zarr_meta.read_index(location.iteration_dir)
        return Checkpoint(location, {k: Entry(*v) for k, v in entries.items()}, sizes)
    index = torch_dist.read_metadata(location.iteration_dir / ".metadata", item_class=Entry)
    return checkpoint_from_index(location, index)


def open_for_rewrite(path: str | Path, iteration: str | int | None = None) -> tuple[Checkpoint, Any]:
    """:func:`open_checkpoint` for a command that rewrites ``.metadata``: also the metadata object, from the same
    read (one pass of the safety scan instead of two); None where there is no ``.metadata`` (legacy zarr)."""
    location = locate(path, iteration)
    if location.backend == BACKEND_ZARR:
        return _open_located(location), None
    index, metadata = torch_dist.read_metadata_for_rewrite(location.iteration_dir / ".metadata", item_class=Entry)
    return checkpoint_from_index(location, index), metadata


def checkpoint_from_index(location: CheckpointLocation, index: DcpIndex | None) -> Checkpoint:
    """A torch_dist Checkpoint from an already parsed index (None: no usable .metadata, so no entries).

    ``check`` builds checkpoints this way when ``locate`` would refuse the dir (e.g. metadata.json
    missing), so that one problem does not hide the others.
    """
    entries = (
        {}
        if index is None
        else {
            key: item if isinstance(item, Entry) else Entry(item.key, item.kind, item.dtype, item.shape, item.chunks)
            for key, item in index.items.items()
        }
    )
    return Checkpoint(location, entries, list_data_files(location.iteration_dir), dcp=index)
