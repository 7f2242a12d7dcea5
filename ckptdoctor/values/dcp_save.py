"""Write a plain PyTorch DCP save chunk by chunk, in the files ``torch.distributed.checkpoint.save`` writes.

One data file ``__0_0.distcp`` (what DCP's ``FileSystemWriter`` names rank 0's file) holds each tensor chunk as
one ``torch.save`` blob and each bytes item as its raw bytes, back to back; ``.metadata`` is DCP's own
``Metadata`` object (tensor chunks, storage locations, the default planner's ``planner_data``, or None as
Megatron's torch_dist saves it), pickled as DCP pickles it. Chunks are written as they come: memory holds one
chunk, never a tensor or the checkpoint. Like the reader (:mod:`ckptdoctor.values.read`), this module needs
torch and is imported only when values are written.
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor import atomic
from ckptdoctor.errors import CkptError
from ckptdoctor.values.read import require_torch

DATA_FILE = "__0_0.distcp"
METADATA_FILE = ".metadata"


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: str
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], int, int]] = field(default_factory=list)  # offs, sizes, at, n


class DcpSaveWriter:
    """A new plain DCP save in ``directory`` (which must exist): declare each tensor, write its chunks, write the
    bytes items, then :meth:`finish` (fsync, ``.metadata``). Use it as a context manager: the data file is closed
    on any exit; what was written stays for the caller's staging dir to remove."""

    def __init__(self, directory: Path, flattened: bool = True) -> None:
        self._torch = require_torch("writing tensor values")
        self._directory = directory
        self._file = open(directory / DATA_FILE, "xb")  # noqa: SIM115 - closed by finish() or __exit__
        self._position = 0
        self._tensors: dict[str, _Tensor] = {}
        self._bytes: dict[str, tuple[int, int]] = {}
        self._paths: dict[str, tuple[str, ...]] = {}
        # DCP's default planner records each key's nested path; Megatron's torch_dist saves unflattened (None)
        self._flattened = flattened

    def declare_tensor(self, key: str, shape: tuple[int, ...], dtype: str, path: tuple[str, ...] | None = None) -> None:
        if key in self._tensors or key in self._bytes:
            raise CkptError(f"{key}: written twice")
        self._tensors[key] = _Tensor(tuple(shape), dtype)
        self._paths[key] = path or (key,)

    def write_chunk(self, key: str, offsets: tuple[int, ...], value: Any) -> int:
        """Append one chunk of a declared tensor at ``offsets``; returns the bytes written."""
        tensor = self._tensors[key]
        if str(value.dtype) != tensor.dtype:
            raise CkptError(f"{key}: chunk dtype {value.dtype} differs from {tensor.dtype}")
        sizes = tuple(int(s) for s in value.shape)
        if len(sizes) != len(tensor.shape) or any(o < 0 or o + s > g for o, s, g in zip(offsets, sizes, tensor.shape)):
            raise CkptError(f"{key}: chunk {list(sizes)} at {list(offsets)} outside {list(tensor.shape)}")
        buffer = io.BytesIO()
        # a compact copy: torch.save of a view would store the whole storage it views
        self._torch.save(value.contiguous().clone(), buffer)
        data = buffer.getbuffer()
        self._file.write(data)
        tensor.chunks.append((tuple(offsets), sizes, self._position, len(data)))
        self._position += len(data)
        return len(data)

    def write_bytes(self, key: str, payload: bytes, path: tuple[str, ...] | None = None) -> None:
        """A bytes item: ``payload`` is what ``dcp.load`` hands to ``torch.load`` (a ``torch.save`` archive)."""
        if key in self._tensors or key in self._bytes:
            raise CkptError(f"{key}: written twice")
        self._file.write(payload)
        self._bytes[key] = (self._position, len(payload))
        self._position += len(payload)
        self._paths[key] = path or (key,)

    def finish(self) -> int:
        """Fsync the data file, check every tensor is covered, write ``.metadata``; returns the data bytes."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        for key, tensor in self._tensors.items():
            covered = sum(_numel(sizes) for _offsets, sizes, _at, _n in tensor.chunks)
            if covered != _numel(tensor.shape):
                raise CkptError(f"{key}: chunks cover {covered} of {_numel(tensor.shape)} elements")
        atomic.write_atomic(self._directory / METADATA_FILE, pickle.dumps(self._metadata()))
        return self._position

    def _metadata(self) -> Any:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        torch = self._torch
        state: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        for key, tensor in self._tensors.items():
            chunks = []
            for index, (offsets, sizes, at, length) in enumerate(tensor.chunks):
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
                storage[MetadataIndex(key, torch.Size(offsets), index)] = _StorageInfo(DATA_FILE, at, length)
            dtype = getattr(torch, tensor.dtype.removeprefix("torch."))
            state[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(tensor.shape), chunks)
        for key, (at, length) in self._bytes.items():
            state[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _StorageInfo(DATA_FILE, at, length)
        return Metadata(
            state_dict_metadata=state, planner_data=dict(self._paths) if self._flattened else None, storage_data=storage
        )

    def __enter__(self) -> DcpSaveWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._file.closed:
            self._file.close()


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for size in sizes:
        n *= size
    return n
