"""``repair`` of CKD101 (``metadata.json`` missing): whether writing it is provably safe, and what to write.

It is written only when ``.metadata`` reads, every referenced data file is present and long enough, and the
common state reads (legacy zarr: every array's chunk files hold exactly their elements and ``common.pt`` reads);
its content follows the era. An incomplete save stays incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptdoctor.formats import raw_element_chunks, saved_metadata_json
from ckptdoctor.locate import CheckpointLocation
from ckptdoctor.rules import Finding, structure


@dataclass(frozen=True)
class EraMetadataJson:
    """The ``metadata.json`` Megatron writes for a checkpoint's era, and why writing it is safe."""

    content: dict
    era: str
    proof: str


def for_era(location: CheckpointLocation) -> EraMetadataJson:
    """What Megatron wrote for this era (the checks of :func:`refusal` passed)."""
    proof = (
        "every chunk file holds exactly its elements, common.pt reads"
        if raw_element_chunks(location.backend)
        else ".metadata reads, every referenced data file is present and long enough, the common state reads"
    )
    return EraMetadataJson(saved_metadata_json(location.backend, location.has_common_pt), location.era, proof)


def refusal(state: structure.Scanned, others: list[Finding]) -> str | None:
    """Why writing metadata.json is not provably safe (None: it is)."""
    if others:
        first = others[0]
        return f"an incomplete or damaged save ({first.code} {first.message}); it must stay incomplete"
    checkpoint = state.checkpoint
    if checkpoint is not None and raw_element_chunks(checkpoint.location.backend):
        return _raw_chunks_refusal(state)
    if checkpoint is None or checkpoint.dcp is None:
        return ".metadata does not read, so completeness cannot be proven"
    if state.bad_files:
        return f"data files missing or short: {', '.join(sorted(state.bad_files))}"
    if state.common is None:
        return "the common state does not read"
    return None


def _raw_chunks_refusal(state: structure.Scanned) -> str | None:
    """A save of raw-element chunk files (legacy zarr) is complete when every chunk file holds exactly its
    elements (coverage gaps are CKD220 errors, already blocking) and common.pt reads."""
    checkpoint = state.checkpoint
    assert checkpoint is not None
    if not checkpoint.entries:
        return "no array reads, so completeness cannot be proven"
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
