"""Tensor values, read one chunk at a time: one byte range, decoded through the safe unpickler.

This is the only module that needs torch for reading; it is imported only when values are asked for.
Memory stays bounded by the chunk being decoded, never the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ckptdoctor.errors import CkptError, MissingExtraError
from ckptdoctor.formats import torch_dist
from ckptdoctor.formats.torch_zip import load_torch_zip
from ckptdoctor.safe_pickle import TensorRef

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
    blob = torch_dist.read_range(checkpoint.iteration_dir, chunk.storage)
    obj = load_torch_zip(blob, where)
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
    if entry.kind != "tensor" or entry.shape is None:
        raise CkptError(f"{checkpoint.iteration_dir}: {key} is a bytes item, not a tensor")
    out = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype.removeprefix("torch.")))
    for chunk, value in iter_chunks(checkpoint, key):
        index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        out[index] = value
    return out
