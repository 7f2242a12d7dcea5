"""Consistency rules (CKD2xx): do the args, the chunk grids and the keys agree with each other?

The parallelism-derived args rules are :data:`ckptdoctor.arg_rules.RULES` (shared with fix-args): they are
listed and run from that table, never re-implemented here. This module adds chunk coverage and orphan
``_extra_state`` items.
"""

from __future__ import annotations

import bisect
import itertools
import math

from ckptdoctor import arg_rules
from ckptdoctor.args import saved_config
from ckptdoctor.checkpoint import Checkpoint, Entry
from ckptdoctor.formats.dcp_index import grid_tiled_once
from ckptdoctor.formats.run_config import RUN_CONFIG
from ckptdoctor.parallelism import infer_layout
from ckptdoctor.rules import ERROR, WARNING, Finding, RuleInfo
from ckptdoctor.rules.structure import Scanned

_ARGS_RATIONALE = (
    "Converters (tools/checkpoint) copy every source arg not in their keep-list, so a re-sharded checkpoint "
    "can carry the source's value; megatron-core validates or silently recomputes it on load "
    "(model_parallel_config.resolve_tensor_parallel_weight_shards). `ckptdoctor fix-args` rewrites it. "
    "Derived from: {derives}."
)
VARIES = "error/warning"  # arg findings carry their own severity: error where megatron-core would refuse


def _arg_rule_info(rule: arg_rules.Rule) -> RuleInfo:
    return RuleInfo(
        rule.code,
        "arg-" + rule.arg.replace("_", "-"),
        "consistency",
        VARIES,
        rule.description,
        _ARGS_RATIONALE.format(derives=rule.derives_from),
    )


# CKD204 lives in arg_rules' world-size check, outside its per-arg table.
WORLD_SIZE = RuleInfo(
    "CKD204",
    "arg-world-size",
    "consistency",
    WARNING,
    "world_size must be a multiple of TP x PP x CP and data_parallel_size their quotient",
    _ARGS_RATIONALE.format(derives="tensor/pipeline/context_parallel_size"),
)
CHUNK_COVERAGE = RuleInfo(
    "CKD220",
    "chunk-coverage",
    "consistency",
    ERROR,
    "a tensor's chunks do not cover its global shape exactly once",
    "Every element of a saved tensor must come from exactly one chunk: a gap is data no rank saved (a rank's "
    "plan missing from .metadata), an overlap or an out-of-bounds chunk is a corrupt or badly merged index; "
    "DCP's load planner fails or reads garbage.",
)
ORPHAN_EXTRA_STATE = RuleInfo(
    "CKD221",
    "orphan-extra-state",
    "consistency",
    ERROR,
    "a model _extra_state item whose module has no saved weight",
    "Filters that drop weights (trainable-params-only saves, PEFT adapter filters) must drop the module's "
    "_extra_state too: a ShardedObject kept beside a dropped weight makes the load request and the checkpoint "
    "disagree and the load fails.",
)

_ARG_INFOS = [_arg_rule_info(r) for r in arg_rules.RULES]
RULES = [*_ARG_INFOS, WORLD_SIZE, CHUNK_COVERAGE, ORPHAN_EXTRA_STATE]

# Modules that carry TE FP8 metadata (_extra_state) but no weights of their own.
_WEIGHTLESS_MODULES = ("core_attention",)
_MAX_CELLS = 1 << 21  # coverage grids larger than this fall back to comparing element counts


def check(state: Scanned) -> list[Finding]:
    checkpoint = state.checkpoint
    if checkpoint is None:
        return []
    findings = _check_args(state, checkpoint)
    shown = str(state.shown / ".metadata") if checkpoint.dcp is not None else str(state.shown)
    for entry in checkpoint.entries.values():
        if entry.kind == "tensor" and entry.shape is not None:
            problem = coverage_problem(entry)
            if problem:
                findings.append(Finding(CHUNK_COVERAGE.code, shown, f"{entry.key}: {problem}", ERROR))
    findings.extend(_orphan_extra_state(checkpoint, shown))
    return findings


def _check_args(state: Scanned, checkpoint: Checkpoint) -> list[Finding]:
    if state.common is None or not checkpoint.entries:
        return []  # no args to check, or no chunks to check them against
    args, where = saved_config(state.common, checkpoint.iteration_dir)
    path = str(state.common_path()) if where != RUN_CONFIG else str(state.shown / RUN_CONFIG)
    out = []
    for f in arg_rules.check_args(args, infer_layout(checkpoint)):
        text = f.reason if f.correct is None else f"{f.reason}; correct value: {f.correct!r}"
        if where == RUN_CONFIG:  # Megatron-Bridge: no args saved, its resume reads this file's model section
            text = f"model section (Megatron-Bridge's config; no args saved): {text}"
        if f.megatron_error:
            text += f"; megatron-core: {f.megatron_error}"
        out.append(Finding(f.code, path, text, f.severity))
    return out


