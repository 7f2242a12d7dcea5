"""``ckptdoctor strip-frozen``, writing half: integrity check, trainable selection, plan, then the staged write of
the kept keys (:func:`ckptdoctor.ops.key_write.write_keys`), with the saved args set as a
``--save-trainable-params-only`` run writes them.

The run holds the checkpoint lock (:mod:`ckptdoctor.locking`) and refuses a checkpoint with leftovers of an
interrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptdoctor import atomic, locking
from ckptdoctor.checkpoint import Checkpoint, HeldMetadata
from ckptdoctor.ops.key_write import KeyEdit, StripResult, check_target, write_keys
from ckptdoctor.ops.staged_integrity import verify_source_manifest
from ckptdoctor.ops.strip import StripPlan
from ckptdoctor.progress import Progress
from ckptdoctor.rules import leftovers


def _set_trainable_only_arg(stage: Path, result: StripResult) -> None:
    """Saved args as Megatron's --save-trainable-params-only run writes them (``save_trainable_params_only:
    true``), through fix-args' writer: a new common state (``common.pt``, or a small data file that
    ``.metadata`` is repointed to), written into the staging dir before the integrity manifest."""
    import argparse

    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.ops.fix_args import ArgChange
    from ckptdoctor.ops.fix_args_write import WriteResult, _new_files, _side_files

    staged = open_checkpoint(stage)
    args = staged.args
    if not isinstance(args, argparse.Namespace) or getattr(args, "save_trainable_params_only", None) is True:
        return
    name = "save_trainable_params_only"
    changes = [ArgChange(name, getattr(args, name, None), True, "set")]
    # A fixed name in the fresh staging dir: the same source and selection give the same files. The old
    # common-state item stays in the copied data file, unreferenced (a few KiB), as after fix-args.
    files, _ = _new_files(staged, changes, "strip-frozen")
    _side_files(stage, changes, files, WriteResult("output", str(stage)))  # run_config.yaml, when it has the arg
    for file_name in sorted(files, key=lambda n: n == ".metadata"):  # data first, then the index pointing to it
        atomic.write_atomic(stage / file_name, files[file_name])
    result.args_changed = [{"arg": c.arg, "old": c.old, "new": c.new} for c in changes]


@dataclass
class StripReport:
    plan: StripPlan
    result: StripResult | None  # None for --dry-run (and when refused: nothing frozen)
    dry_run: bool
    # no frozen model parameter: nothing to strip; refused (nothing written, exit 1) unless --force
    nothing_frozen: bool = False


def strip_frozen(
    checkpoint: Checkpoint,
    *,
    output: Path | None,
    in_place: bool = False,
    patterns: list[str] | None = None,
    preset: str | None = None,
    base: Checkpoint | None = None,
    dry_run: bool = False,
    force: bool = False,
    keep_backup: bool = True,
    progress: Progress | None = None,
    keep_args: bool = False,
    jobs: int = 1,
    metadata: HeldMetadata | None = None,
) -> StripReport:
    """The strip-frozen operation: integrity check, trainable selection, plan, and (unless dry-run) write.

    Every refusal (damaged source, bad target, empty selection) happens before anything is written.
    ``metadata``: the source's ``.metadata`` object when the caller read it with the checkpoint
    (:func:`~ckptdoctor.checkpoint.open_for_rewrite`), taken by the write; else the write reads it.
    """
    from ckptdoctor.ops.strip import check_integrity

    check_integrity(checkpoint)
    if dry_run:
        return _plan_and_write(
            checkpoint, output, in_place, patterns, preset, base, True, force, keep_backup, progress, keep_args, jobs
        )
    check_target(checkpoint, output, in_place, force, keep_backup)
    # in place: exclusive; --output: shared (other readers may copy the same source at the same time)
    with locking.checkpoint_lock(checkpoint.iteration_dir, exclusive=in_place, optional=not in_place):
        leftovers.refuse_if_interrupted(checkpoint.iteration_dir)
        verify_source_manifest(checkpoint.iteration_dir)
        return _plan_and_write(
            checkpoint,
            output,
            in_place,
            patterns,
            preset,
            base,
            False,
            force,
            keep_backup,
            progress,
            keep_args,
            jobs,
            metadata,
        )


def _plan_and_write(
    checkpoint: Checkpoint,
    output: Path | None,
    in_place: bool,
    patterns: list[str] | None,
    preset: str | None,
    base: Checkpoint | None,
    dry_run: bool,
    force: bool,
    keep_backup: bool,
    progress: Progress | None,
    keep_args: bool = False,
    jobs: int = 1,
    metadata: HeldMetadata | None = None,
) -> StripReport:
    from ckptdoctor.ops.strip import model_parameters, plan_strip, select_trainable

    comparing = progress is not None and base is not None
    if progress is not None and comparing:
        progress.start("comparing with base", sum(e.nbytes for e in model_parameters(checkpoint).values()))
    try:
        advance = progress.advance if progress is not None and comparing else None
        selection = select_trainable(checkpoint, list(patterns or []), preset, base, advance)
    finally:
        if progress is not None and comparing:
            progress.finish()
    plan = plan_strip(checkpoint, selection)
    nothing_frozen = plan.dropped_model_params == 0
    if dry_run or (nothing_frozen and not force):
        return StripReport(plan, None, dry_run, nothing_frozen)
    if progress is not None:
        progress.start("copying kept items", plan.bytes_after)
    try:
        advance = progress.advance if progress is not None else None
        result = write_keys(
            checkpoint,
            KeyEdit(plan.keep_keys, metadata=metadata, jobs=jobs),
            output,
            in_place,
            force,
            keep_backup,
            advance,
            None if keep_args else _set_trainable_only_arg,
        )
    finally:
        if progress is not None:
            progress.finish()
    return StripReport(plan, result, False, nothing_frozen)
