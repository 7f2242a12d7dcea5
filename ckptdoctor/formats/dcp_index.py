"""The index of a DCP ``.metadata``: what its records become (:class:`DcpItem`, :class:`DcpChunk`,
:class:`StorageLocation`) and the loops that build them from the safe unpickler's objects.

The two loops (over the keys with each key's chunk records, then over ``storage_data``) run once per chunk, up to
millions in a large checkpoint: :func:`_items_py` and :func:`_attach_py`. Where the optional extension
``ckptdoctor.formats._dcp_index`` was built (``formats/_dcp_index.c``, ``_dcp_attach.c``), C does their work on
the records DCP writes, one way: it is given only the records and the tables, returns rows of plain values and
stops at anything else; :func:`_index_c` names the dtypes, makes the rows into items and lets these loops go on
from where C stopped, so the results and the first error are theirs (``tests/test_dcp_index_accel.py`` and
``fuzz/fuzz_native.py`` compare both).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptdoctor.pickle.index_records import DroppedRecord, IndexRecord, index_record_fields
from ckptdoctor.pickle.torch_stand_ins import DtypeRef


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
            raise IndexValueError(f"{ascii(key)}: {what} hold {_shown(dim)}, not an int64 size")
    if counts and math.prod(dims) >= INT64:
        raise IndexValueError(f"{ascii(key)}: {what} of 2**63 elements or more")
    return dims


def _shown(value: Any) -> str:
    """A value that is no size, as a message shows it: a plain value's text (cut at 40 characters), an object's type
    (the repr of an object the reader built for the pickle names the reader's internals, which differ between its C
    and Python paths)."""
    if type(value) is int:
        return f"an int of {value.bit_length()} bits" if value >= INT64 else ascii(value)
    if value is None or type(value) in (bool, float, str, bytes):
        return ascii(value)[:40]
    stands_for = getattr(type(value), "__ckd_global__", None)  # a stand-in: the global the pickle named
    module, name = stands_for if stands_for is not None else (type(value).__module__, type(value).__qualname__)
    return f"a {ascii(f'{module}.{name}')[1:-1][:80]} object"  # a stand-in's names come from the pickle


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


def dims_key(dims: tuple) -> bytes | None:
    """The key of a tuple of int64 ints in the index build's tables (``shared``, ``counted``, the storage pass's
    positions), or None for any other tuple: its bytes, whose hash is keyed per process. A tuple's own hash is not:
    tuples of ints can be made to collide at will, and a pickle of 40,000 such chunk offsets took a minute to index
    (hash flooding). The C loops key their tables the same way (``dcp_dims_key``)."""
    for dim in dims:
        if type(dim) is not int or not -INT64 <= dim < INT64:
            return None
    return struct.pack(f"<{len(dims)}q", *dims)


def _shared_dims(cache: dict, dims: tuple, key: Any, what: str, counts: bool = False) -> tuple:
    """``dims`` as the one object ``cache`` holds for it, checked by :func:`int64_dims` when first met."""
    dims_as_key = dims_key(dims)
    if dims_as_key is not None:
        known = cache.get(dims_as_key)
        if known is not None:
            return known
    checked = int64_dims(dims, key, what, counts)
    return checked if dims_as_key is None else cache.setdefault(dims_as_key, checked)


# Field getters at C speed, for loops over every chunk (10^6 in a large checkpoint): map/filter instead of a
# generator expression (~5x faster).
CHUNK_STORAGE = operator.itemgetter(2)  # DcpChunk.storage
STORAGE_PATH = operator.itemgetter(0)  # StorageLocation.relative_path
STORAGE_LENGTH = operator.itemgetter(2)  # StorageLocation.length


@dataclass(slots=True)
class DcpItem:
    key: str
    kind: str  # "tensor" or "bytes"
    dtype: str | None
    shape: tuple[int, ...] | None
    chunks: list[DcpChunk]


def _fields(record: Any) -> dict:
    """The state of one record of the metadata's dicts (an index-only record or a Record's own dict)."""
    if isinstance(record, IndexRecord):
        _ONE_STATE.add(type(record))
        return index_record_fields(record)
    if isinstance(record, DroppedRecord):  # what an index-only read builds for a part of megatron-core's save plans
        raise IndexValueError(
            "a save plan's record (SavePlan, WriteItem or TensorWriteData) stands where a metadata record belongs"
        )
    return record.__dict__


_ONE_STATE: set[type] = set()  # the index-only record classes met so far (see _fields)


def _drain(d: dict) -> Iterator[tuple[Any, Any]]:
    """The items of ``d``, newest first, each removed (and so freed once used) as it is yielded."""
    while d:
        yield d.popitem()


# A chunk and a storage location are built as plain tuple.__new__ calls (a NamedTuple's own __new__ is a
# Python function): one of each per chunk, up to millions for a large checkpoint.
_new_chunk = functools.partial(tuple.__new__, DcpChunk)
_new_location = functools.partial(tuple.__new__, StorageLocation)


def _attach_py(storage_data: dict, items: dict, consume: bool, shared: dict, pairs: Any = None) -> None:
    """Point each chunk of ``items`` at its entry of ``storage_data`` ({MetadataIndex: _StorageInfo}): the
    entry whose fqn is the key and whose offsets are the chunk's (None for a bytes item), every chunk with those
    offsets (a chunk listed twice gets the same one). Every entry is checked, whether a chunk names it or not.
    Of a key stored twice the last entry is kept, as a dict keeps it: ``consume`` pops the entries newest first
    (each freed once used) and keeps the first it sees. No (key, offsets) map is built: it was ~120 bytes per
    chunk at the peak of a read. ``pairs``: the entries from where the C pass stopped (``_index_c``)."""
    if pairs is None:
        pairs = _drain(storage_data) if consume else storage_data.items()
    tables: dict[Any, dict] = {}  # key -> {offsets: [positions]}, for keys of more than one chunk
    for index, info in pairs:
        # inline fast path of _fields: an index-only record BUILT once with a dict (every record DCP writes)
        index_fields = index[0] if type(index) in _ONE_STATE and len(index) == 1 else _fields(index)
        info_fields = info[0] if type(info) in _ONE_STATE and len(info) == 1 else _fields(info)
        if type(index_fields) is not dict or type(info_fields) is not dict:
            index_fields, info_fields = _fields(index), _fields(info)
        fqn = index_fields["fqn"]
        offset = index_fields.get("offset")
        if offset is not None:
            offset = _shared_dims(shared, tuple(offset), fqn, "offsets")
        relative_path = str(info_fields["relative_path"])
        known_path = shared.get(relative_path)
        if known_path is None:  # each distinct file name is checked once
            known_path = shared[relative_path] = inside_path(relative_path, fqn)
        start, length = info_fields["offset"], info_fields["length"]
        if type(start) is not int or type(length) is not int or not (0 <= start < INT64 and 0 <= length < INT64):
            # a byte range is two int64s >= 0: a negative length read the rest of the file (GBs), a float or an
            # int past int64 surfaced as an OverflowError from int() or pread
            int64_dims((start, length), fqn, "storage offset and length")
        item = items.get(fqn)
        if item is None or (offset is None) != (item.kind == "bytes"):
            continue  # no chunk names this entry
        chunks = item.chunks
        if offset is None:
            positions: Any = range(len(chunks))
        elif len(chunks) == 1:  # (C searches lists of up to 32 chunks; in Python a table is cheaper beyond one)
            positions = (0,) if chunks[0][0] == offset else ()
        else:
            table = tables.get(fqn)
            if table is None:
                table = tables[fqn] = {}
                for i, chunk in enumerate(chunks):
                    table.setdefault(dims_key(chunk[0]), []).append(i)
            positions = table.get(dims_key(offset), ())
        location = None
        for i in positions:
            chunk = chunks[i]
            if consume and chunk[2] is not None:
                continue  # a newer entry of this key was kept
            if location is None:
                location = _new_location((known_path, start, length))
            chunks[i] = _new_chunk((chunk[0], chunk[1], location))


def _chunks_py(chunks_meta: Any, key: str, shared: dict, counted: dict) -> list:
    """The chunks of one key from its chunk records, each without its storage location yet (see
    :func:`_attach_py`)."""
    chunks = []
    for chunk in chunks_meta:
        chunk_fields = chunk[0] if type(chunk) in _ONE_STATE and len(chunk) == 1 else _fields(chunk)
        if type(chunk_fields) is not dict:
            chunk_fields = _fields(chunk)
        raw_offsets = chunk_fields["offsets"]
        raw_sizes = chunk_fields["sizes"]
        offsets = _shared_dims(shared, tuple(raw_offsets), key, "offsets")
        sizes = _shared_dims(counted, tuple(raw_sizes), key, "sizes", True)
        chunks.append(_new_chunk((offsets, sizes, None)))
    return chunks


def _dtype_name(dtype: Any, key: str) -> str | None:
    """The name of a tensor's dtype (a ``DtypeRef``: reads look it up as a torch dtype), checked once per dtype."""
    if dtype is not None and not isinstance(dtype, DtypeRef):
        raise IndexValueError(f"{ascii(key)}: dtype {ascii(dtype)[:60]} is not a torch dtype")
    return None if dtype is None else str(dtype)


