"""``ckptdoctor convert``, writing half: the plan's tensors streamed chunk by chunk into a new DCP save.

Each source chunk is read alone (one byte range, decoded through the safe unpickler: :mod:`ckptdoctor.values.read`),
cut where the plan cuts it (a stacked layer's or expert's slice, a SwiGLU half) and appended to the output
(:mod:`ckptdoctor.values.dcp_save`): memory holds one chunk per worker. The source's chunks are cut into units (per
source data file, in file order, every :data:`UNIT_BYTES`); with ``jobs`` > 1 worker processes
(:func:`ckptdoctor.parallel.map_units`) write one output data file per unit, and ``.metadata`` joins their records
in unit order, so the output does not depend on ``jobs``. The common state items become bytes items (nested
dicts and lists flattened into dotted keys, as DCP's default planner flattens them), the args saying
``ckpt_format='fsdp_dtensor'``. The output is built in a hidden staging dir beside ``--output``, read back
through the safe unpickler, and only then renamed into place (:func:`ckptdoctor.ops.staging.swap_output`): an
interrupted run leaves the source untouched and no output. Fault points ``convert:<step>``. ``--to torch_dist``
writes the same way, the chunks placed back on the stacked layer and expert axes, then ``common.pt`` and
``metadata.json`` last (:mod:`ckptdoctor.ops.convert.reverse`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor import atomic, dist, parallel
from ckptdoctor.checkpoint import Checkpoint, open_checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.torch_dist import DcpChunk, writer_rank
from ckptdoctor.formats.torch_zip import dump_torch_zip
from ckptdoctor.locate import TRACKER_NAME
from ckptdoctor.ops.convert.plan import (
    MODEL_PREFIX,
    OPTIMIZER_STATE_PREFIX,
    SCHEMA,
    ChunkRule,
    ConvertPlan,
    dotted,
    flattened,
    forward_rules,
    plan_convert,
    rule_key,
    split_name,
)
from ckptdoctor.ops.convert.reverse import (
    TARGET_TORCH_DIST,
    ReverseRule,
    distributed_optimizer_groups,
    not_convertible,
    param_groups_from_group_meta,
    plan_to_torch_dist,
    planner_paths,
    unflatten,
)
from ckptdoctor.ops.fix_args.plan import common_with_args
from ckptdoctor.ops.rewrite.request import dir_bytes
from ckptdoctor.ops.rewrite.write import check_integrity, check_target, input_was_save_dir
from ckptdoctor.ops.staged_integrity import verify_source_manifest
from ckptdoctor.ops.staging import SwapState, swap_output
from ckptdoctor.progress import Progress
from ckptdoctor.rules import leftovers
from ckptdoctor.tree_removal import remove_tree
from ckptdoctor.values.dcp_save import ChunkRecord, DataFileWriter, DcpSaveLayout
from ckptdoctor.values.read import read_chunk
from ckptdoctor.write_guard import is_local

STEP = "convert"
# megatron-core 0.19's metadata.json (older cores add the common backend, which they read as torch too)
MCORE_METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


@dataclass
class ConvertResult:
    output: str
    iteration_dir: str
    tensors: int  # output tensor keys
    chunks: int  # chunks written
    objects: int  # bytes items written
    output_bytes: int
    source_bytes: int
    seconds: float = 0.0


@dataclass
class ConvertReport:
    schema: str = field(init=False, default=SCHEMA)
    plan: ConvertPlan
    result: ConvertResult | None  # None for --dry-run
    dry_run: bool


def _planner_path(key: str) -> tuple[str, ...]:
    """The nested path DCP's default planner records for an output key (Megatron-LM's state dict nests the model
    under ``model`` and the optimizer states under ``optimizer``/``state``/param/stat)."""
    if key.startswith(OPTIMIZER_STATE_PREFIX + "."):
        param, _, stat = key[len("optimizer.state.") :].rpartition(".")
        return ("optimizer", "state", param, stat)
    if key.startswith(MODEL_PREFIX + "."):
        return ("model", key[len("model.") :])
    return (key,)


def _pieces(rule: ChunkRule, offsets: tuple[int, ...], value: Any) -> Iterator[tuple[str, tuple, Any]]:
    """(output key, offsets, tensor) of one source chunk, as the rule places it."""
    lead = len(rule.axes)
    key = rule_key(rule, offsets[:lead])
    if lead:
        offsets, value = offsets[lead:], value.reshape(tuple(value.shape[lead:]))
    if not rule.swiglu:
        yield key, offsets, value
        return
    start, stop, half = offsets[0], offsets[0] + int(value.shape[0]), rule.swiglu
    for name, low, high in (("w", 0, half), ("v", half, 2 * half)):
        begin, end = max(start, low), min(stop, high)
        if begin < end:
            key_half = split_name(key, name)
            yield key_half, (begin - low, *offsets[1:]), value.narrow(0, begin - start, end - begin)


def _common_items(checkpoint: Checkpoint, plan: ConvertPlan) -> Iterator[tuple[str, tuple, bytes]]:
    common = common_with_args(checkpoint.common_state(), plan.arg_changes)
    for name in sorted(common):
        for path, value in flattened(common[name], (name,)):
            yield dotted(path), path, dump_torch_zip(value)


# One unit of parallel work: a run of source chunks from one data file, cut where it passes this many bytes. The
# cut depends on the source only, so the output (one data file per unit) is the same at any --jobs.
UNIT_BYTES = 256 << 20

Placement = Callable[[str, DcpChunk, Any], Iterator[tuple[str, tuple, Any]]]  # (output key, offsets, values)


class _FileNames:
    """Output data file names as DCP's ``FileSystemWriter`` gives them (``__<rank>_<n>.distcp``), each unit under
    the rank that wrote its source file: a reader counting the ranks that wrote (the saved layout) sees the
    source's writers, not one per unit."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def next(self, rank: int) -> str:
        n = self.count.get(rank, 0)
        self.count[rank] = n + 1
        return f"__{rank}_{n}.distcp"


