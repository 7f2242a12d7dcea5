"""``repair`` of CKD101 (``metadata.json`` missing): whether writing it is provably safe, and what to write.

It is written only when ``.metadata`` reads, every referenced data file is present and long enough, and the
common state reads (legacy zarr: every array's chunk files hold exactly their elements and ``common.pt`` reads);
its content follows the era. An incomplete save stays incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptdoctor.locate import BACKEND_ZARR, CheckpointLocation
from ckptdoctor.rules import Finding, structure

# The metadata.json Megatron writes, by era (sharded backend version 1 since core 0.6).
METADATA_JSON_COMMON_PT = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
METADATA_JSON_COMMON_STATE = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
METADATA_JSON_ZARR = {
    "sharded_backend": "zarr",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


@dataclass(frozen=True)
class EraMetadataJson:
    """The ``metadata.json`` Megatron writes for a checkpoint's era, and why writing it is safe."""

    content: dict
    era: str
    proof: str


def for_era(location: CheckpointLocation) -> EraMetadataJson:
    """What Megatron wrote for this era (the checks of :func:`refusal` passed)."""
    if location.backend == BACKEND_ZARR:
        content, era = METADATA_JSON_ZARR, "legacy zarr, core <= 0.14"
    elif location.has_common_pt:
        content, era = METADATA_JSON_COMMON_PT, "core <= 0.18, common.pt"
    else:
        content, era = METADATA_JSON_COMMON_STATE, "core >= 0.19, common_state"
    proof = (
        "every zarr chunk file holds exactly its elements, common.pt reads"
        if location.backend == BACKEND_ZARR
        else ".metadata reads, every referenced data file is present and long enough, the common state reads"
    )
    return EraMetadataJson(content, era, proof)


def refusal(state: structure.Scanned, others: list[Finding]) -> str | None:
    """Why writing metadata.json is not provably safe (None: it is)."""
    if others:
        first = others[0]
        return f"an incomplete or damaged save ({first.code} {first.message}); it must stay incomplete"
    checkpoint = state.checkpoint
    if checkpoint is not None and checkpoint.location.backend == BACKEND_ZARR:
        return _zarr_refusal(state)
    if checkpoint is None or checkpoint.dcp is None:
        return ".metadata does not read, so completeness cannot be proven"
    if state.bad_files:
        return f"data files missing or short: {', '.join(sorted(state.bad_files))}"
    if state.common is None:
        return "the common state does not read"
    return None


def _zarr_refusal(state: structure.Scanned) -> str | None:
    """A legacy zarr save is complete when every array's chunk files hold exactly their raw elements (Megatron
    writes them uncompressed; coverage gaps are CKD220 errors, already blocking) and common.pt reads."""
    checkpoint = state.checkpoint
    assert checkpoint is not None
    if not checkpoint.entries:
        return "no zarr array reads, so completeness cannot be proven"
    for entry in checkpoint.entries.values():
        for chunk in entry.chunks:
            if entry.kind != "tensor" or chunk.storage is None:
                continue
            need = entry.chunk_nbytes(chunk)
            if need is not None and chunk.storage.length != need:
                return (
                    f"{chunk.storage.relative_path} holds {chunk.storage.length} bytes, its chunk needs {need}: "
                    "an incomplete save"
                )
    if state.common is None:
        return "the common state does not read"
    return None
