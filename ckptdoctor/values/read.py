"""Tensor values, read one chunk at a time: one byte range, decoded through the safe unpickler.

This is the only module that needs torch for reading; it is imported only when values are asked for.
Memory stays bounded by the chunk being decoded, never the checkpoint.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ckptdoctor.coverage import coverage_problem
from ckptdoctor.errors import CkptError, MissingExtraError
from ckptdoctor.formats import BACKEND_ZARR, raw_chunk_ref, torch_dist
from ckptdoctor.formats.archive import CorruptRecord, chunk_limits, storage_ref, stored_record_problem, unpickle
from ckptdoctor.formats.torch_zip import load_torch_zip
from ckptdoctor.numpy_lazy import numpy_or_none
from ckptdoctor.pickle.torch_stand_ins import DtypeRef, TensorRef
from ckptdoctor.values import archive_memo

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint, Entry
    from ckptdoctor.formats.torch_dist import DcpChunk


def require_torch(purpose: str) -> Any:
    try:
        import torch
    except ImportError:
        raise MissingExtraError("torch", "torch", purpose) from None
    return torch


def tensor_from_ref(ref: TensorRef, where: str) -> Any:
    """A real ``torch.Tensor`` for a :class:`TensorRef` (copying its storage bytes once)."""
    torch = require_torch("decoding tensor values")
    if ref.dtype is None:
        raise CkptError(f"{where}: tensor storage has no known dtype")
    dtype = getattr(torch, ref.dtype.name, None)
    if dtype is None:
        raise CkptError(f"{where}: dtype {ref.dtype} is not known to this torch version")
    data = ref.storage.data()
    if not data:
        return torch.empty(ref.size, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=dtype)
    try:
        return flat.as_strided(ref.size, ref.stride, ref.storage_offset)
    except RuntimeError as exc:
        raise CkptError(f"{where}: tensor view does not fit its storage ({exc})") from None


def decode_chunk_ref(checkpoint: Checkpoint, entry: Entry, chunk: DcpChunk) -> TensorRef:
    """The :class:`TensorRef` stored for one chunk (no torch needed), checked against the metadata."""
    where = f"{checkpoint.iteration_dir}: {entry.key} chunk at {list(chunk.offsets)}"
    if chunk.storage is None:
        raise CkptError(f"{where}: no storage entry in .metadata")
    blob = torch_dist.read_range(checkpoint.iteration_dir, chunk.storage, entry.max_range_bytes(chunk))
    raw = raw_chunk_ref(checkpoint.location.backend, entry.dtype, chunk.sizes, blob, where)
    if raw is not None:
        return raw
    obj = load_torch_zip(blob, where, chunk_limits())
    if not isinstance(obj, TensorRef):
        raise CkptError(f"{where}: expected a tensor, found {type(obj).__name__}")
    if tuple(obj.size) != tuple(chunk.sizes):
        raise CkptError(f"{where}: stored shape {list(obj.size)} differs from metadata {list(chunk.sizes)}")
    if entry.dtype is not None and str(obj.dtype) != entry.dtype:
        raise CkptError(f"{where}: stored dtype {obj.dtype} differs from metadata {entry.dtype}")
    return obj


def read_chunk(checkpoint: Checkpoint, key: str, chunk_index: int) -> Any:
    """One chunk of a tensor as a ``torch.Tensor``: reads only that chunk's byte range."""
    entry = checkpoint.entries[key]
    chunk = entry.chunks[chunk_index]
    where = f"{checkpoint.iteration_dir}: {key} chunk {chunk_index}"
    return tensor_from_ref(decode_chunk_ref(checkpoint, entry, chunk), where)


def iter_chunks(checkpoint: Checkpoint, key: str) -> Iterator[tuple[DcpChunk, Any]]:
    """(chunk, tensor) for each chunk of a tensor key, one at a time."""
    for index, chunk in enumerate(checkpoint.entries[key].chunks):
        yield chunk, read_chunk(checkpoint, key, index)


def read_tensor(checkpoint: Checkpoint, key: str) -> Any:
    """The whole global tensor assembled from its chunks (for small tensors and tests)."""
    torch = require_torch("assembling tensor values")
    entry = checkpoint.entries[key]
    if entry.kind != "tensor" or entry.shape is None or entry.dtype is None:
        raise CkptError(f"{checkpoint.iteration_dir}: {key} is a bytes item, not a tensor")
    # chunks outside the shape fail to assign; a gap would show torch.empty's leftover memory as values
    why = coverage_problem(entry)
    if why is not None:
        raise CkptError(f"{checkpoint.iteration_dir / '.metadata'}: {key}: {why}")
    out = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype.removeprefix("torch.")))
    for chunk, value in iter_chunks(checkpoint, key):
        index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        out[index] = value
    return out


