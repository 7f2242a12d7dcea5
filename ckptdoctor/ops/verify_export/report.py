"""What ``verify-export`` reports: findings about the HF files, their coverage of the checkpoint, config.json, and
(``--values``) the values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.pickle.plain import OMIT_NONE

SCHEMA = "ckptdoctor.verify-export/1"

# finding code -> what it means (the documentation's table is this one)
CODES: dict[str, str] = {
    "shard-missing": "a shard file the index names is not in the dir",
    "shard-unreadable": "a shard whose safetensors header the format's rules refuse",
    "truncated": "a shard's header places tensor bytes past the end of the file",
    "ghost": "the index lists a tensor no shard holds",
    "orphan": "a shard holds a tensor the index does not list (or lists in another shard)",
    "duplicate": "two shards hold the same tensor",
    "unindexed-file": "a .safetensors file in the dir that the index never names",
    "missing": "a tensor the checkpoint maps to is not in the export",
    "extra": "an export tensor no checkpoint tensor maps to",
    "shape": "an export tensor's shape is not the one the checkpoint maps to",
    "dtype": "an export tensor's dtype differs from the checkpoint's",
    "unmapped": "a checkpoint tensor the family's mapping does not know (not verified)",
    "config": "config.json disagrees with the saved args",
    "value": "an export tensor's values differ from the checkpoint slice it should equal",
    "swapped": "an export tensor equals another piece of its fused checkpoint tensor (k/v or gate/up exchanged)",
    "zeroed": "an export tensor is all zeros where the checkpoint's is not",
}


@dataclass
class ExportFinding:
    code: str
    severity: str  # error | warning | info
    message: str
    hf_name: str | None = field(default=None, metadata=OMIT_NONE)
    megatron_key: str | None = field(default=None, metadata=OMIT_NONE)
    shard: str | None = field(default=None, metadata=OMIT_NONE)
    layer: int | None = field(default=None, metadata=OMIT_NONE)
    expert: int | None = field(default=None, metadata=OMIT_NONE)


@dataclass(slots=True)
class ExportTensor:
    """One tensor of the export as its shard header states it."""

    name: str
    shard: str
    dtype: str  # torch's name ("float32")
    shape: list[int]
    megatron_key: str | None  # the checkpoint tensor it maps to; None when none does
    max_abs_diff: float | None = field(default=None, metadata=OMIT_NONE)  # --values


@dataclass
class VerifyExportReport:
    schema: str
    checkpoint: str
    hf_dir: str
    family: str
    model_type: Any
    verdict: str  # "match" | "mismatch"
    shards: int
    hf_tensors: int
    expected_tensors: int
    values_compared: int  # --values: tensors compared (0 without it)
    counts: dict[str, int]  # errors, warnings, infos
    findings: list[ExportFinding]
    tensors: list[ExportTensor]
    notes: list[str] = field(default_factory=list)
