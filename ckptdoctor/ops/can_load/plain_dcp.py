"""``can-load`` of a plain PyTorch DCP save (FSDP2, TorchTitan, Megatron-LM torch_dcp): DCP's own resharding.

``torch.distributed.checkpoint.load`` asks each requested key's global shape and reads, on each rank, whatever
parts of the saved chunks overlap the rank's shard: any world size loads when the keys exist with their global
shapes and the chunks tile them (uneven DTensor shards included). What does not reshard is per-rank state: TorchTitan
keeps one ``dataloader.dp_rank_<r>`` entry per data-parallel rank, and a rank whose entry is missing starts its data
loader afresh (TorchTitan logs a warning and goes on).
"""

from __future__ import annotations

from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.coverage import coverage_problems
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.plain_dcp import per_rank_keys
from ckptdoctor.ops.can_load.predict import SCHEMA, CanLoadReport, safety_verdict
from ckptdoctor.ops.can_load.run import LoadRun
from ckptdoctor.ops.can_load.verdict import FAILS, LOADS, RESHARDS, SKIPPED, SectionVerdict
from ckptdoctor.parallelism import infer_layout

_SECTIONS = ("model", "optimizer", "rng", "other")


def _world(spec: str, saved: int) -> int:
    """The target world size of ``--target world=N`` (or ``dp=N``: FSDP's data-parallel mesh is the world)."""
    values = {}
    for part in spec.split(","):
        name, _, number = part.strip().partition("=")
        if name not in ("world", "dp") or not number.isdigit() or int(number) < 1:
            raise CkptError(f"--target: {part.strip()!r}: a plain DCP save takes world=N (or dp=N), N >= 1")
        values[name] = int(number)
    if len(values) != 1:
        raise CkptError("--target: give world=N or dp=N (one of them)")
    return next(iter(values.values())) or saved


def _layout(world: int) -> dict[str, int]:
    return {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "cp": 1, "dp": world, "world": world}


def _section(ckpt: Checkpoint, section: str, saved: int, target: int) -> SectionVerdict | None:
    entries = ckpt.section_entries(section)
    if not entries:
        return None
    tensors = [e for e in entries if e.kind == "tensor" and e.shape is not None]
    for entry, problem in coverage_problems(tensors):
        return SectionVerdict(
            section,
            FAILS,
            f"{entry.key}: {problem}: no world size reads a tensor its chunks do not tile",
            f"CheckpointException: {entry.key}: the saved chunks do not cover the requested shard",
            None,
            len(entries),
            len(entries),
        )
    if not tensors:
        return SectionVerdict(
            section,
            LOADS,
            f"{len(entries)} bytes items, read whole by every rank",
            None,
            None,
            len(entries),
            len(entries),
        )
    if target == saved:
        return SectionVerdict(
            section,
            LOADS,
            f"{len(entries)} keys at the saved world size {saved}",
            None,
            None,
            len(entries),
            len(entries),
        )
    return SectionVerdict(
        section,
        RESHARDS,
        f"{len(tensors)} tensors read by global shape at world size {target} (saved at {saved}): DCP reads each "
        "rank's shard from the saved chunks, uneven shards included",
        None,
        None,
        len(entries),
        len(entries),
    )


def predict_plain_dcp(ckpt: Checkpoint, target_spec: str, run: LoadRun) -> CanLoadReport:
    """Whether ``torch.distributed.checkpoint.load`` of ``ckpt`` at the target world size finds what it asks."""
    grid = infer_layout(ckpt).sharding
    saved = max(grid.world_size if grid is not None else 1, 1)
    target = _world(target_spec, saved)
    sections: list[SectionVerdict] = []
    safety = safety_verdict(ckpt)
    if safety is not None:
        sections.append(safety)
    warnings: list[str] = []
    for name in _SECTIONS:
        verdict = _section(ckpt, name, saved, target)
        if verdict is None:
            continue
        per_rank = per_rank_keys(e.key for e in ckpt.section_entries(name))
        if per_rank and target != saved and verdict.verdict != FAILS:
            verdict.verdict = SKIPPED if target > saved else verdict.verdict
            warnings.append(
                f"{len(per_rank)} per-rank dataloader entries (dataloader.dp_rank_<r>) do not reshard: at world size "
                f"{target} "
                + (
                    f"ranks {saved}..{target - 1} find no entry and start their data loader afresh"
                    if target > saved
                    else f"the entries of ranks {target}..{saved - 1} are not read"
                )
            )
            verdict.why = (
                f"{len(ckpt.section_entries(name))} keys; the {len(per_rank)} per-rank dataloader entries do not "
                "reshard (see warnings)"
            )
        sections.append(verdict)
    failing = [s.section for s in sections if s.verdict == FAILS]
    return CanLoadReport(
        schema=SCHEMA,
        path=str(ckpt.location.input_path),
        iteration_dir=str(ckpt.iteration_dir),
        backend=ckpt.location.backend,
        era=ckpt.location.era,
        saved={**_layout(saved), "source": "chunk grids"},
        target=_layout(target),
        options=run.report_options(False),
        will_load=not failing,
        verdict=FAILS if failing else LOADS,
        failing_sections=failing,
        sections=sections,
        warnings=warnings,
    )
