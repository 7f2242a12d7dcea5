"""``ckptdoctor strip-frozen``, writing half: integrity check, trainable selection, plan, then the staged write of
the kept keys (:func:`ckptdoctor.ops.rewrite.write.write_keys`), with the saved args set as a
``--save-trainable-params-only`` run writes them.

The run holds the checkpoint lock (:mod:`ckptdoctor.locking`) and refuses a checkpoint with leftovers of an
interrupted run.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor import locking
from ckptdoctor.checkpoint import Checkpoint, HeldMetadata
from ckptdoctor.errors import CkptError
from ckptdoctor.ops.pickle_gate import refuse_unsafe_pickles
from ckptdoctor.ops.rewrite.common_state import common_rewriter
from ckptdoctor.ops.rewrite.request import CommonChange, KeyEdit, StripResult
from ckptdoctor.ops.rewrite.write import check_integrity, check_target, write_keys
from ckptdoctor.ops.staged_integrity import verify_source_manifest
from ckptdoctor.ops.strip.plan import SCHEMA, StripPlan, model_parameters, plan_strip, select_trainable
from ckptdoctor.progress import Progress
from ckptdoctor.rules import leftovers

COMMON_FILE = "common_state.strip-frozen.distcp"  # the rewritten common state (core >= 0.19 checkpoints)


def _trainable_only_arg(checkpoint: Checkpoint) -> list[CommonChange]:
    """The saved arg as Megatron's --save-trainable-params-only run writes it (``save_trainable_params_only:
    true``); none where it is already so or the common state holds no args. Written with the kept keys, as
    ``edit`` writes its common-state changes (:mod:`ckptdoctor.ops.rewrite.common_state`)."""
    args = checkpoint.args
    name = "save_trainable_params_only"
    if not isinstance(args, argparse.Namespace) or getattr(args, name, None) is True:
        return []
    return [CommonChange("set-arg", name, getattr(args, name, None), True, "as --save-trainable-params-only saves it")]


@dataclass
class StripReport:
    schema: str = field(init=False, default=SCHEMA)  # top level, as in every command's JSON
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
    (:func:`~ckptdoctor.checkpoint.open_for_rewrite`), taken by the write; else the write reads it. A write
    releases ``checkpoint``'s index (its ``entries`` are empty afterwards) before it pickles the new ``.metadata``.
    """
    if checkpoint.dcp is None:  # a dry run too: it would show a plan that no write can carry out
        raise CkptError(
            f"{checkpoint.iteration_dir}: not a torch_dist checkpoint (no DCP .metadata to rewrite); "
            "strip-frozen works on torch_dist checkpoints (Megatron's default since core 0.6)"
        )
    check_integrity(checkpoint, carried=())  # the bytes items are gated once the plan says which are carried
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
    # what the output carries is gated, as edit gates it: an unsafe item it drops (a model _extra_state) is never
    # read again
    refuse_unsafe_pickles(checkpoint, plan.keep_keys, metadata_carried=False)
    nothing_frozen = plan.dropped_model_params == 0
    if dry_run or (nothing_frozen and not force):
        return StripReport(plan, None, dry_run, nothing_frozen)
    if progress is not None:
        progress.start("copying kept items", plan.bytes_after)
    try:
        advance = progress.advance if progress is not None else None
        changes = [] if keep_args else _trainable_only_arg(checkpoint)
        source = checkpoint.common_source
        key_edit = KeyEdit(
            plan.keep_keys,
            common=common_rewriter(checkpoint, changes, COMMON_FILE),
            rewritten={source} if changes and source else set(),
            metadata=metadata,
            jobs=jobs,
        )
        result = write_keys(checkpoint, key_edit, output, in_place, force, keep_backup, advance)
        result.args_changed = [{"arg": c.name, "old": c.old, "new": c.new} for c in changes]
    finally:
        if progress is not None:
            progress.finish()
    return StripReport(plan, result, False, nothing_frozen)
