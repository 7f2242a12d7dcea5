"""``verify-export --values``: each HF tensor against the checkpoint slice it should equal (torch).

One layer / expert slice of a checkpoint tensor at a time, assembled from the chunks that hold it, is cut by the
transform (q/k/v of the per-group fused QKV, gate/up of ``linear_fc1``, the first ``vocab_size`` rows), and
each HF tensor is read from its shard's byte range and compared. Memory: one slice, one chunk and one HF tensor,
never a whole stacked tensor. Equal dtypes must match exactly; a dtype change is compared within the narrower
dtype's rounding. A wrong piece that equals another piece of the same fused tensor is named as swapped; one of all
zeros, as zeroed; one whose statistics (``check --health``'s, :mod:`ckptdoctor.values.health`) are a fresh
normal init's (mean about 0, std at ``init_method_std`` or its output-layer scaling) and which is unrelated to the
checkpoint's slice (the difference's variance is the sum of the two variances: no correlation), as reinitialised.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor import dist, parallel
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.formats.hf_export import HfExport
from ckptdoctor.formats.safetensors_header import SafetensorsHeader, ShardTensors
from ckptdoctor.formats.torch_bin_shard import TorchBinShard
from ckptdoctor.numpy_lazy import numpy_or_none
from ckptdoctor.ops.verify_export.expected import Dims, Expected
from ckptdoctor.ops.verify_export.report import ExportFinding, ExportTensor
from ckptdoctor.progress import Progress
from ckptdoctor.severity import ERROR
from ckptdoctor.values.health import HealthScan
from ckptdoctor.values.moments import KINDS, moment_values
from ckptdoctor.values.read import read_region, require_torch, tensor_from_ref


def pieces_of(piece: Any, want: Expected, dims: Dims) -> list[Any]:
    """The transform's pieces of one layer / expert slice of the checkpoint tensor (``global[want.index]``)."""
    if want.transform == "copy":
        return [piece]
    if want.transform == "vocab":
        return [piece[: want.shape[0]]]
    if want.transform == "gate_up":
        return list(piece.chunk(2))
    heads, groups, kv = dims.heads, dims.groups, dims.kv_channels
    assert heads and groups and kv  # a qkv tensor is expected only where the args give them
    per = heads // groups
    grouped = piece.reshape(groups, (per + 2) * kv, *piece.shape[1:])
    q = grouped[:, : per * kv].reshape(heads * kv, *piece.shape[1:])
    k = grouped[:, per * kv : (per + 1) * kv].reshape(groups * kv, *piece.shape[1:])
    v = grouped[:, (per + 1) * kv :].reshape(groups * kv, *piece.shape[1:])
    return [q, k, v]


def _tolerance(torch: Any, a: Any, b: Any) -> float:
    """0 for the same dtype; else the narrower float dtype's rounding at the values' scale."""
    if a.dtype == b.dtype:
        return 0.0
    narrow = min((a.dtype, b.dtype), key=lambda d: torch.finfo(d).bits if d.is_floating_point else 64)
    eps = torch.finfo(narrow).eps if narrow.is_floating_point else 0.0
    scale = float(a.abs().max()) if a.numel() else 0.0
    return eps * max(scale, 1.0)


def compare_values(
    checkpoint: Checkpoint,
    export: HfExport,
    expected: list[Expected],
    tensors: list[ExportTensor],
    dims: Dims,
    progress: Progress | None = None,
    jobs: int | None = None,
) -> tuple[int, list[ExportFinding], list[str]]:
    """(tensors compared, findings, notes on tensors not compared).

    The slices, in key order, are cut into runs of about equal HF bytes, the units of
    :func:`ckptdoctor.parallel.map_units` (``jobs`` forked workers, or the ranks under torchrun); the results come
    back in run order, so the report is the same at any ``jobs``."""
    torch = require_torch("verify-export --values")  # imported once, before the workers fork
    held = export.holder()
    rows = {t.name: t for t in tensors}
    by_slice: dict[tuple[str, tuple[int, ...]], list[Expected]] = defaultdict(list)
    notes: list[str] = []
    for want in expected:
        if want.hf_name not in held:
            continue  # missing: reported by the coverage pass
        header = export.shards[held[want.hf_name]]
        info = header.tensors[want.hf_name]
        if info.shape != want.shape or info.end > header.buffer_bytes:
            continue  # a wrong shape or a cut tensor: reported already
        if not isinstance(getattr(torch, info.torch_dtype, None), torch.dtype):
            notes.append(f"{want.hf_name}: values not compared (torch has no {info.dtype} dtype)")
            continue
        by_slice[want.megatron_key, want.index].append(want)
    slices = sorted(by_slice.items())
    weights = [sum(_hf_bytes(export, held, w) for w in wants) for _, wants in slices]
    jobs = jobs or parallel.default_jobs()
    group = dist.group()
    runs = parallel.consecutive_runs(weights, jobs * (group.world if group else 1) * 4)
    inline = parallel.runs_inline(jobs, len(runs))

    def task(index: int) -> _RunResult:
        lo, hi = runs[index]
        advance = progress.advance if inline and progress is not None else None
        return _compare_slices(torch, checkpoint, export, held, slices[lo:hi], dims, advance)

    def done(index: int) -> None:
        if progress is not None:
            progress.advance(sum(weights[runs[index][0] : runs[index][1]]))

    if progress is not None:
        progress.start("comparing values", sum(weights))
    try:
        results = parallel.map_units([sum(weights[lo:hi]) for lo, hi in runs], task, jobs, None if inline else done)
    finally:
        if progress is not None:
            progress.finish()
    findings: list[ExportFinding] = []
    compared = 0
    for result in results:
        compared += result.compared
        findings.extend(result.findings)
        for name, diff in result.diffs.items():
            rows[name].max_abs_diff = diff
    return compared, findings, notes