def read_region(checkpoint: Checkpoint, key: str, index: tuple[int, ...]) -> Any:
    """``global_tensor[index]`` for leading indices (a layer of a stacked key, an expert of it), assembled from the
    chunks that hold it only: memory is that slice and one chunk, not the global tensor (a stacked MoE key holds every
    layer's experts)."""
    torch = require_torch("assembling tensor values")
    entry = checkpoint.entries[key]
    if entry.kind != "tensor" or entry.shape is None or entry.dtype is None:
        raise CkptError(f"{checkpoint.iteration_dir}: {key} is a bytes item, not a tensor")
    why = coverage_problem(entry)
    if why is not None:
        raise CkptError(f"{checkpoint.iteration_dir / '.metadata'}: {key}: {why}")
    lead = len(index)
    if lead > len(entry.shape) or any(not 0 <= i < n for i, n in zip(index, entry.shape)):
        raise CkptError(f"{checkpoint.iteration_dir}: {key}: index {list(index)} outside its shape {entry.shape}")
    out = torch.empty(entry.shape[lead:], dtype=getattr(torch, entry.dtype.removeprefix("torch.")))
    for chunk in entry.chunks:
        if not all(o <= i < o + s for i, o, s in zip(index, chunk.offsets, chunk.sizes)):
            continue
        value, _ = read_chunk_view(checkpoint, entry, chunk)  # a view over the chunk's bytes, copied into out
        inner = tuple(i - o for i, o in zip(index, chunk.offsets))
        place = tuple(slice(o, o + s) for o, s in zip(chunk.offsets[lead:], chunk.sizes[lead:]))
        out[place] = value[inner]
    return out


# --- zero-copy chunk reads (diff --values and other bulk readers) -----------------------------------------

_VIEW_CACHE: dict[bytes, tuple] = {}  # data.pkl bytes -> (storage key, dtype name, numel, offset, size, stride)
_VIEW_CACHE_MAX = 4096
_ITEMSIZE: dict[Any, int] = {}


def _chunk_view(pkl: bytes, where: str) -> tuple:
    """The tensor view a chunk's ``data.pkl`` describes, through the safe unpickler (memoised by content).

    Chunks of one shape and dtype pickle to identical bytes, so a 20,000-key checkpoint unpickles a few
    hundred distinct views rather than one per chunk.
    """
    cached = _VIEW_CACHE.get(pkl)
    if cached is not None:
        return cached

    ref = unpickle(pkl, where, lambda pid: storage_ref(pid, where))
    if not isinstance(ref, TensorRef) or ref.dtype is None:
        raise CkptError(f"{where}: expected a tensor, found {type(ref).__name__}")
    view = (ref.storage.key, ref.dtype.name, ref.storage.numel, ref.storage_offset, ref.size, ref.stride)
    if len(_VIEW_CACHE) < _VIEW_CACHE_MAX:
        _VIEW_CACHE[pkl] = view
    return view


def read_chunk_view(
    checkpoint: Checkpoint, entry: Entry, chunk: DcpChunk, blob: bytes | None = None, verify_crc: bool = True
) -> tuple[Any, int]:
    """(tensor, bytes read) for one chunk: one byte range read, the tensor a view over those bytes (no copy).

    :func:`read_chunk` copies a chunk's storage twice while decoding (3x its size at peak); this keeps memory
    at the chunk's size, which bounds ``diff --values`` by the largest chunk. The tensor is read-only.
    ``blob`` is the chunk's byte range when the caller has read it already; ``verify_crc`` checks the CRC-32 of
    ``data.pkl`` and the storage record (a changed record is a :class:`CorruptRecord`, not a value). Falls back to
    :func:`read_chunk` for archives it does not expect (compressed records).
    """
    torch = require_torch("comparing tensor values")
    where = f"{checkpoint.iteration_dir}: {entry.key} chunk at {list(chunk.offsets)}"
    if chunk.storage is None:
        raise CkptError(f"{where}: no storage entry in .metadata")
    if blob is None:
        blob = torch_dist.read_range(checkpoint.iteration_dir, chunk.storage, entry.max_range_bytes(chunk))
    raw = raw_chunk_ref(checkpoint.location.backend, entry.dtype, chunk.sizes, blob, where)
    if raw is not None:
        return tensor_from_ref(raw, where), len(blob)
    archive = archive_memo.parse(blob, where)  # the directory of an archive like one parsed before: no parse
    if any(member.method for member in archive.members.values()):  # compressed records: the copying path
        return read_chunk(checkpoint, entry.key, entry.chunks.index(chunk)), len(blob)
    key, dtype_name, numel, offset, shape, stride = _chunk_view(
        bytes(archive.pickle(chunk_limits(), verify_crc)), where
    )
    if tuple(shape) != tuple(chunk.sizes):
        raise CkptError(f"{where}: stored shape {list(shape)} differs from metadata {list(chunk.sizes)}")
    if entry.dtype is not None and f"torch.{dtype_name}" != entry.dtype:
        raise CkptError(f"{where}: stored dtype torch.{dtype_name} differs from metadata {entry.dtype}")
    dtype = getattr(torch, dtype_name, None)
    if dtype is None:
        raise CkptError(f"{where}: dtype torch.{dtype_name} is not known to this torch version")
    record = archive.storage(key)
    if verify_crc:
        archive.read(record.name, record.size)
    start, size = record.start, record.size
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None:
        itemsize = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize > size:
        raise CkptError(f"{where}: storage record holds {size} bytes, the tensor needs {numel * itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype), len(blob)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the buffer is read-only bytes; nothing writes to the view
            flat = torch.frombuffer(blob, dtype=dtype, count=numel, offset=start)
        return flat.as_strided(shape, stride, offset), len(blob)
    except (RuntimeError, ValueError) as exc:
        raise CkptError(f"{where}: tensor view does not fit its storage ({exc})") from None


# --- bit patterns without torch (diff --values: equal values need no torch) -------------------------------

_INTS = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}  # signed: torch views them back losslessly (from_numpy)