def _units(checkpoint: Checkpoint, keys: list[str], names: _FileNames) -> list[tuple[str, list[tuple[str, int]]]]:
    """The source chunks of ``keys`` as units, each with its output file name: per source data file, in file
    order, cut at :data:`UNIT_BYTES`."""
    by_file: dict[str, list[tuple[int, str, int]]] = {}
    for key in keys:
        for index, chunk in enumerate(checkpoint.entries[key].chunks):
            where = chunk.storage
            name, offset = (where.relative_path, where.offset) if where is not None else ("", 0)
            by_file.setdefault(name, []).append((offset, key, index))
    units: list[tuple[str, list[tuple[str, int]]]] = []
    for name in sorted(by_file):
        rank = writer_rank(name) or 0
        unit: list[tuple[str, int]] = []
        size = 0
        for _offset, key, index in sorted(by_file[name]):
            nbytes = checkpoint.entries[key].chunk_nbytes(checkpoint.entries[key].chunks[index]) or 0
            if unit and size + nbytes > UNIT_BYTES:
                units.append((names.next(rank), unit))
                unit, size = [], 0
            unit.append((key, index))
            size += nbytes
        if unit:
            units.append((names.next(rank), unit))
    return units


def _write_units(
    checkpoint: Checkpoint,
    keys: list[str],
    place: Placement,
    layout: DcpSaveLayout,
    stage: Path,
    jobs: int | None,
    progress: Progress | None,
    casts: frozenset[str] = frozenset(),
    names: _FileNames | None = None,
) -> list[ChunkRecord]:
    """Every source chunk of ``keys`` read (the values engine, one chunk at a time), cut by ``place`` and written:
    each unit to its own data file (named by ``names``: under its source file's rank), units spread over ``jobs``
    worker processes (:func:`ckptdoctor.parallel.map_units`), the records joined in unit order; the output keys in
    ``casts`` take their declared dtype (mixed precision)."""
    units = _units(checkpoint, keys, names or _FileNames())
    weights = [
        sum(checkpoint.entries[k].chunk_nbytes(checkpoint.entries[k].chunks[i]) or 0 for k, i in u)
        for _name, u in units
    ]

    def task(number: int) -> list[ChunkRecord]:
        name, unit = units[number]
        with DataFileWriter(stage, name, layout) as writer:
            for key, index in unit:
                value = read_chunk(checkpoint, key, index)
                for out_key, offsets, piece in place(key, checkpoint.entries[key].chunks[index], value):
                    writer.write_chunk(out_key, offsets, piece, cast=out_key in casts)
                del value
            writer.close()
            return writer.chunks

    def done(number: int) -> None:
        if progress is not None:
            progress.advance(weights[number])
        atomic.fault_point(f"{STEP}:chunk-written")

    parts = parallel.map_units(weights, task, jobs, done)
    return [record for part in parts for record in part]


