"""The torch_dist backend: PyTorch DCP ``.metadata`` plus ``__<rank>_<n>.distcp`` data files.

``.metadata`` is read through the safe unpickler, so the DCP classes (and Megatron's ``MCoreMetadata`` /
``MCoreSavePlan`` of core 0.11-0.15) arrive as inert stand-ins; only their recorded state is used here.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ckptdoctor import safe_pickle
from ckptdoctor.errors import CkptError, PickleLimitError
from ckptdoctor.formats.archive import unpickle
from ckptdoctor.formats.files import open_regular
from ckptdoctor.gc_pause import gc_paused
from ckptdoctor.pickle_scan import current_limits
from ckptdoctor.stand_ins import STAND_IN_TYPES, StandIn

DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


# NamedTuples rather than frozen dataclasses: one of each per chunk, and a frozen dataclass's __init__
# costs several times more (tens of thousands of chunks are built for every command on a large checkpoint).
class StorageLocation(NamedTuple):
    """Where one chunk or bytes item lives: a data file (relative to the iteration dir) and a byte range."""

    relative_path: str
    offset: int
    length: int


class DcpChunk(NamedTuple):
    """One chunk of a tensor (offsets and sizes in the global shape) and where its bytes are stored."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: StorageLocation | None


def chunk_overlap(a: DcpChunk, b: DcpChunk) -> tuple[tuple[slice, ...], tuple[slice, ...], int] | None:
    """Where two chunks of one global tensor overlap: (slices into a, slices into b, element count), or None."""
    slices_a, slices_b, volume = [], [], 1
    for oa, za, ob, zb in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(oa, ob), min(oa + za, ob + zb)
        if lo >= hi:
            return None
        slices_a.append(slice(lo - oa, hi - oa))
        slices_b.append(slice(lo - ob, hi - ob))
        volume *= hi - lo
    return tuple(slices_a), tuple(slices_b), volume


@dataclass
class DcpItem:
    key: str
    kind: str  # "tensor" or "bytes"
    dtype: str | None
    shape: tuple[int, ...] | None
    chunks: list[DcpChunk]


@dataclass
class DcpIndex:
    items: dict[str, DcpItem]
    version: str | None
    metadata_class: str  # e.g. torch.distributed.checkpoint.metadata.Metadata or MCoreMetadata
    checkpoint_id: str | None
    extra: dict[str, Any]  # other attributes of the metadata object (mcore_data, all_local_plans, ...)
    unlisted: tuple[str, ...] = ()  # tolerated globals not on the allowlist (CKD402)


@functools.lru_cache(maxsize=65536)  # called per chunk (tens of thousands) on a few thousand file names
def writer_rank(relative_path: str) -> int | None:
    match = DISTCP_RE.match(Path(relative_path).name)
    return int(match.group(1)) if match else None


def record_attr(obj: Any, name: str, default: Any = None) -> Any:
    """A field of an unpickled record: a stand-in's own state (never a class attribute), else the attribute."""
    if isinstance(obj, STAND_IN_TYPES):
        return obj.__dict__.get(name, default)
    return getattr(obj, name, default)


def read_metadata(path: Path, item_class: type[DcpItem] = DcpItem) -> DcpIndex:
    """Parse a DCP ``.metadata`` file into a :class:`DcpIndex` (no data file is opened).

    ``item_class`` (a :class:`DcpItem` subclass) lets the Checkpoint model get its entries built directly.
    """
    with gc_paused():
        return _read_metadata(path, item_class)


def _load_metadata_pickle(path: Path, unlisted: list[str] | None = None) -> Any:
    try:
        with open_regular(path) as f:
            data = f.read(current_limits().max_bytes + 1)
    except OSError as exc:
        raise CkptError(f"{path}: cannot read ({exc.strerror})") from None
    return unpickle(data, str(path), unlisted=unlisted, what="DCP metadata")


def _read_metadata(path: Path, item_class: type[DcpItem] = DcpItem) -> DcpIndex:
    unlisted: list[str] = []
    metadata = _load_metadata_pickle(path, unlisted)
    return _index_from_object(metadata, path, item_class, unlisted)


def read_metadata_for_rewrite(path: Path, item_class: type[DcpItem] = DcpItem) -> tuple[DcpIndex, Any]:
    """The index and the ``.metadata`` object itself from one read, for a command that rewrites it (``edit``).
    Strict, as :func:`load_metadata_object`: a global outside the allowlist is refused, not tolerated."""
    with gc_paused():
        metadata = _load_metadata_pickle(path)
        return _index_from_object(metadata, path, item_class, []), metadata


