"""The legacy zarr backend (core <= 0.14), indexed from its JSON ``.zarray`` files alone.

Each tensor key is a zarr v2 array directory (``.zarray`` + uncompressed chunk files such as ``0.0.0``,
one chunk per rank's local shape); each ShardedObject is ``<key>/shard_<offsets>_<shape>.pt``.
Metadata needs no zarr package (the ``.zarray`` files are JSON); only value decoding would.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TypeGuard

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.torch_dist import INT64, DcpChunk, StorageLocation
from ckptdoctor.pickle.torch_stand_ins import TORCH_DTYPES, DtypeRef, StorageRef, TensorRef
from ckptdoctor.storage.files import file_sizes, list_tree, read_json

# numpy type strings as zarr writes them -> torch dtype names; Megatron patches bfloat16 in by name.
_ZARR_DTYPES = {
    "<f4": "float32",
    "<f8": "float64",
    "<f2": "float16",
    "bfloat16": "bfloat16",
    "<i8": "int64",
    "<i4": "int32",
    "<i2": "int16",
    "|i1": "int8",
    "|u1": "uint8",
    "|b1": "bool",
    "<c8": "complex64",
    "<c16": "complex128",
}


def _zarray(path: Path) -> dict:
    try:
        meta = read_json(path)
    except (OSError, json.JSONDecodeError) as exc:
        raise CkptError(f"{path}: unreadable zarr array metadata ({exc})") from None
    why = _zarray_problem(meta)
    if why:
        raise CkptError(f"{path}: invalid zarr array metadata ({why})")
    return meta


def _dims(value: object) -> TypeGuard[list[int]]:
    """A list of int64 sizes whose element count is an int64 too (a JSON int can have thousands of digits)."""
    return (
        isinstance(value, list) and all(type(v) is int and 0 <= v < INT64 for v in value) and math.prod(value) < INT64
    )


def _zarray_problem(meta: object) -> str | None:
    """Why a parsed ``.zarray`` cannot describe an array (None when it can): the fields indexing reads must
    have zarr v2's types, or a hostile file would surface as a TypeError instead of an error naming it."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    shape, chunks = meta.get("shape"), meta.get("chunks")
    if not _dims(shape):
        return f"shape {str(shape)[:60]} is not a list of int64 sizes (of an int64 element count)"
    if not _dims(chunks) or len(chunks) != len(shape) or 0 in chunks:
        return f"chunks {str(chunks)[:60]} is not a list of positive int64 sizes, one per axis of shape"
    dtype = meta.get("dtype")
    if not isinstance(dtype, str) or (dtype not in _ZARR_DTYPES and dtype not in TORCH_DTYPES):
        # indexing keeps the dtype as a torch dtype name, which later reads look up (and must exist)
        return f"dtype {str(dtype)[:60]!a} is not one Megatron writes"
    if not isinstance(meta.get("dimension_separator", "."), str) or meta.get("dimension_separator") == "":
        return "dimension_separator is not a non-empty string"
    if meta.get("order", "C") != "C" or meta.get("filters") is not None:
        # chunks are read as raw C-order values: zarr would transpose or filter them (so would Megatron's load)
        order, filters = str(meta.get("order"))[:10], str(meta.get("filters"))[:40]
        return f"order {order!a} and filters {filters!a}, where Megatron writes 'C' and none"
    return None


def read_index(iteration_dir: Path) -> tuple[dict[str, tuple], dict[str, int]]:
    """(key -> (key, kind, dtype, shape, chunks), relative data file -> size)."""
    entries: dict[str, tuple] = {}
    sizes: dict[str, int] = {}
    list_tree(iteration_dir)  # remote: one listing of the whole tree, not one per array dir
    for array_dir in sorted(p for p in iteration_dir.iterdir() if p.is_dir()):
        key = array_dir.name
        files = file_sizes(array_dir)
        for name, size in files.items():
            if name != ".zarray" and not name.startswith(".z"):
                sizes[f"{key}/{name}"] = size
        if ".zarray" in files:
            meta = _zarray(array_dir / ".zarray")
            shape, chunk_shape = tuple(meta["shape"]), tuple(meta["chunks"])  # int lists (_zarray_problem)
            dtype_name = _ZARR_DTYPES.get(meta["dtype"], meta["dtype"])
            chunks = []
            for name in sorted(files):
                if name.startswith("."):
                    continue
                try:
                    grid = tuple(int(i) for i in name.split(meta.get("dimension_separator", ".")))
                except ValueError:
                    continue
                offsets = tuple(g * c for g, c in zip(grid, chunk_shape))
                extents = tuple(min(c, s - o) for c, s, o in zip(chunk_shape, shape, offsets))
                chunks.append(DcpChunk(offsets, extents, StorageLocation(f"{key}/{name}", 0, files[name])))
            entries[key] = (key, "tensor", f"torch.{dtype_name}", shape, chunks)
        else:
            for name in sorted(files):
                if name.startswith("shard_"):
                    item_key = f"{key}/{Path(name).stem}"
                    chunk = DcpChunk((), (), StorageLocation(f"{key}/{name}", 0, files[name]))
                    entries[item_key] = (item_key, "bytes", None, None, [chunk])
    return entries, sizes


def chunk_ref(dtype_name: str | None, sizes: tuple[int, ...], blob: bytes, where: str) -> TensorRef:
    """A legacy zarr chunk file: the raw, uncompressed C-order values of one chunk (Megatron writes no
    compressor, and its chunks are the per-rank local shapes, so no edge padding)."""
    dtype = DtypeRef.get((dtype_name or "").removeprefix("torch."))
    numel = 1
    for size in sizes:
        numel *= size
    if dtype.itemsize is None or len(blob) != numel * dtype.itemsize:
        raise CkptError(
            f"{where}: zarr chunk holds {len(blob)} bytes, {list(sizes)} of {dtype_name} "
            f"needs {numel * (dtype.itemsize or 0)} (compressed or padded chunks are not supported)"
        )
    stride: list[int] = []
    step = 1
    for size in reversed(sizes):
        stride.insert(0, step)
        step *= size
    storage = StorageRef("0", dtype, "cpu", numel)
    storage.set_data(blob)
    return TensorRef(storage, 0, tuple(sizes), tuple(stride))
