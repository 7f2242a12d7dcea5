"""Write a plain PyTorch DCP save chunk by chunk, in the files ``torch.distributed.checkpoint.save`` writes.

Data files (named by the caller as DCP's ``FileSystemWriter`` names them, ``__<rank>_<n>.distcp``) each hold tensor
chunks as one ``torch.save`` blob apiece and bytes items as their raw bytes, back to back; several can be written at
once by worker processes, each returning the records of what it wrote. ``.metadata`` is DCP's own ``Metadata``
object (tensor chunks, storage locations, the default planner's ``planner_data``, or None as Megatron's torch_dist
saves it), pickled as DCP pickles it, written last from the records in a fixed order. Chunks are written as they
come: memory holds one chunk per writer, never a tensor or the checkpoint. Like the reader
(:mod:`ckptdoctor.values.read`), this module needs torch and is imported only when values are written."""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptdoctor import atomic
from ckptdoctor.errors import CkptError
from ckptdoctor.values.read import require_torch

METADATA_FILE = ".metadata"


@dataclass(frozen=True)
class ChunkRecord:
    """Where one written tensor chunk lies: its key, offsets and sizes in the global tensor, file, byte range."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    at: int
    length: int


@dataclass(frozen=True)
class BytesRecord:
    key: str
    file: str
    at: int
    length: int


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: str


class DcpSaveLayout:
    """What a new plain DCP save holds: each tensor's global shape and dtype, each item's nested path. The data
    files are written apart (:class:`DataFileWriter`, one per worker), then :meth:`write_metadata` joins their
    records, in the order given, into ``.metadata``."""

    def __init__(self, flattened: bool = True) -> None:
        self.tensors: dict[str, _Tensor] = {}
        self.paths: dict[str, tuple[str, ...]] = {}
        # DCP's default planner records each key's nested path; Megatron's torch_dist saves unflattened (None)
        self.flattened = flattened

    def declare_tensor(self, key: str, shape: tuple[int, ...], dtype: str, path: tuple[str, ...] | None = None) -> None:
        if key in self.tensors:
            raise CkptError(f"{key}: written twice")
        self.tensors[key] = _Tensor(tuple(shape), dtype)
        self.paths[key] = path or (key,)

    def write_metadata(self, directory: Path, chunks: list[ChunkRecord], items: list[BytesRecord]) -> None:
        """Check every tensor is covered, each bytes item written once, then write ``.metadata`` atomically."""
        covered: dict[str, int] = dict.fromkeys(self.tensors, 0)
        for record in chunks:
            covered[record.key] += _numel(record.sizes)
        for key, tensor in self.tensors.items():
            if covered[key] != _numel(tensor.shape):
                raise CkptError(f"{key}: chunks cover {covered[key]} of {_numel(tensor.shape)} elements")
        seen: set[str] = set()
        for item in items:
            if item.key in self.tensors or item.key in seen:
                raise CkptError(f"{item.key}: written twice")
            seen.add(item.key)
        atomic.write_atomic(directory / METADATA_FILE, pickle.dumps(self._metadata(chunks, items)))

    def _metadata(self, records: list[ChunkRecord], items: list[BytesRecord]) -> Any:
        torch = require_torch("writing tensor values")
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        by_key: dict[str, list[ChunkRecord]] = {key: [] for key in self.tensors}
        for record in records:
            by_key[record.key].append(record)
        state: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        for key, tensor in self.tensors.items():
            chunks = []
            for index, record in enumerate(by_key[key]):
                offsets = torch.Size(record.offsets)
                chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(record.sizes)))
                storage[MetadataIndex(key, offsets, index)] = _StorageInfo(record.file, record.at, record.length)
            dtype = getattr(torch, tensor.dtype.removeprefix("torch."))
            state[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(tensor.shape), chunks)
        for item in items:
            state[item.key] = BytesStorageMetadata()
            storage[MetadataIndex(item.key)] = _StorageInfo(item.file, item.at, item.length)
        planner = {key: self.paths.get(key, (key,)) for key in state} if self.flattened else None
        return Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage)


class DataFileWriter:
    """One new data file ``name`` in ``directory`` (which must exist): tensor chunks (each one ``torch.save``
    blob) and bytes items back to back, as they come; memory holds one chunk. :meth:`close` fsyncs and returns
    what was written where. Use it as a context manager: the file is closed on any exit; what was written stays
    for the caller's staging dir to remove."""

    def __init__(self, directory: Path, name: str, layout: DcpSaveLayout) -> None:
        self._torch = require_torch("writing tensor values")
        self._name = name
        self._layout = layout
        self._file = open(directory / name, "xb")  # noqa: SIM115 - closed by close() or __exit__
        self._position = 0
        self.chunks: list[ChunkRecord] = []
        self.items: list[BytesRecord] = []

    def write_chunk(self, key: str, offsets: tuple[int, ...], value: Any, cast: bool = False) -> int:
        """Append one chunk of a declared tensor at ``offsets``; returns the bytes written. ``cast``: the values are
        converted to the declared dtype (else a chunk of another dtype is an error)."""
        tensor = self._layout.tensors[key]
        if cast and str(value.dtype) != tensor.dtype:
            value = value.to(getattr(self._torch, tensor.dtype.removeprefix("torch.")))
        if str(value.dtype) != tensor.dtype:
            raise CkptError(f"{key}: chunk dtype {value.dtype} differs from {tensor.dtype}")
        sizes = tuple(int(s) for s in value.shape)
        if len(sizes) != len(tensor.shape) or any(o < 0 or o + s > g for o, s, g in zip(offsets, sizes, tensor.shape)):
            raise CkptError(f"{key}: chunk {list(sizes)} at {list(offsets)} outside {list(tensor.shape)}")
        buffer = io.BytesIO()
        self._torch.save(_compact(value), buffer)
        data = buffer.getbuffer()
        self._file.write(data)
        self.chunks.append(ChunkRecord(key, tuple(offsets), sizes, self._name, self._position, len(data)))
        self._position += len(data)
        return len(data)

    def write_bytes(self, key: str, payload: bytes, path: tuple[str, ...] | None = None) -> None:
        """A bytes item: ``payload`` is what ``dcp.load`` hands to ``torch.load`` (a ``torch.save`` archive)."""
        self._file.write(payload)
        self.items.append(BytesRecord(key, self._name, self._position, len(payload)))
        self._position += len(payload)
        self._layout.paths[key] = path or (key,)

    def close(self) -> int:
        """Flush and fsync the file; returns its bytes."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._position

    def __enter__(self) -> DataFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._file.closed:
            self._file.close()


def _compact(value: Any) -> Any:
    """``value`` itself when it is its whole storage, else a compact copy: ``torch.save`` of a view stores the
    whole storage it views (a SwiGLU half would carry the other half along)."""
    whole = value.numel() * value.element_size()
    if value.is_contiguous() and value.storage_offset() == 0 and value.untyped_storage().nbytes() == whole:
        return value
    return value.contiguous().clone()


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for size in sizes:
        n *= size
    return n