def _index_from_object(metadata: Any, path: Path, item_class: type[DcpItem], unlisted: list[str]) -> DcpIndex:
    state_dict_metadata = record_attr(metadata, "state_dict_metadata")
    storage_data = record_attr(metadata, "storage_data")
    if not isinstance(state_dict_metadata, dict) or not isinstance(storage_data, dict):
        raise CkptError(f"{path}: not a PyTorch DCP Metadata object (got {type(metadata).__name__})")

    try:
        items = _index_items(state_dict_metadata, storage_data, item_class)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise CkptError(f"{path}: unexpected DCP metadata structure ({type(exc).__name__}: {exc})") from None

    storage_meta = record_attr(metadata, "storage_meta")
    checkpoint_id = record_attr(storage_meta, "checkpoint_id") if storage_meta is not None else None
    known = {"state_dict_metadata", "storage_data", "planner_data", "storage_meta", "version"}
    extra = {}
    if isinstance(metadata, StandIn):
        extra = {k: v for k, v in (metadata.stand_in_state or {}).items() if k not in known}
    cls = type(metadata)
    class_name = cls.qualified_name() if isinstance(metadata, StandIn) else f"{cls.__module__}.{cls.__name__}"
    return DcpIndex(
        items,
        record_attr(metadata, "version"),
        class_name,
        None if checkpoint_id is None else str(checkpoint_id),
        extra,
        tuple(unlisted),
    )


def _index_items(state_dict_metadata: dict, storage_data: dict, item_class: type[DcpItem]) -> dict[str, DcpItem]:
    """Entries from the metadata records. Runs once per chunk (tens of thousands in a large checkpoint), so
    it reads the records' attribute dicts directly: every object here comes from the safe unpickler."""
    # (fqn, chunk offsets or None) -> storage location
    locations: dict[tuple[str, tuple[int, ...] | None], StorageLocation] = {}
    for index, info in storage_data.items():
        index_fields, info_fields = index.__dict__, info.__dict__
        offset = index_fields.get("offset")
        locations[(index_fields["fqn"], None if offset is None else tuple(offset))] = StorageLocation(
            str(info_fields["relative_path"]), int(info_fields["offset"]), int(info_fields["length"])
        )
    dtype_names: dict[Any, str | None] = {}
    items: dict[str, DcpItem] = {}
    for key, item_meta in state_dict_metadata.items():
        item_fields = item_meta.__dict__
        chunks_meta = item_fields.get("chunks")
        if chunks_meta is None:  # BytesStorageMetadata
            items[key] = item_class(key, "bytes", None, None, [DcpChunk((), (), locations.get((key, None)))])
            continue
        chunks = []
        for chunk in chunks_meta:
            chunk_fields = chunk.__dict__
            offsets = tuple(chunk_fields["offsets"])
            chunks.append(DcpChunk(offsets, tuple(chunk_fields["sizes"]), locations.get((key, offsets))))
        properties = item_fields.get("properties")
        # TensorProperties pickles its fields as a tuple (dtype, layout, requires_grad, memory_format, pin)
        fields = {} if properties is None else properties.__dict__
        state = fields.get("_ckd_state")
        dtype = state[0] if isinstance(state, tuple) and state else fields.get("dtype")
        if dtype not in dtype_names:
            dtype_names[dtype] = None if dtype is None else str(dtype)
        items[key] = item_class(key, "tensor", dtype_names[dtype], tuple(item_fields["size"]), chunks)
    return items


def read_range(iteration_dir: Path, location: StorageLocation, max_length: int | None = None) -> bytes:
    """The bytes of one chunk or item; raises :class:`CkptError` naming the file if it is short or missing,
    and :class:`PickleLimitError` if the range is longer than ``max_length`` (``Entry.max_range_bytes``)."""
    path = iteration_dir / location.relative_path
    check_range_length(path, location, max_length)
    try:
        with open_regular(path) as f:
            f.seek(location.offset)
            data = f.read(location.length)
    except OSError as exc:
        raise CkptError(f"{path}: cannot read ({exc.strerror})") from None
    if len(data) != location.length:
        raise CkptError(f"{path}: truncated: range {location.offset}+{location.length} ends past the file's end")
    return data


def check_range_length(path: Path, location: StorageLocation, max_length: int | None) -> None:
    if max_length is not None and location.length > max_length:
        raise PickleLimitError(
            f"{path}: range {location.offset}+{location.length} is longer than its item can "
            f"need ({max_length} bytes); refusing to read it"
        )


# --- writing -------------------------------------------------------------------------------------------


def load_metadata_object(path: Path) -> Any:
    """The ``.metadata`` object itself (stand-ins), for rewriting; see :func:`dump_metadata_object`."""
    with gc_paused():
        return _load_metadata_pickle(path)


def dump_metadata_object(metadata: Any) -> bytes:
    """Pickle a (possibly edited) ``.metadata`` object back; stand-ins become the original torch classes."""
    return safe_pickle.dumps(metadata)


def storage_items(metadata: Any) -> dict[Any, Any]:
    """The ``storage_data`` dict of a metadata object: MetadataIndex -> _StorageInfo stand-ins."""
    return record_attr(metadata, "storage_data")


def set_storage(info: Any, location: StorageLocation) -> None:
    """Point a ``_StorageInfo`` stand-in at a new file and byte range (other fields kept)."""
    info.__dict__["relative_path"] = location.relative_path
    info.__dict__["offset"] = location.offset
    info.__dict__["length"] = location.length


def index_fqn(index: Any) -> str:
    return record_attr(index, "fqn")