def _items_py(
    state_dict_metadata: dict,
    shared: dict,
    counted: dict,
    item_class: type[DcpItem],
    consume: bool,
    dtype_names: dict,
    items: dict | None = None,
    start: int = 0,
) -> dict[str, DcpItem]:
    """One ``item_class`` per key of ``state_dict_metadata`` (from its ``start``-th, added to ``items``: where the C
    loop stopped, see ``_index_c``), with its chunks (their locations come after, from :func:`_attach_py`);
    ``consume`` empties each key's chunk list once read."""
    items = {} if items is None else items
    # consume: each key's records go as soon as its item exists (its value set to None: no key added or removed,
    # so the iteration goes on), not when the whole dict is cleared: the index reuses their memory
    release = consume and type(state_dict_metadata) is dict
    pairs: Any = state_dict_metadata.items()
    for key, item_meta in itertools.islice(pairs, start, None) if start else pairs:
        item_fields = _fields(item_meta)
        chunks_meta = item_fields.get("chunks")
        if chunks_meta is None:  # BytesStorageMetadata
            items[key] = item_class(key, "bytes", None, None, [_new_chunk(((), (), None))])
            if release:
                state_dict_metadata[key] = None
            continue
        chunks = _chunks_py(chunks_meta, key, shared, counted)
        if consume:
            chunks_meta.clear()
        properties = item_fields.get("properties")
        # TensorProperties pickles its fields as a tuple (dtype, layout, requires_grad, memory_format, pin)
        fields = {} if properties is None else _fields(properties)
        state = fields.get("_ckd_state")
        dtype = state[0] if isinstance(state, tuple) and state else fields.get("dtype")
        if dtype not in dtype_names:
            dtype_names[dtype] = _dtype_name(dtype, key)
        known = _shared_dims(counted, tuple(item_fields["size"]), key, "global shape", True)
        items[key] = item_class(key, "tensor", dtype_names[dtype], known, chunks)
        if release:
            state_dict_metadata[key] = None
    return items