def coverage_problem(entry: Entry) -> str | None:
    """Why ``entry``'s chunks do not tile its global shape exactly once (None when they do)."""
    shape = entry.shape or ()
    if len(entry.chunks) == 1:  # the common case, cheaply: one chunk at the origin spanning the shape
        only = entry.chunks[0]
        if only.sizes == shape and not any(only.offsets):
            return None
    elif _tiled_in_c(shape, entry.chunks):
        return None
    ndim = len(shape)
    chunks = [c for c in entry.chunks if not any(s == 0 for s in c.sizes) or len(c.sizes) != ndim]
    total = 0
    for c in chunks:
        if len(c.offsets) != ndim or len(c.sizes) != ndim:
            return f"chunk at {list(c.offsets)} has {len(c.sizes)} dims, the tensor {ndim}"
        if any(o < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            return f"chunk at {list(c.offsets)} of size {list(c.sizes)} lies outside the global shape {list(shape)}"
        total += math.prod(c.sizes)
    numel = math.prod(shape)
    if len(chunks) <= 1 and total == numel:
        return None
    # Cut every axis at all chunk boundaries; each grid cell must be covered exactly once.
    cuts = [
        sorted({0, d, *(c.offsets[a] for c in chunks), *(c.offsets[a] + c.sizes[a] for c in chunks)})
        for a, d in enumerate(shape)
    ]
    cells = math.prod(len(axis) - 1 for axis in cuts)
    if len(chunks) == cells and _one_chunk_per_cell(chunks, cuts):
        return None  # the usual grid (TP x PP x EP cuts): each cell held by exactly one chunk
    if cells > _MAX_CELLS:
        if total == numel:
            return None  # too fine a grid to map; element counts agree
        return _count_message(total, numel)
    count: dict[tuple[int, ...], int] = {}
    for c in chunks:
        ranges = [
            range(bisect.bisect_left(axis, o), bisect.bisect_left(axis, o + s))
            for axis, o, s in zip(cuts, c.offsets, c.sizes)
        ]
        for cell in itertools.product(*ranges):
            count[cell] = count.get(cell, 0) + 1
    overlap = [cell for cell, n in count.items() if n > 1]
    if overlap:
        return (
            f"chunks overlap at offsets {_origin(cuts, overlap[0])} ({len(chunks)} chunks hold {total} elements, "
            f"the shape {numel})"
        )
    if len(count) < cells:
        missing = next(cell for cell in itertools.product(*(range(len(a) - 1) for a in cuts)) if cell not in count)
        return (
            f"chunks leave a gap at offsets {_origin(cuts, missing)}: {numel - total} of {numel} elements "
            "are in no chunk"
        )
    return None


def _tiled_in_c(shape: tuple, chunks: list) -> bool:
    """The one-chunk-per-cell answer below, for every chunk at once in C (1M chunks: ~0.1 s instead of ~2 s);
    False where the extension was not built or the chunks are not that grid (the steps below then decide)."""
    return (
        grid_tiled_once is not None and type(shape) is tuple and type(chunks) is list and grid_tiled_once(shape, chunks)
    )


def _one_chunk_per_cell(chunks: list, cuts: list[list[int]]) -> bool:
    """Every chunk is exactly one cell of the grid ``cuts`` and no two are the same cell: with as many chunks as
    cells, they tile the shape once. A dict lookup per axis and chunk, where mapping every chunk's cells (below)
    costs a bisect per axis and a dict entry per cell (a 1M-chunk checkpoint: seconds)."""
    position = [{cut: i for i, cut in enumerate(axis)} for axis in cuts]
    seen: set[tuple[int, ...]] = set()
    for chunk in chunks:
        cell = []
        for axis, where, offset, size in zip(cuts, position, chunk.offsets, chunk.sizes):
            i = where[offset]
            if axis[i + 1] != offset + size:  # spans more than one cell: the general mapping decides
                return False
            cell.append(i)
        seen.add(tuple(cell))
    return len(seen) == len(chunks)


def _origin(cuts: list[list[int]], cell: tuple[int, ...]) -> list[int]:
    return [axis[i] for axis, i in zip(cuts, cell)]


def _count_message(total: int, numel: int) -> str:
    if total < numel:
        return f"chunks leave a gap: {numel - total} of {numel} elements are in no chunk"
    return f"chunks overlap: they hold {total} elements, the shape {numel}"


def _orphan_extra_state(checkpoint: Checkpoint, shown: str) -> list[Finding]:
    modules_with_tensors = {
        e.key.rsplit(".", 1)[0]
        for e in checkpoint.entries.values()
        if e.kind == "tensor" and e.section == "model" and "." in e.key
    }
    out = []
    seen: set[str] = set()
    for entry in checkpoint.entries.values():
        if entry.section != "model" or not entry.is_extra_state or "._extra_state" not in entry.key:
            continue
        module = entry.key.split("._extra_state", 1)[0]
        if module in modules_with_tensors or module in seen or module.rsplit(".", 1)[-1] in _WEIGHTLESS_MODULES:
            continue
        seen.add(module)
        out.append(
            Finding(
                ORPHAN_EXTRA_STATE.code,
                shown,
                f"{entry.key}: _extra_state kept but no weight of {module} is saved",
                ERROR,
            )
        )
    return out