def _fill(
    checkpoint: Checkpoint, plan: ConvertPlan, stage: Path, jobs: int | None, progress: Progress | None
) -> ConvertResult:
    layout = DcpSaveLayout()
    for target in plan.target_tensors:
        layout.declare_tensor(target.key, target.shape, target.dtype, _planner_path(target.key))
    rules = forward_rules(checkpoint, plan)
    sources = list(rules)
    casts = frozenset(m_key for m in plan.mappings if m.cast for m_key in m.targets)

    def place(key: str, chunk: DcpChunk, value: Any) -> Iterator[tuple[str, tuple, Any]]:
        return _pieces(rules[key], tuple(chunk.offsets), value)

    names = _FileNames()
    records = _write_units(checkpoint, sources, place, layout, stage, jobs, progress, casts, names)
    with DataFileWriter(stage, names.next(0), layout) as writer:  # rank 0 writes the common state's items
        for key, path, payload in _common_items(checkpoint, plan):
            writer.write_bytes(key, payload, path)
        writer.close()
    layout.write_metadata(stage, records, writer.items)
    atomic.fsync_dir(stage)
    return ConvertResult("", "", len(plan.target_tensors), len(records), len(writer.items), 0, 0)


def _fill_torch_dist(
    checkpoint: Checkpoint,
    plan: ConvertPlan,
    rules: dict[str, ReverseRule],
    stage: Path,
    jobs: int | None,
    progress: Progress | None,
) -> ConvertResult:
    """The reverse: each fsdp_dtensor chunk placed in its stacked torch_dist key; the top-level bytes items
    gathered into ``common.pt``; ``metadata.json`` last, as megatron-core writes it."""
    layout = DcpSaveLayout(flattened=False)
    for target in plan.target_tensors:
        layout.declare_tensor(target.key, target.shape, target.dtype)

    def place(key: str, chunk: DcpChunk, value: Any) -> Iterator[tuple[str, tuple, Any]]:
        rule = rules[key]
        offsets = tuple(chunk.offsets)
        offsets = (offsets[0] + rule.half, *offsets[1:])
        if rule.lead:  # one index on each stacked axis (layer, expert)
            offsets = (*rule.lead, *offsets)
            value = value.reshape((1,) * len(rule.lead) + tuple(value.shape))
        if rule.main is not None:  # the fp32 values are the distributed optimizer's main params too
            yield rule.main, offsets, value
        yield rule.target, offsets, value

    casts = frozenset(m.targets[0] for m in plan.mappings if m.cast)
    records = _write_units(checkpoint, sorted(rules), place, layout, stage, jobs, progress, casts)
    layout.write_metadata(stage, records, [])
    result = ConvertResult("", "", len(plan.target_tensors), len(records), 0, 0, 0)
    items = {
        key: checkpoint.read_bytes_item(key)
        for key, e in checkpoint.entries.items()
        if e.kind == "bytes" and not_convertible(key) is None
    }
    result.objects = len(items)
    common = distributed_optimizer_groups(unflatten(param_groups_from_group_meta(items), planner_paths(checkpoint)))
    if "args" in common:
        common = common_with_args(common, plan.arg_changes)
    atomic.write_atomic(stage / "common.pt", dump_torch_zip(common))
    atomic.write_atomic(stage / "metadata.json", json.dumps(MCORE_METADATA_JSON).encode())
    atomic.fsync_dir(stage)
    return result