_c_items: Any
_c_attach: Any
try:
    from ckptdoctor.formats._dcp_index import attach as _c_attach
    from ckptdoctor.formats._dcp_index import items as _c_items
except ImportError:  # built without a compiler (or ckptdoctor.pickle._native not built): the Python loops run
    _c_attach = _c_items = None
_use_c = _c_items is not None  # (a test hook: the tests compare both)


def _located(chunks: list) -> None:
    """The chunks of a C row, ``(offsets, sizes, (path, offset, length) or None)``, made :class:`DcpChunk` in
    place; chunks that share a location (one entry) share its :class:`StorageLocation`, as in :func:`_attach_py`."""
    made: dict[int, tuple] = {}  # id(location) -> (location, StorageLocation): the location kept alive
    for i, (offsets, sizes, location) in enumerate(chunks):
        if location is not None:
            known = made.get(id(location))
            if known is None:
                known = made[id(location)] = (location, _new_location(location))
            location = known[1]
        chunks[i] = _new_chunk((offsets, sizes, location))


def _index_c(
    state_dict_metadata: dict, storage_data: dict, item_class: type[DcpItem], consume: bool, shared: dict, counted: dict
) -> dict[str, DcpItem]:
    """:func:`_items_py` then :func:`_attach_py`, with the C loops doing what they can: they read the records DCP
    writes and stop at anything else, returning plain rows; here their dtypes are checked and named (in order, as
    the Python loop would, before the storage pass), the rows made into items, and the Python loops go on from
    where C stopped. The same result and the same first error as the Python loops by construction."""
    rows: dict[Any, Any]
    rows, stop, dtypes = _c_items(state_dict_metadata, shared, counted, consume)
    dtype_names: dict = {}
    for key, dtype in dtypes:
        if dtype not in dtype_names:
            dtype_names[dtype] = _dtype_name(dtype, key)
    stopped: Any = (0, None)
    if stop is None and type(storage_data) is dict and _c_attach is not None:
        stopped = _c_attach(storage_data, rows, consume, shared)
    items: dict[str, DcpItem] = {}
    new_chunk, new_location = _new_chunk, _new_location  # (locals: one row per key, 10^6 in a large checkpoint)
    for key, (dtype, shape, chunks) in rows.items():
        if len(chunks) == 1:  # (most keys: inline)
            offsets, sizes, location = chunks[0]
            chunks[0] = new_chunk((offsets, sizes, location and new_location(location)))
        else:
            _located(chunks)
        if shape is None:
            items[key] = item_class(key, "bytes", None, None, chunks)
        else:
            items[key] = item_class(key, "tensor", dtype_names[dtype], shape, chunks)
        rows[key] = None  # its row goes now (a value set: the iteration goes on)
    if stop is not None:
        _items_py(state_dict_metadata, shared, counted, item_class, consume, dtype_names, items, stop)
    if consume:
        state_dict_metadata.clear()
    if stopped is not None:  # the storage pass from the entry C stopped at (popped by it with consume)
        done, pair = stopped
        if consume:
            rest: Any = _drain(storage_data) if pair is None else itertools.chain([pair], _drain(storage_data))
        else:
            rest = itertools.islice(storage_data.items(), done, None) if done else None
        _attach_py(storage_data, items, consume, shared, rest)
    return items


def index_items(
    state_dict_metadata: dict, storage_data: dict, item_class: type[DcpItem], consume: bool
) -> dict[str, DcpItem]:
    """Entries from the metadata records (every object here comes from the safe unpickler).

    Memory: one tuple object per distinct offsets / sizes / shape and one string per data file, shared by
    every chunk that has them; per chunk only a :class:`DcpChunk`, its :class:`StorageLocation` and their
    offset and length ints remain. ``consume`` empties the records' dicts and chunk lists as it goes."""
    shared: dict[Any, Any] = {}  # one object per distinct offsets tuple or relative path (each checked once)
    counted: dict[tuple, tuple] = {}  # the same for sizes and shapes, whose element count is checked too
    if _use_c:
        items = _index_c(state_dict_metadata, storage_data, item_class, consume, shared, counted)
    else:
        items = _items_py(state_dict_metadata, shared, counted, item_class, consume, {})
        if consume:
            state_dict_metadata.clear()
        _attach_py(storage_data, items, consume, shared)
    return items
