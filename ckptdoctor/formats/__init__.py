"""On-disk formats: torch_dist (PyTorch DCP), torch.save zip archives, legacy zarr.

Code outside this package does not branch on the backend: it asks the backend's reader through the functions
here (and the index each reader builds for :class:`ckptdoctor.checkpoint.Checkpoint`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptdoctor.torch_stand_ins import TensorRef


def raw_chunk_ref(backend: str, dtype: str | None, sizes: tuple[int, ...], blob: bytes, where: str) -> TensorRef | None:
    """The tensor of a chunk stored as raw elements (legacy zarr); None where chunks are ``torch.save``
    records (torch_dist), which the archive reader decodes."""
    from ckptdoctor.formats import zarr_meta
    from ckptdoctor.locate import BACKEND_ZARR

    if backend != BACKEND_ZARR:
        return None
    return zarr_meta.chunk_ref(dtype, sizes, blob, where)