def _read_back(stage: Path, target: str) -> None:
    """The new save read through the safe unpickler (its ``.metadata`` and index) as any later run reads it."""
    written = open_checkpoint(stage)
    written.common_state()  # its args decide the flavour where the keys cannot (no SwiGLU: no _w/_v keys)
    got = written.flavour or written.location.backend
    if got != target:
        raise CkptError(f"{stage}: the converted save reads back as {got}, not {target}")


def convert(
    checkpoint: Checkpoint,
    target: str,
    *,
    output: Path | None,
    dry_run: bool = False,
    force: bool = False,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> ConvertReport:
    """Plan the conversion and (unless ``dry_run``) write it to ``output``; every refusal comes before a write."""
    if dist.group() is not None and not dry_run:  # one writer of the output: the ranks would race for it
        raise CkptError("convert runs in one process, not under torchrun (use --jobs for parallel workers)")
    rules: dict[str, ReverseRule] = {}
    if target == TARGET_TORCH_DIST:
        plan, rules = plan_to_torch_dist(checkpoint)
    else:
        plan = plan_convert(checkpoint, target)
    # the gate: every pickle the output carries on (the common state, or the fsdp_dtensor save's bytes items)
    if target == TARGET_TORCH_DIST:
        carried = {key for key, entry in checkpoint.entries.items() if entry.kind == "bytes"}
    else:
        carried = {checkpoint.common_source} if checkpoint.common_source else set()
    check_integrity(checkpoint, STEP, carried=carried)
    if dry_run:
        return ConvertReport(plan, None, True)
    if output is None:
        raise CkptError("give -o/--output DIR (or --dry-run)")
    check_target(checkpoint, output, False, force, remote_source=True, in_place_option=False)  # the source: read
    if is_local(checkpoint.iteration_dir):
        verify_source_manifest(checkpoint.iteration_dir, "convert")
    started = time.perf_counter()
    src_iter = checkpoint.iteration_dir
    save_layout = input_was_save_dir(checkpoint)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CkptError(f"{exc.filename or output.parent}: cannot create ({exc.strerror})") from None
    swap = SwapState()
    staging: Path | None = None
    try:
        with atomic.defer_sigint():
            staging = atomic.make_unique_dir(output.parent, f".{output.name}{leftovers.TMP_MARK}")
        stage_iter = staging / src_iter.name if save_layout else staging
        atomic.fault_point(f"{STEP}:staging-created")
        if save_layout:
            stage_iter.mkdir()
        if progress is not None:
            progress.start("converting tensors", plan.tensor_bytes(checkpoint))
        try:
            if target == TARGET_TORCH_DIST:
                result = _fill_torch_dist(checkpoint, plan, rules, stage_iter, jobs, progress)
            else:
                result = _fill(checkpoint, plan, stage_iter, jobs, progress)
        finally:
            if progress is not None:
                progress.finish()
        _read_back(stage_iter, target)
        if save_layout:
            value = "release" if checkpoint.location.release else str(checkpoint.location.iteration)
            atomic.write_atomic(staging / TRACKER_NAME, value.encode())
        result.output = str(output)
        result.iteration_dir = str(output / src_iter.name if save_layout else output)
        result.output_bytes = dir_bytes(stage_iter)
        result.source_bytes = dir_bytes(src_iter)
        atomic.fault_point(f"{STEP}:before-swap")
        swap_output(output, staging, swap, STEP)
    except BaseException as exc:
        if staging is not None and not swap.done:  # only new data there: the source was never written
            remove_tree(staging, ignore_errors=True)
        if isinstance(exc, OSError):
            raise CkptError(f"{exc.filename or staging}: cannot write ({exc.strerror})") from None
        raise
    result.seconds = round(time.perf_counter() - started, 3)
    return ConvertReport(plan, result, False)
