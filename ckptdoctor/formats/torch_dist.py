"""The torch_dist backend: PyTorch DCP ``.metadata`` plus ``__<rank>_<n>.distcp`` data files.

``.metadata`` is read through the safe unpickler, so the DCP classes (and Megatron's ``MCoreMetadata`` /
``MCoreSavePlan`` of core 0.11-0.15) arrive as inert stand-ins; only their recorded state is used here.
"""

from __future__ import annotations

import functools
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError, PickleLimitError
from ckptdoctor.formats.archive import unpickle

# re-exported (``as``): the index types live with the loops that build them
from ckptdoctor.formats.dcp_index import INT64 as INT64
from ckptdoctor.formats.dcp_index import DcpChunk as DcpChunk
from ckptdoctor.formats.dcp_index import DcpItem as DcpItem
from ckptdoctor.formats.dcp_index import IndexValueError as IndexValueError
from ckptdoctor.formats.dcp_index import StorageLocation as StorageLocation
from ckptdoctor.formats.dcp_index import index_items
from ckptdoctor.formats.dcp_index import inside_path as inside_path
from ckptdoctor.formats.dcp_index import int64_dims as int64_dims
from ckptdoctor.formats.plain_dcp import has_planner_mapping
from ckptdoctor.gc_pause import gc_paused
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.index_records import IndexRecord, index_record_fields
from ckptdoctor.pickle.limits import current_limits
from ckptdoctor.pickle.policy import UnlistedGlobal
from ckptdoctor.pickle.stand_ins import STAND_IN_TYPES, StandIn
from ckptdoctor.pickle.unpickler import refuse_unlisted
from ckptdoctor.storage.files import TooLarge, open_regular, read_releasable

DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


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
class DcpIndex:
    items: dict[str, DcpItem]
    version: str | None
    metadata_class: str  # e.g. torch.distributed.checkpoint.metadata.Metadata or MCoreMetadata
    checkpoint_id: str | None
    # names of the other attributes of the metadata object (mcore_data, all_local_plans, ...); their values
    # are not kept (all_local_plans holds a record per chunk and rank: a second copy of the index)
    extra: tuple[str, ...] = ()
    unlisted: tuple[UnlistedGlobal, ...] = ()  # tolerated globals not on the allowlist (CKD402)
    # planner_data is DCP's default planner's flattening map: a plain ``dcp.save`` (Megatron's torch_dist: None)
    flattened: bool = False


@functools.lru_cache(maxsize=65536)  # called per chunk (tens of thousands) on a few thousand file names
def writer_rank(relative_path: str) -> int | None:
    match = DISTCP_RE.match(Path(relative_path).name)
    return int(match.group(1)) if match else None


def record_attr(obj: Any, name: str, default: Any = None) -> Any:
    """A field of an unpickled record: a stand-in's own state (never a class attribute), else the attribute."""
    if isinstance(obj, STAND_IN_TYPES):
        return obj.__dict__.get(name, default)
    if isinstance(obj, IndexRecord):
        return index_record_fields(obj).get(name, default)
    return getattr(obj, name, default)


def read_metadata(path: Path, item_class: type[DcpItem] = DcpItem) -> DcpIndex:
    """Parse a DCP ``.metadata`` file into a :class:`DcpIndex` (no data file is opened).

    ``item_class`` (a :class:`DcpItem` subclass) lets the Checkpoint model get its entries built directly.
    The records are read index-only (see ``policy.index_only``) and dropped while the index is built,
    so the index is all that stays in memory.
    """
    with gc_paused():
        return _read_metadata(path, item_class)


_WHAT = "DCP metadata"


def _load_metadata_pickle(path: Path, unlisted: list[UnlistedGlobal] | None = None, index_only: bool = False) -> Any:
    limits = current_limits()
    try:
        with open_regular(path) as f:
            data = read_releasable(f, limits.max_bytes)
    except OSError as exc:
        raise CkptError(f"{path}: cannot read ({exc.strerror})") from None
    except TooLarge as exc:  # refused on its size, nothing read: the refusal the unpickler gives a pickle that long
        raise limits.size_refusal(exc.size).located(str(path)) from None
    return unpickle(data, str(path), unlisted=unlisted, what=_WHAT, index_only=index_only)


