"""The header of a ``.safetensors`` file, read by the format's own rules without the ``safetensors`` library.

A file is ``N`` (8 bytes, little-endian unsigned), then ``N`` bytes of UTF-8 JSON, then the byte buffer. The JSON is
an object: ``"__metadata__"`` (optional, strings to strings) and one entry per tensor,
``{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}``, offsets relative to the buffer. The library
refuses a header over 100 MB, a dtype it does not know, ``end - begin`` other than the shape's bytes, and tensors
that overlap or leave holes in the buffer; these are refusals here too (:class:`SafetensorsError`, one line). A
header whose last offset runs past the file (a truncated shard, or a header that lies about its data) is read,
and its ``buffer_bytes`` is less than ``data_bytes``: the caller reports it against the tensors it cuts.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import TypeGuard

from ckptdoctor.errors import CkptError
from ckptdoctor.storage.dispatch import as_path
from ckptdoctor.storage.files import known_size, open_handle, open_regular

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on N
MAX_DIMS = 64

# safetensors dtype -> (torch dtype name, bytes per element; 0 for sub-byte types counted in bits below)
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F64": ("float64", 8),
    "C64": ("complex64", 8),
}
_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}  # sub-byte dtypes: bytes = ceil(numel * bits / 8)
_TORCH_NAMES = {name: torch_name for name, (torch_name, _) in DTYPES.items()}


class SafetensorsError(CkptError):
    """A ``.safetensors`` file that is not one (a header the format's rules refuse)."""


@dataclass(slots=True)  # one per tensor of every shard: not frozen, whose __init__ is slower
class TensorInfo:
    name: str
    dtype: str  # the safetensors name ("F32", "BF16")
    shape: tuple[int, ...]
    begin: int  # offsets into the byte buffer (after the header)
    end: int

    @property
    def torch_dtype(self) -> str:
        return _TORCH_NAMES.get(self.dtype) or self.dtype.lower()


@dataclass
class SafetensorsHeader:
    path: str
    header_bytes: int  # N
    file_bytes: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        """Where the byte buffer starts in the file."""
        return 8 + self.header_bytes

    @property
    def buffer_bytes(self) -> int:
        """The bytes the file holds after its header."""
        return max(0, self.file_bytes - self.data_start)

    @property
    def data_bytes(self) -> int:
        """The bytes the header says its buffer holds."""
        return max((t.end for t in self.tensors.values()), default=0)

    def cut_tensors(self) -> list[str]:
        """The tensors whose bytes run past the end of the file."""
        return sorted(t.name for t in self.tensors.values() if t.end > self.buffer_bytes)


def element_bytes(dtype: str, numel: int) -> int:
    if dtype in _BITS:
        return -(-numel * _BITS[dtype] // 8)
    return numel * DTYPES[dtype][1]


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The header of one ``.safetensors`` file, local or on object storage (reads ``8 + N`` bytes, never the
    data: two ranged GETs of a remote file)."""
    where = str(path)
    with open_regular(as_path(path)) as f:
        file_bytes = known_size(f)
        if file_bytes is None:
            raise SafetensorsError(f"{where}: cannot read (its size is unknown)")
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{where}: {len(prefix)} bytes, too short for a safetensors header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{where}: header length {n} over the format's limit of {MAX_HEADER_BYTES} bytes")
        if n > file_bytes - 8:
            raise SafetensorsError(f"{where}: header length {n} runs past the end of the file ({file_bytes} bytes)")
        will_read = getattr(f, "will_read", None)
        if will_read is not None:  # a remote file: this range only (reading on would fetch the data ahead)
            will_read([(8, n)])
        raw = f.read(n)  # n is at most the file size and the format limit (checked above)
    return parse_header(raw, file_bytes, where)


def parse_header(raw: bytes, file_bytes: int, where: str) -> SafetensorsHeader:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise SafetensorsError(f"{where}: header is not UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise SafetensorsError(f"{where}: header is not JSON ({str(exc).split(':')[0]})") from None
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{where}: header is a JSON {type(doc).__name__}, not an object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{where}: __metadata__ is not a map of strings")
    tensors = {name: _tensor(name, spec, where) for name, spec in doc.items()}
    _check_buffer_layout(tensors, where)
    return SafetensorsHeader(where, len(raw), file_bytes, tensors, metadata)


def _sizes(value: object, length: int | None = None) -> TypeGuard[list[int]]:
    """A JSON list of non-negative ints (``type is int``: no bools), of ``length`` items when given."""
    return (
        type(value) is list
        and (len(value) == length if length is not None else len(value) <= MAX_DIMS)
        and all(type(n) is int and n >= 0 for n in value)
    )


def _tensor(name: str, spec: object, where: str) -> TensorInfo:
    # once per tensor of every shard (100k in a large export): type checks, not isinstance chains
    if type(spec) is not dict:
        raise SafetensorsError(f"{where}: tensor {name!r}: entry is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in DTYPES and dtype not in _BITS:
        raise SafetensorsError(f"{where}: tensor {name!r}: unknown dtype {dtype!r}")
    if not _sizes(shape):
        raise SafetensorsError(f"{where}: tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not _sizes(offsets, 2) or offsets[1] < offsets[0]:
        raise SafetensorsError(f"{where}: tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
    begin, end = offsets
    expected = element_bytes(dtype, math.prod(shape))
    if end - begin != expected:
        raise SafetensorsError(
            f"{where}: tensor {name!r}: data_offsets span {end - begin} bytes, "
            f"its {dtype} shape {shape} needs {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _check_buffer_layout(tensors: dict[str, TensorInfo], where: str) -> None:
    """The tensors tile the buffer from 0 with no overlap and no hole (the format's rule)."""
    at = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin < at:
            raise SafetensorsError(f"{where}: tensor {info.name!r} overlaps the one before it (offset {info.begin})")
        if info.begin > at:
            raise SafetensorsError(
                f"{where}: a hole in the data buffer before tensor {info.name!r} ({at}..{info.begin})"
            )
        at = info.end


class ShardTensors:
    """Some tensors of one shard read one after another (``--values``): the file opened once and their byte ranges
    planned ahead, so a remote shard is fetched in few coalesced ranged GETs, each byte once (a local one is read
    with ``pread``). Close it when done."""

    def __init__(self, header: SafetensorsHeader, names: list[str]) -> None:
        self.header = header
        infos = [header.tensors[name] for name in names]
        ranges = [(header.data_start + t.begin, t.end - t.begin) for t in infos if t.end > t.begin]
        self._handle = open_handle(as_path(header.path), ranges)

    def read(self, name: str) -> bytes:
        info = self.header.tensors[name]
        length = info.end - info.begin
        data = self._handle.pread(length, self.header.data_start + info.begin) if length else b""
        if len(data) != length:
            raise SafetensorsError(f"{self.header.path}: tensor {name!r} runs past the end of the file")
        return data

    def close(self) -> None:
        self._handle.close()
