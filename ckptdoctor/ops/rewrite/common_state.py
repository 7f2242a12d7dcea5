"""The common state (``common.pt`` or Megatron's ``common_state`` item) of a key rewrite, changed as one step of
the staged write (:class:`ckptdoctor.ops.rewrite.write.KeyEdit`'s ``common`` hook): ``edit --drop-section`` drops
leftovers and sets args, ``strip-frozen`` sets ``save_trainable_params_only``. In a Megatron-LM plain DCP save
(torch_dcp, fsdp_dtensor) the args are the state dict's ``args`` item, rewritten alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ckptdoctor import atomic
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import BACKEND_DCP
from ckptdoctor.formats.run_config import RUN_CONFIG, read_run_config
from ckptdoctor.formats.torch_dist import StorageLocation
from ckptdoctor.formats.torch_zip import dump_torch_zip
from ckptdoctor.ops.fix_args.plan import ArgChange, common_with_args
from ckptdoctor.ops.fix_args.write import updated_run_config
from ckptdoctor.ops.rewrite.request import CommonChange, CommonWrite


def _new_common(checkpoint: Checkpoint, changes: list[CommonChange]) -> dict:
    values = {change.name: change.new for change in changes if change.what == "set-arg"}
    common = common_with_args(checkpoint.common_state(), values) if values else dict(checkpoint.common_state())
    for change in changes:
        if change.what == "drop":
            common.pop(change.name, None)
        elif change.what == "drop-content-metadata":
            content = dict(common.get("content_metadata") or {})
            content.pop(change.name, None)
            common["content_metadata"] = content
    return common


def common_rewriter(
    checkpoint: Checkpoint, changes: list[CommonChange], file_name: str
) -> Callable[[Path], CommonWrite] | None:
    """The ``KeyEdit.common`` hook that writes the edited common state into the staging dir: a new ``common.pt``,
    or (core >= 0.19, the common state a ``.metadata`` item) a new data file ``file_name`` that the new
    ``.metadata`` points the item to (``CommonWrite.repoint``: written in by the metadata filter, or applied to the
    objects); Megatron-Bridge's ``run_config.yaml`` kept in step with the args.
    None where nothing changes. The new common state is made here, from the checkpoint's index, so the write may
    release that index before it pickles the new ``.metadata`` (:meth:`Checkpoint.release_entries`)."""
    if not changes:
        return None
    common = _new_common(checkpoint, changes)
    source = checkpoint.common_source
    plain_dcp = checkpoint.location.backend == BACKEND_DCP

    def rewrite(stage: Path) -> CommonWrite:
        done = CommonWrite([])
        if plain_dcp and source is not None:
            # Megatron-LM torch_dcp / fsdp_dtensor: args is the state dict's own item, which DCP saved as
            # torch.save(args); the other top-level items keep their bytes
            payload = dump_torch_zip(common[source])
            atomic.write_atomic(stage / file_name, payload)
            done.repoint = (source, StorageLocation(file_name, 0, len(payload)))
            done.written.append(file_name)
        elif source == "common.pt":
            atomic.write_atomic(stage / "common.pt", dump_torch_zip(common))
            done.written.append("common.pt")
        elif source is None:
            raise CkptError(f"{checkpoint.iteration_dir}: no common state to rewrite")
        else:
            payload = dump_torch_zip([common])  # Megatron writes a ShardedObject as torch.save([obj])
            atomic.write_atomic(stage / file_name, payload)
            done.repoint = (source, StorageLocation(file_name, 0, len(payload)))
            done.written.append(file_name)
        arg_changes = [ArgChange(c.name, c.old, c.new, "set") for c in changes if c.what == "set-arg"]
        run_config = read_run_config(checkpoint.iteration_dir) if arg_changes else None
        if run_config is not None:  # Megatron-Bridge's copy of the args, kept in step
            text, updated = updated_run_config(run_config, arg_changes)
            if updated:
                atomic.write_atomic(stage / RUN_CONFIG, text.encode("utf-8"))
                done.written.append(RUN_CONFIG)
        return done

    return rewrite
