"""The torch_dist backend: PyTorch DCP ``.metadata`` plus ``__<rank>_<n>.distcp`` data files.

``.metadata`` is read through the safe unpickler, so the DCP classes (and Megatron's ``MCoreMetadata`` /
``MCoreSavePlan`` of core 0.11-0.15) arrive as inert stand-ins; only their recorded state is used here.
"""

from __future__ import annotations

import functools
import math
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ckptdoctor import safe_pickle
from ckptdoctor.errors import CkptError, PickleLimitError
from ckptdoctor.formats.archive import unpickle
from ckptdoctor.formats.files import open_regular, read_capped
from ckptdoctor.gc_pause import gc_paused
from ckptdoctor.pickle_limits import current_limits
from ckptdoctor.stand_ins import STAND_IN_TYPES, IndexRecord, StandIn, index_record_fields
from ckptdoctor.torch_stand_ins import DtypeRef

DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


class IndexValueError(ValueError):
    """A value of ``.metadata`` that no command may act on (its message says which, without the file's path)."""


def inside_path(relative_path: str, fqn: Any = None) -> str:
    """``relative_path`` if it names a file inside the iteration dir, else :class:`IndexValueError`.

    DCP writes plain file names (``__0_0.distcp``), but the name comes from the pickle: an absolute path or a
    ``..`` would make every reader (check --deep, diff --values, show) read a file outside the checkpoint, and
    a compacting write create one outside its output. Nested relative names are left to the missing-file check.
    """
    parts = relative_path.split("/")
    if (
        relative_path.startswith("/")
        or "\\" in relative_path
        or "\0" in relative_path
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise IndexValueError(
            f"the storage entry of {ascii(fqn)} names a data file outside the iteration dir "
            f"({ascii(relative_path)}); refusing to read through it"
        )
    return relative_path


INT64 = 1 << 63  # sizes, offsets and element counts are int64 in torch


def int64_dims(dims: tuple, key: Any, what: str, counts: bool = False) -> tuple:
    """``dims`` if every one is an int in [0, 2**63) (what a torch size or offset can be) and, for sizes
    (``counts``), their element count is too; else :class:`IndexValueError`. From the pickle, a size could be
    any int: an element count of thousands of digits stops every report that prints it (Python refuses ints of
    more than 4,300 digits) and overflows every float it is turned into."""
    for dim in dims:
        if type(dim) is not int or not 0 <= dim < INT64:
            shown = f"an int of {dim.bit_length()} bits" if type(dim) is int and dim >= INT64 else ascii(dim)[:40]
            raise IndexValueError(f"{ascii(key)}: {what} hold {shown}, not an int64 size")
    if counts and math.prod(dims) >= INT64:
        raise IndexValueError(f"{ascii(key)}: {what} of 2**63 elements or more")
    return dims


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


@dataclass(slots=True)
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
    # names of the other attributes of the metadata object (mcore_data, all_local_plans, ...); their values
    # are not kept (all_local_plans holds a record per chunk and rank: a second copy of the index)
    extra: tuple[str, ...] = ()
    unlisted: tuple[str, ...] = ()  # tolerated globals not on the allowlist (CKD402)


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


def _fields(record: Any) -> dict:
    """The state of one record of the metadata's dicts (an index-only record or a Record's own dict)."""
    if isinstance(record, IndexRecord):
        _ONE_STATE.add(type(record))
        return index_record_fields(record)
    return record.__dict__


def read_metadata(path: Path, item_class: type[DcpItem] = DcpItem) -> DcpIndex:
    """Parse a DCP ``.metadata`` file into a :class:`DcpIndex` (no data file is opened).

    ``item_class`` (a :class:`DcpItem` subclass) lets the Checkpoint model get its entries built directly.
    The records are read index-only (see ``safe_globals.index_only``) and dropped while the index is built,
    so the index is all that stays in memory.
    """
    with gc_paused():
        return _read_metadata(path, item_class)


_WHAT = "DCP metadata"


def _load_metadata_pickle(path: Path, unlisted: list[str] | None = None, index_only: bool = False) -> Any:
    try:
        with open_regular(path) as f:
            data = read_capped(f, current_limits().max_bytes)
    except OSError as exc:
        raise CkptError(f"{path}: cannot read ({exc.strerror})") from None
    return unpickle(data, str(path), unlisted=unlisted, what=_WHAT, index_only=index_only)


def _corrupt(path: Path, exc: Exception) -> CkptError:
    return CkptError(f"{path}: corrupt {_WHAT} ({type(exc).__name__}: {exc})")


def _read_metadata(path: Path, item_class: type[DcpItem] = DcpItem) -> DcpIndex:
    unlisted: list[str] = []
    metadata = _load_metadata_pickle(path, unlisted, index_only=True)
    return _index_from_object(metadata, path, item_class, unlisted, consume=True)


def read_metadata_for_rewrite(path: Path, item_class: type[DcpItem] = DcpItem) -> tuple[DcpIndex, Any]:
    """The index and the ``.metadata`` object itself from one read, for a command that rewrites it (``edit``).
    Strict, as :func:`load_metadata_object`: a global outside the allowlist is refused, not tolerated."""
    with gc_paused():
        metadata = _load_metadata_pickle(path)
        return _index_from_object(metadata, path, item_class, [], consume=False), metadata


def _index_from_object(
    metadata: Any, path: Path, item_class: type[DcpItem], unlisted: list[str], consume: bool
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
        items = _index_items(state_dict_metadata, storage_data, item_class, consume)
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
    )


_MISSING: Any = object()
_ONE_STATE: set[type] = set()  # the index-only record classes met so far (see _fields)


def _drain(d: dict) -> Iterator[tuple[Any, Any]]:
    """The items of ``d``, newest first, each removed (and so freed once used) as it is yielded."""
    while d:
        yield d.popitem()


# A chunk and a storage location are built as plain tuple.__new__ calls (a NamedTuple's own __new__ is a
# Python function): one of each per chunk, up to millions for a large checkpoint.
_new_chunk = functools.partial(tuple.__new__, DcpChunk)
_new_location = functools.partial(tuple.__new__, StorageLocation)


def _index_items(
    state_dict_metadata: dict, storage_data: dict, item_class: type[DcpItem], consume: bool
) -> dict[str, DcpItem]:
    """Entries from the metadata records. Runs once per chunk (up to millions in a large checkpoint), so
    it reads the records' state dicts directly: every object here comes from the safe unpickler.

    Memory: one tuple object per distinct offsets / sizes / shape and one string per data file, shared by
    every chunk that has them; per chunk only a :class:`DcpChunk`, its :class:`StorageLocation` and their
    offset and length ints remain. ``consume`` empties the records' dicts and chunk lists as it goes."""
    shared: dict[Any, Any] = {}  # one object per distinct offsets tuple or relative path (each checked once)
    counted: dict[tuple, tuple] = {}  # the same for sizes and shapes, whose element count is checked too
    # (fqn, chunk offsets or None) -> storage location
    locations: dict[tuple[str, tuple[int, ...] | None], StorageLocation] = {}
    if consume:  # newest first, so of a key stored twice the last entry is kept, as a dict keeps it
        pairs: Any = _drain(storage_data)
        add: Any = locations.setdefault
    else:
        pairs = storage_data.items()
        add = locations.__setitem__
    for index, info in pairs:
        # inline fast path of _fields: an index-only record BUILT once with a dict (every record DCP writes)
        index_fields = index[0] if type(index) in _ONE_STATE and len(index) == 1 else _fields(index)
        info_fields = info[0] if type(info) in _ONE_STATE and len(info) == 1 else _fields(info)
        if type(index_fields) is not dict or type(info_fields) is not dict:
            index_fields, info_fields = _fields(index), _fields(info)
        fqn = index_fields["fqn"]
        offset = index_fields.get("offset")
        if offset is not None:
            offset = tuple(offset)
            known = shared.get(offset)
            offset = known if known is not None else shared.setdefault(offset, int64_dims(offset, fqn, "offsets"))
        relative_path = str(info_fields["relative_path"])
        known_path = shared.get(relative_path)
        if known_path is None:  # each distinct file name is checked once
            known_path = shared[relative_path] = inside_path(relative_path, fqn)
        start, length = info_fields["offset"], info_fields["length"]
        if type(start) is not int or type(length) is not int or not (0 <= start < INT64 and 0 <= length < INT64):
            # a byte range is two int64s >= 0: a negative length read the rest of the file (GBs), a float or an
            # int past int64 surfaced as an OverflowError from int() or pread
            int64_dims((start, length), fqn, "storage offset and length")
        add((fqn, offset), _new_location((known_path, start, length)))
    dtype_names: dict[Any, str | None] = {}
    items: dict[str, DcpItem] = {}
    take = locations.pop if consume else locations.get
    for key, item_meta in state_dict_metadata.items():
        item_fields = _fields(item_meta)
        chunks_meta = item_fields.get("chunks")
        if chunks_meta is None:  # BytesStorageMetadata
            items[key] = item_class(key, "bytes", None, None, [_new_chunk(((), (), take((key, None), None)))])
            continue
        chunks = []
        taken: dict = {}  # a chunk listed twice gets the location the first one got
        for chunk in chunks_meta:
            chunk_fields = chunk[0] if type(chunk) in _ONE_STATE and len(chunk) == 1 else _fields(chunk)
            if type(chunk_fields) is not dict:
                chunk_fields = _fields(chunk)
            offsets = tuple(chunk_fields["offsets"])
            known = shared.get(offsets)
            offsets = known if known is not None else shared.setdefault(offsets, int64_dims(offsets, key, "offsets"))
            sizes = tuple(chunk_fields["sizes"])
            known = counted.get(sizes)
            sizes = known if known is not None else counted.setdefault(sizes, int64_dims(sizes, key, "sizes", True))
            location = taken.get(offsets, _MISSING)
            if location is _MISSING:
                location = taken[offsets] = take((key, offsets), None)
            chunks.append(_new_chunk((offsets, sizes, location)))
        if consume:
            chunks_meta.clear()
        properties = item_fields.get("properties")
        # TensorProperties pickles its fields as a tuple (dtype, layout, requires_grad, memory_format, pin)
        fields = {} if properties is None else _fields(properties)
        state = fields.get("_ckd_state")
        dtype = state[0] if isinstance(state, tuple) and state else fields.get("dtype")
        if dtype not in dtype_names:
            if dtype is not None and not isinstance(dtype, DtypeRef):  # reads look its name up as a torch dtype
                raise IndexValueError(f"{ascii(key)}: dtype {ascii(dtype)[:60]} is not a torch dtype")
            dtype_names[dtype] = None if dtype is None else str(dtype)
        shape = tuple(item_fields["size"])
        known = counted.get(shape)
        if known is None:
            known = counted[shape] = int64_dims(shape, key, "global shape", True)
        items[key] = item_class(key, "tensor", dtype_names[dtype], known, chunks)
    if consume:
        state_dict_metadata.clear()
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