_PLAIN: dict[tuple, tuple | None] = {}  # (layout, data.pkl, sizes, dtype, pickle limit) -> _plain_view's answer
_PLAIN_MAX = 4096


def chunk_bits(checkpoint: Checkpoint, entry: Entry, chunk: DcpChunk, blob: bytes) -> Any | None:
    """One chunk's elements as a numpy array of signed integers of the element's width (their bit patterns),
    shaped like the chunk: a view over ``blob``, no torch, no copy. None wherever this is not the plain case
    (no numpy; not a stored ``torch.save`` record; a view that is not the record's first elements in row-major
    order; an element width other than 1, 2, 4 or 8 bytes; anything :func:`read_chunk_view` would refuse):
    the caller then decodes the chunk with :func:`read_chunk_view`, which reports what is wrong. Raises
    :class:`CorruptRecord` where the record or ``data.pkl`` fails its CRC-32, as :func:`read_chunk_view` does.

    An archive whose directory matches a remembered layout (:func:`archive_memo.plain_key`) gets the answer
    given for the first archive of that layout, ``data.pkl``, sizes and dtype: everything the answer depends on
    (a few us a chunk instead of the archive object, the pickle read and the checks)."""
    np = numpy_or_none()
    if np is None or chunk.storage is None:
        return None
    key = None
    if checkpoint.location.backend != BACKEND_ZARR:
        key = archive_memo.plain_key(blob, chunk.sizes, entry.dtype)
        if key is not None and key in _PLAIN:
            view = _PLAIN[key]
        else:
            view = _plain_view(checkpoint, entry, chunk, blob)
            if key is not None and len(_PLAIN) < _PLAIN_MAX:
                _PLAIN[key] = view
    else:
        view = _plain_view(checkpoint, entry, chunk, blob)
    if view is None:
        return None
    problem = stored_record_problem(blob, view[5]) or stored_record_problem(blob, view[4])
    if problem is not None:
        raise CorruptRecord(f"{checkpoint.iteration_dir}: {entry.key} chunk at {list(chunk.offsets)}: {problem}")
    return np.frombuffer(blob, view[0], view[1], view[2]).reshape(view[3])


def _plain_view(checkpoint: Checkpoint, entry: Entry, chunk: DcpChunk, blob: bytes) -> tuple | None:
    """(integer dtype, count, record start, shape, record, data.pkl) of :func:`chunk_bits`'s view (the two stored
    members, whose CRC-32s it checks), or None (see there)."""
    where = f"{checkpoint.iteration_dir}: {entry.key} chunk at {list(chunk.offsets)}"
    try:
        if raw_chunk_ref(checkpoint.location.backend, entry.dtype, chunk.sizes, blob, where) is not None:
            return None
        archive = archive_memo.parse(blob, where)
        if archive.general or any(member.method for member in archive.members.values()):
            return None  # (the general reader's members have no CRC-32 position: read_chunk_view checks them)
        key, dtype_name, numel, offset, shape, stride = _chunk_view(bytes(archive.pickle(chunk_limits(), False)), where)
        record = archive.storage(key)
        pickle = archive.members[f"{archive.prefix}data.pkl"]
    except CkptError:
        return None
    if tuple(shape) != tuple(chunk.sizes) or entry.dtype is None or f"torch.{dtype_name}" != entry.dtype:
        return None
    itemsize = DtypeRef.get(dtype_name).itemsize
    kind = _INTS.get(itemsize or 0)
    count = 1
    for size in shape:
        count *= size
    if kind is None or offset != 0 or not count or count > numel or numel * (itemsize or 0) > record.size:
        return None
    step = 1
    for size, gap in zip(reversed(shape), reversed(stride)):  # row-major, contiguous (size-1 dims: any stride)
        if size != 1 and gap != step:
            return None
        step *= size
    return kind, count, record.start, tuple(shape), record, pickle