@dataclass
class _RunResult:
    """One run of slices compared (plain data: pickled back from a worker)."""

    compared: int = 0
    findings: list[ExportFinding] = field(default_factory=list)
    diffs: dict[str, float | None] = field(default_factory=dict)  # HF name -> max abs diff (None: not finite)


def _hf_tensor(torch: Any, shard: SafetensorsHeader | TorchBinShard, name: str, reads: ShardTensors | None) -> Any:
    """One HF tensor: a safetensors tensor's byte range, or a ``.bin`` tensor's storage record (its view)."""
    if isinstance(shard, TorchBinShard):
        return tensor_from_ref(shard.refs[name], f"{shard.path}: {name}")
    assert reads is not None  # every safetensors shard of the run was opened
    info = shard.tensors[name]
    dtype = getattr(torch, info.torch_dtype)
    data = bytearray(reads.read(name))
    return torch.frombuffer(data, dtype=dtype).reshape(info.shape) if data else torch.empty(info.shape, dtype=dtype)


def _hf_bytes(export: HfExport, held: dict[str, str], want: Expected) -> int:
    info = export.shards[held[want.hf_name]].tensors[want.hf_name]
    return info.end - info.begin


def _compare_slices(
    torch: Any,
    checkpoint: Checkpoint,
    export: HfExport,
    held: dict[str, str],
    slices: list[tuple[tuple[str, tuple[int, ...]], list[Expected]]],
    dims: Dims,
    advance: Callable[[int], None] | None,
) -> _RunResult:
    """Each slice of the run read once, each of its HF tensors read from its byte range and compared."""
    result = _RunResult()
    wanted: dict[str, list[str]] = defaultdict(list)  # safetensors shard -> the run's tensors in it
    for _, wants in slices:
        for want in wants:
            if isinstance(export.shards[held[want.hf_name]], SafetensorsHeader):
                wanted[held[want.hf_name]].append(want.hf_name)
    reads: dict[str, ShardTensors] = {}
    try:
        for shard, names in wanted.items():
            header = export.shards[shard]
            assert isinstance(header, SafetensorsHeader)
            reads[shard] = ShardTensors(header, names)
        _compare_run(torch, checkpoint, export, held, slices, dims, advance, reads, result)
    finally:
        for opened in reads.values():
            opened.close()
    return result


def _compare_run(
    torch: Any,
    checkpoint: Checkpoint,
    export: HfExport,
    held: dict[str, str],
    slices: list[tuple[tuple[str, tuple[int, ...]], list[Expected]]],
    dims: Dims,
    advance: Callable[[int], None] | None,
    reads: dict[str, ShardTensors],
    result: _RunResult,
) -> None:
    for (key, index), wants in slices:
        region = read_region(checkpoint, key, index)
        for want in wants:
            pieces = pieces_of(region, want, dims)
            source = pieces[want.part]
            header = export.shards[held[want.hf_name]]
            info = header.tensors[want.hf_name]
            got = _hf_tensor(torch, header, want.hf_name, reads.get(held[want.hf_name]))
            diff = _max_abs_diff(torch, source, got)
            result.diffs[want.hf_name] = diff if math.isfinite(diff) else None
            result.compared += 1
            if advance is not None:
                advance(info.end - info.begin)
            if diff > _tolerance(torch, source, got):
                result.findings.append(_wrong(torch, want, source, got, pieces, diff, dims.init_stds))
        del region


def _max_abs_diff(torch: Any, a: Any, b: Any) -> float:
    """The largest absolute difference; equal non-finite values (NaN and NaN, inf and inf) count as equal, a
    non-finite value against anything else as an infinite difference."""
    if a.numel() == 0 or (a.dtype == b.dtype and torch.equal(a, b)):  # the common case: no float64 copies
        return 0.0
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    diff = (a64 - b64).abs()
    diff[(a64 == b64) | (a64.isnan() & b64.isnan())] = 0.0
    diff[diff.isnan()] = math.inf
    return float(diff.max())


def _finding(code: str, want: Expected, message: str) -> ExportFinding:
    return ExportFinding(
        code, ERROR, message, hf_name=want.hf_name, megatron_key=want.megatron_key, layer=want.layer, expert=want.expert
    )