def _corrupt(path: Path, exc: Exception) -> CkptError:
    return CkptError(f"{path}: corrupt {_WHAT} ({type(exc).__name__}: {exc})")


def _read_metadata(path: Path, item_class: type[DcpItem] = DcpItem) -> DcpIndex:
    unlisted: list[UnlistedGlobal] = []
    metadata = _load_metadata_pickle(path, unlisted, index_only=True)
    try:
        return _index_from_object(metadata, path, item_class, unlisted, consume=True)
    except CkptError as exc:  # not a Metadata after an unlisted global: the gate fails on the global
        refuse_unlisted(unlisted, exc)
        raise


def data_files_of(items: Iterable[DcpItem]) -> frozenset[str]:
    """The data files the chunks of ``items`` are stored in (present or not)."""
    return frozenset(chunk.storage.relative_path for item in items for chunk in item.chunks if chunk.storage)


def referenced_data_files(path: Path) -> frozenset[str]:
    """The data files whose bytes a ``.metadata`` (e.g. a backup, ``.metadata.bak-<stamp>``) places chunks in."""
    return data_files_of(read_metadata(path).items.values())


def read_metadata_for_rewrite(path: Path, item_class: type[DcpItem] = DcpItem) -> tuple[DcpIndex, Any]:
    """The index and the ``.metadata`` object itself from one read, for a command that rewrites it (``edit``).
    Strict, as :func:`load_metadata_object`: a global outside the allowlist is refused, not tolerated."""
    with gc_paused():
        metadata = _load_metadata_pickle(path)
        return _index_from_object(metadata, path, item_class, [], consume=False), metadata


def _index_from_object(
    metadata: Any, path: Path, item_class: type[DcpItem], unlisted: list[UnlistedGlobal], consume: bool
) -> DcpIndex:
    """The index of an unpickled metadata object; ``consume``: empty its dicts while reading them, so that
    each record is freed as soon as its part of the index exists (peak memory: about the larger of the two)."""
    try:
        state_dict_metadata = record_attr(metadata, "state_dict_metadata")
        storage_data = record_attr(metadata, "storage_data")
    except pickle.UnpicklingError as exc:  # a record whose BUILD a Record would have refused
        raise _corrupt(path, exc) from None
    if not isinstance(state_dict_metadata, dict) or not isinstance(storage_data, dict):
        raise CkptError(f"{path}: not a PyTorch DCP Metadata object (got {type(metadata).__name__})")

    try:
        items = index_items(state_dict_metadata, storage_data, item_class, consume)
    except pickle.UnpicklingError as exc:
        raise _corrupt(path, exc) from None
    except IndexValueError as exc:
        raise CkptError(f"{path}: {exc}") from None
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise CkptError(f"{path}: unexpected DCP metadata structure ({type(exc).__name__}: {exc})") from None

    storage_meta = record_attr(metadata, "storage_meta")
    checkpoint_id = record_attr(storage_meta, "checkpoint_id") if storage_meta is not None else None
    known = {"state_dict_metadata", "storage_data", "planner_data", "storage_meta", "version"}
    extra: tuple[str, ...] = ()
    if isinstance(metadata, StandIn):
        extra = tuple(k for k in (metadata.stand_in_state or {}) if k not in known)
    cls = type(metadata)
    class_name = cls.qualified_name() if isinstance(metadata, StandIn) else f"{cls.__module__}.{cls.__name__}"
    return DcpIndex(
        items,
        record_attr(metadata, "version"),
        class_name,
        None if checkpoint_id is None else str(checkpoint_id),
        extra,
        tuple(unlisted),
        has_planner_mapping(record_attr(metadata, "planner_data")),
    )


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
    return unpickler.dumps(metadata)


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
