"""Bitwise comparison of one tensor key across two checkpoints, streamed one chunk (pair) at a time.

Same chunk layout (the common case: a fine-tune saved with the base's parallelism): chunks are paired by
offsets and compared as raw blobs first, then as decoded storage bytes; torch is not needed. Different
layouts (another TP size, a consolidated base): overlapping regions of each chunk pair are compared with
torch, holding at most two chunks in memory. "Bitwise" means byte-equal values: -0.0 differs from 0.0 and
a NaN equals the same NaN.
"""

from __future__ import annotations

import zipfile
import zlib
from typing import TYPE_CHECKING, Any

from ckptdoctor.formats import torch_dist
from ckptdoctor.formats.torch_zip import load_torch_zip
from ckptdoctor.torch_stand_ins import TensorRef

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint, Entry
    from ckptdoctor.formats.torch_dist import DcpChunk


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _logical_bytes(ref: TensorRef) -> bytes | None:
    """A contiguous chunk's value bytes without torch; None when the view is strided (torch compares)."""
    itemsize = ref.dtype.itemsize if ref.dtype is not None else None
    if itemsize is None or (ref.numel > 1 and tuple(ref.stride) != _contiguous_strides(ref.size)):
        return None
    start = ref.storage_offset * itemsize
    return _storage_bytes(ref)[start : start + ref.numel * itemsize]


def _storage_bytes(ref: TensorRef) -> bytes:
    """The storage record's bytes; a corrupt record (bad CRC, truncated zip) becomes a one-line CkptError."""
    try:
        return ref.storage.data()
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as exc:
        from ckptdoctor.errors import CkptError

        raise CkptError(f"{getattr(ref, '_ckd_where', 'tensor chunk')}: unreadable storage ({exc})") from None


def _decode(checkpoint: Checkpoint, entry: Entry, chunk: DcpChunk, blob: bytes) -> TensorRef:
    where = f"{checkpoint.iteration_dir}: {entry.key} chunk at {list(chunk.offsets)}"
    ref = load_torch_zip(blob, where)
    if not isinstance(ref, TensorRef):
        from ckptdoctor.errors import CkptError

        raise CkptError(f"{where}: expected a tensor, found {type(ref).__name__}")
    ref._ckd_where = where  # type: ignore[attr-defined]  # names the chunk if its storage proves corrupt
    return ref


def _blob(checkpoint: Checkpoint, entry: Entry, chunk: DcpChunk) -> bytes:
    if chunk.storage is None:
        from ckptdoctor.errors import CkptError

        raise CkptError(f"{checkpoint.iteration_dir}: {entry.key} chunk at {list(chunk.offsets)}: no storage entry")
    return torch_dist.read_range(checkpoint.iteration_dir, chunk.storage)


def _same_layout_equal(a: Checkpoint, ea: Entry, b: Checkpoint, eb: Entry) -> bool:
    by_offsets = {c.offsets: c for c in eb.chunks}
    for chunk in ea.chunks:
        other = by_offsets[chunk.offsets]
        blob_a, blob_b = _blob(a, ea, chunk), _blob(b, eb, other)
        if blob_a == blob_b:
            continue
        ref_a, ref_b = _decode(a, ea, chunk, blob_a), _decode(b, eb, other, blob_b)
        bytes_a, bytes_b = _logical_bytes(ref_a), _logical_bytes(ref_b)
        if bytes_a is None or bytes_b is None:
            if not _torch_equal(_to_tensor(ref_a, a, ea), _to_tensor(ref_b, b, eb)):
                return False
        elif bytes_a != bytes_b:
            return False
    return True


def _to_tensor(ref: TensorRef, checkpoint: Checkpoint, entry: Entry) -> Any:
    from ckptdoctor.values.read import tensor_from_ref

    _storage_bytes(ref)  # read (and check) the record here, so corruption reports as a CkptError
    return tensor_from_ref(ref, f"{checkpoint.iteration_dir}: {entry.key}")


def _torch_equal(x: Any, y: Any) -> bool:
    import torch

    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))


def _cross_layout_equal(a: Checkpoint, ea: Entry, b: Checkpoint, eb: Entry) -> bool:
    from ckptdoctor.values.read import read_chunk, require_torch

    require_torch("comparing tensors saved with different chunk layouts")
    for ia, ca in enumerate(ea.chunks):
        xa = read_chunk(a, ea.key, ia)
        for ib, cb in enumerate(eb.chunks):
            region = torch_dist.chunk_overlap(ca, cb)
            if region is None:
                continue
            xb = read_chunk(b, eb.key, ib)
            if not _torch_equal(xa[region[0]], xb[region[1]]):
                return False
            del xb
    return True


def tensors_bitwise_equal(a: Checkpoint, ea: Entry, b: Checkpoint, eb: Entry) -> bool:
    """Whether tensor ``ea`` of ``a`` and ``eb`` of ``b`` hold byte-identical values (same shape and dtype)."""
    if ea.shape != eb.shape or ea.dtype != eb.dtype:
        return False
    layout_a = sorted((c.offsets, c.sizes) for c in ea.chunks)
    layout_b = sorted((c.offsets, c.sizes) for c in eb.chunks)
    if layout_a == layout_b:
        return _same_layout_equal(a, ea, b, eb)
    return _cross_layout_equal(a, ea, b, eb)
