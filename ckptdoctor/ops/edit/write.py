"""``ckptdoctor edit``, writing half: the plan applied through strip-frozen's staged writer.

Default: O(metadata). A new ``.metadata`` (keys removed and renamed everywhere it names them) beside hard links
to the source's data files (copies across filesystems); removed items stay in the linked files, unreferenced.
``--compact``: the kept items byte-copied into new data files, exactly as ``strip-frozen`` writes them. Both go
through :func:`ckptdoctor.ops.rewrite.write.write_keys`: staging dir, fsync, atomic rename or exchange, backup for
``--in-place``, fault points ``edit:<step>``. Dropping a whole section also rewrites the common state (a new
``common.pt``, or a small new data file the ``.metadata`` entry of ``common_state/shard_0_1`` points to).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor import locking
from ckptdoctor.checkpoint import Checkpoint, HeldMetadata
from ckptdoctor.errors import CkptError
from ckptdoctor.ops.edit.plan import SCHEMA, EditPlan, EditRequest, plan_edit
from ckptdoctor.ops.rewrite.common_state import common_rewriter
from ckptdoctor.ops.rewrite.request import KeyEdit, StripResult
from ckptdoctor.ops.rewrite.write import check_integrity, check_target, write_keys
from ckptdoctor.ops.staged_integrity import verify_source_manifest
from ckptdoctor.progress import Progress
from ckptdoctor.rules import leftovers


@dataclass
class EditReport:
    schema: str = field(init=False, default=SCHEMA)  # top level, as in every command's JSON
    plan: EditPlan
    result: StripResult | None  # None for --dry-run
    dry_run: bool
    compact: bool
    linked_files: int = 0  # data files of the output that are the source's own (hard links)
    copied_files: int = 0  # data files copied (--compact, or linking failed across filesystems)


def _inodes(directory: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    out = {}
    for name in names:
        try:
            st = os.stat(directory / name)
        except OSError:
            continue
        out[name] = (st.st_dev, st.st_ino)
    return out


def _count_links(before: dict[str, tuple[int, int]], result: StripResult) -> tuple[int, int]:
    """Data files of the output that are the source's own files (hard links) and those that are copies."""
    after = _inodes(Path(result.iteration_dir), [f.name for f in result.files])
    linked = sum(1 for name, ident in after.items() if before.get(name) == ident)
    return linked, len(result.files) - linked


def edit(
    checkpoint: Checkpoint,
    request: EditRequest,
    *,
    output: Path | None,
    in_place: bool = False,
    compact: bool = False,
    dry_run: bool = False,
    force: bool = False,
    keep_backup: bool = True,
    progress: Progress | None = None,
    metadata: HeldMetadata | None = None,
    jobs: int = 1,
) -> EditReport:
    """Plan the edit and (unless ``dry_run``) write it; every refusal happens before anything is written.

    ``metadata``: the source's ``.metadata`` object from the same read as ``checkpoint``
    (:func:`ckptdoctor.checkpoint.open_for_rewrite`), taken by the write (which edits it); read again when
    not given. A write releases ``checkpoint``'s index (its ``entries`` are empty afterwards) before it pickles
    the new ``.metadata``."""
    if checkpoint.dcp is None:
        raise CkptError(
            f"{checkpoint.iteration_dir}: not a torch_dist checkpoint (no DCP .metadata to rewrite); "
            "edit works on torch_dist checkpoints (Megatron's default since core 0.6)"
        )
    if not dry_run:  # a leftover first: killed right after its swap, a rerun would find no key left to edit
        with locking.checkpoint_lock(checkpoint.iteration_dir, exclusive=False, optional=True):
            leftovers.refuse_if_interrupted(checkpoint.iteration_dir)
    plan = plan_edit(checkpoint, request)
    # only the items the output keeps are gated: an unsafe pickle the edit removes is never read again
    check_integrity(checkpoint, "edit", carried=plan.keep_keys(checkpoint))
    if dry_run:
        return EditReport(plan, None, True, compact)
    check_target(checkpoint, output, in_place, force, keep_backup)
    key_edit = KeyEdit(
        keep=plan.keep_keys(checkpoint),
        renames=plan.rename_map,
        compact=compact,
        step="edit",
        common=common_rewriter(checkpoint, plan.common_changes, "common_state.edit.distcp"),
        rewritten={checkpoint.common_source} if plan.common_changes and checkpoint.common_source else set(),
        metadata=metadata,
        jobs=jobs,
    )
    # in place: exclusive; --output: shared (other readers may copy the same source at the same time)
    with locking.checkpoint_lock(checkpoint.iteration_dir, exclusive=in_place, optional=not in_place):
        leftovers.refuse_if_interrupted(checkpoint.iteration_dir)
        if compact:  # new data files: the fresh manifest must not vouch for changed source bytes
            verify_source_manifest(checkpoint.iteration_dir)
        # --compact creates every data file afresh (O_EXCL): none is the source's own, nothing to compare
        before = {} if compact else _inodes(checkpoint.iteration_dir, sorted(checkpoint.data_files))
        copying = progress is not None and compact
        if progress is not None and copying:
            kept = plan.keep_keys(checkpoint)
            progress.start("copying kept items", sum(e.nbytes for k, e in checkpoint.entries.items() if k in kept))
        try:
            advance = progress.advance if progress is not None and copying else None
            result = write_keys(checkpoint, key_edit, output, in_place, force, keep_backup, advance)
        finally:
            if progress is not None and copying:
                progress.finish()
    linked, copied = (0, len(result.files)) if compact else _count_links(before, result)
    return EditReport(plan, result, False, compact, linked, copied)