def _wrong(
    torch: Any,
    want: Expected,
    source: Any,
    got: Any,
    pieces: list[Any],
    diff: float,
    init_stds: tuple[float, ...],
) -> ExportFinding:
    where = f"{want.megatron_key}" + (f" layer {want.layer}" if want.layer is not None else "")
    where += f" expert {want.expert}" if want.expert is not None else ""
    if got.numel() and not bool(got.any()) and bool(source.any()):
        return _finding("zeroed", want, f"{want.hf_name}: all zeros; {where} is not")
    names = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}.get(want.transform)
    if names is not None:
        for part, other in enumerate(pieces):
            if part != want.part and other.shape == got.shape and _max_abs_diff(torch, other, got) == 0.0:
                message = f"{want.hf_name}: holds the {names[part]} piece of {where}, not the {names[want.part]} piece"
                return _finding("swapped", want, message)
    if _same_values_reordered(torch, source, got):
        return _finding("value", want, f"{want.hf_name}: the values of {where} in another order")
    reinit = _reinitialised(torch, source, got, init_stds)
    if reinit is not None:
        return _finding("reinitialised", want, f"{want.hf_name}: {reinit}, not {where}")
    if math.isinf(diff):  # a NaN or Inf on one side only: say where, not a number that hides which
        src_bad = int((~source.isfinite()).sum()) if source.is_floating_point() else 0
        got_bad = int((~got.isfinite()).sum()) if got.is_floating_point() else 0
        sides = [f"{n} in the checkpoint ({where})" for n in [src_bad] if n] + [
            f"{n} in the export" for n in [got_bad] if n
        ]
        message = (
            f"{want.hf_name}: non-finite values (NaN/Inf) where the other side has finite ones: {', '.join(sides)}"
        )
        return _finding("value", want, message)
    return _finding("value", want, f"{want.hf_name}: max abs diff {diff:.6g} from {where}")


def _same_values_reordered(torch: Any, source: Any, got: Any) -> bool:
    """Whether ``got`` holds exactly ``source``'s values, permuted (rows or heads written in the wrong order): never
    a fresh init, however init-like a source at its init looks."""
    if source.shape != got.shape or source.dtype != got.dtype or not got.numel():
        return False
    return bool(torch.equal(torch.sort(source.reshape(-1))[0], torch.sort(got.reshape(-1))[0]))


INIT_STD_TOLERANCE = 0.2  # a fresh draw's std within 20% of the init std (a sample std's error is ~1/sqrt(2n))


def _mean_std(torch: Any, tensor: Any) -> tuple[float, float, int] | None:
    """Mean, std and element count of a tensor by the health statistics (None for a dtype they do not count)."""
    flat = tensor.detach().contiguous().reshape(-1)
    dtype = str(flat.dtype)
    if dtype not in KINDS or not KINDS[dtype].is_float or not flat.numel() or numpy_or_none() is None:
        return None  # (the statistics count bits with numpy: without it, a wrong tensor is a plain value finding)
    scan = HealthScan()
    scan.scan("t", dtype, (flat.numel(),), (0,), (flat.numel(),), flat.view(torch.uint8).numpy())
    stats = scan.keys.get("t")
    if stats is None:
        return None
    whole = stats.whole()
    mean, std, _ = moment_values(whole, dtype)
    return (mean, std, whole.finite) if mean is not None and std is not None else None


def _init_like(mean: float, std: float, count: int, init_stds: tuple[float, ...]) -> float | None:
    """The init std whose fresh normal draw these statistics are (mean 0 within the sample's error), or None."""
    if std <= 0 or abs(mean) > max(0.1, 4 / math.sqrt(count)) * std:
        return None
    return next((ref for ref in init_stds if abs(std - ref) <= INIT_STD_TOLERANCE * ref), None)


def _reinitialised(torch: Any, source: Any, got: Any, init_stds: tuple[float, ...]) -> str | None:
    """How ``got`` is a fresh init in place of ``source`` (its wording), or None where it is not one."""
    if not init_stds or source.shape != got.shape:
        return None
    have, was = _mean_std(torch, got), _mean_std(torch, source)
    delta = _mean_std(torch, got.to(torch.float64) - source.to(torch.float64))
    if have is None or was is None or delta is None or not was[1]:
        return None
    ref = _init_like(*have, init_stds)
    if ref is None:
        return None
    # an independent draw: var(got - source) = var(got) + var(source), i.e. no correlation between the two
    correlation = (have[1] ** 2 + was[1] ** 2 - delta[1] ** 2) / (2 * have[1] * was[1])
    if abs(correlation) > max(0.2, 4 / math.sqrt(have[2])):
        return None
    if _init_like(*was, init_stds) is None:  # the checkpoint's slice moved from init: the export's did not
        return (
            f"re-initialised (mean {have[0]:.2g}, std {have[1]:.3g}: a fresh init at std {ref:.3g}, uncorrelated "
            f"with the checkpoint's slice of std {was[1]:.3g}, which has moved from init)"
        )
    # Both at init statistics: a fresh draw and another (barely trained) model's weights look alike.
    return (
        f"re-initialised or another model's (mean {have[0]:.2g}, std {have[1]:.3g}: init statistics at std "
        f"{ref:.3g}, uncorrelated with the checkpoint's slice of std {was[1]:.3g}, itself at init statistics)"
    )
