"""What ``diff --values`` reports: one :class:`ValueDiff` per key that differs or was not compared, and the
:class:`ValuesReport` of the whole comparison."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptdoctor.pickle.paths import FieldChange
from ckptdoctor.pickle.plain import OMIT_NONE


@dataclass
class ValueDiff:
    key: str
    section: str
    kind: str  # "tensor" | "object" | "bytes"
    equal: bool | None  # None: not compared (see note)
    max_abs_diff: float | str | None  # "inf"/"nan" where not finite; None for bytes items
    mismatched: int | None  # elements not equal (bitwise) or not within tolerance
    elements: int | None
    note: str | None = None
    sha256_a: str | None = None  # bytes items with one shard
    sha256_b: str | None = None
    max_rel_diff: float | str | None = None  # tensors: max |a - b| / |b| over differing elements (inf where b = 0)
    norm_diff: float | str | None = None  # tensors: L2 norm of a - b (NaN positions left out)
    mismatches: list[dict] | None = None  # --report N: first N mismatching elements {index, a, b} (global index)
    # bytes items whose decoded objects differ: the differing fields by path (rng_state[0].random_rng_state[1][5]),
    # their values plain JSON; at most the diff's limit of them, of fields_count found
    fields: list[FieldChange] | None = field(default=None, metadata=OMIT_NONE)
    fields_count: int | None = field(default=None, metadata=OMIT_NONE)


@dataclass
class ValuesReport:
    mode: str  # "bitwise" | "tolerance"
    atol: float
    rtol: float
    compared: int
    equal: int
    different: int
    not_compared: int
    max_abs_diff: float | str | None
    bytes_read: dict
    seconds: float
    workers: int
    peak_in_flight: int  # most chunk bytes one worker held at once, about 3x the largest chunk
    different_keys: list[ValueDiff] = field(default_factory=list)
    not_compared_keys: list[ValueDiff] = field(default_factory=list)
