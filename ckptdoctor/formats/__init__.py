"""On-disk formats: torch_dist (PyTorch DCP), plain PyTorch DCP, torch.save zip archives, legacy zarr.

Code outside this package does not branch on the backend: it asks the backend's reader through the functions
here (and the index each reader builds for :class:`ckptdoctor.checkpoint.Checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptdoctor.formats import torch_dist, zarr_meta
from ckptdoctor.storage.files import file_sizes

if TYPE_CHECKING:
    from ckptdoctor.formats.torch_dist import DcpIndex, DcpItem
    from ckptdoctor.pickle.torch_stand_ins import TensorRef

BACKEND_TORCH_DIST = "torch_dist"
BACKEND_ZARR = "zarr"
# plain PyTorch DCP without Megatron's metadata.json (Megatron-LM torch_dcp / fsdp_dtensor, FSDP2, TorchTitan):
# read from its files, never named by a metadata.json (Megatron would then read the dir as torch_dist)
BACKEND_DCP = "dcp"
BACKENDS = (BACKEND_TORCH_DIST, BACKEND_ZARR)  # what metadata.json's sharded_backend may name

ERA_COMMON_PT = "torch_dist, common.pt (core <= 0.18)"
ERA_COMMON_STATE = "torch_dist, common_state in DCP (core >= 0.19)"
ERA_ZARR = "zarr (legacy, core <= 0.14)"
ERA_DCP = "plain PyTorch DCP, no metadata.json"


def era(backend: str, common_pt: bool) -> str:
    """Which Megatron releases wrote a checkpoint of this backend with (or without) ``common.pt``."""
    if backend == BACKEND_ZARR:
        return ERA_ZARR
    if backend == BACKEND_DCP:
        return ERA_DCP
    return ERA_COMMON_PT if common_pt else ERA_COMMON_STATE


def saved_metadata_json(backend: str, common_pt: bool) -> dict:
    """The ``metadata.json`` Megatron's save writes for this backend and era (sharded backend version 1 since
    core 0.6; the common backend is named while the common state is a separate ``common.pt``)."""
    content: dict = {"sharded_backend": backend, "sharded_backend_version": 1}
    if backend == BACKEND_ZARR or common_pt:
        content |= {"common_backend": "torch", "common_backend_version": 1}
    return content


def raw_element_chunks(backend: str) -> bool:
    """Whether each chunk file holds exactly the chunk's elements (legacy zarr: uncompressed, no framing), so a
    file of another length is an incomplete save; torch_dist chunks are ``torch.save`` records in shared files."""
    return backend == BACKEND_ZARR


def read_by_current_megatron(backend: str) -> bool:
    """Whether megatron-core >= 0.16 still reads this backend (zarr support was removed then)."""
    return backend != BACKEND_ZARR


@dataclass
class BackendIndex:
    """What a backend's reader knows of one iteration dir from metadata alone."""

    items: dict[str, Any]  # key -> item (of the caller's item class)
    data_files: dict[str, int]  # relative data file -> size, of files present
    dcp: DcpIndex | None = None  # the DCP index (None for zarr)
    metadata: Any = field(default=None, repr=False)  # the unpickled DCP Metadata, for a rewrite


def index_file(backend: str) -> str | None:
    """The file a backend keeps its index in (None: zarr spreads it over one ``.zarray`` per key)."""
    return None if backend == BACKEND_ZARR else ".metadata"


def has_common_pt(backend: str, names: set[str]) -> bool:
    """Whether the common state lives in ``common.pt`` (zarr: always; torch_dist: up to core 0.18)."""
    return backend == BACKEND_ZARR or "common.pt" in names


def guess_backend(directory: Path, names: set[str]) -> str:
    """The backend of a dir whose metadata.json cannot tell: zarr when there is no ``.metadata`` and some
    subdir is a zarr array (holds ``.zarray``), else torch_dist."""
    if ".metadata" not in names:
        for name in sorted(names):
            if (directory / name).is_dir() and (directory / name / ".zarray").is_file():
                return BACKEND_ZARR
    return BACKEND_TORCH_DIST


def read_index(backend: str, iteration_dir: Path, item_class: type[DcpItem], for_rewrite: bool = False) -> BackendIndex:
    """The backend's index of ``iteration_dir`` (torch_dist and plain DCP: the same ``.metadata``); raises
    :class:`ckptdoctor.errors.CkptError` (or a pickle refusal) naming the file when it cannot be read.
    ``for_rewrite`` also keeps the unpickled DCP metadata."""
    if backend == BACKEND_ZARR:
        entries, sizes = zarr_meta.read_index(iteration_dir)
        return BackendIndex({key: item_class(*fields) for key, fields in entries.items()}, sizes)
    path = iteration_dir / ".metadata"
    metadata = None
    if for_rewrite:
        index, metadata = torch_dist.read_metadata_for_rewrite(path, item_class=item_class)
    else:
        index = torch_dist.read_metadata(path, item_class=item_class)
    data_files = {name: size for name, size in file_sizes(iteration_dir).items() if name.endswith(".distcp")}
    return BackendIndex(index.items, data_files, index, metadata)


def raw_chunk_ref(backend: str, dtype: str | None, sizes: tuple[int, ...], blob: bytes, where: str) -> TensorRef | None:
    """The tensor of a chunk stored as raw elements (legacy zarr); None where chunks are ``torch.save``
    records (torch_dist), which the archive reader decodes."""
    if backend != BACKEND_ZARR:
        return None
    return zarr_meta.chunk_ref(dtype, sizes, blob, where)
