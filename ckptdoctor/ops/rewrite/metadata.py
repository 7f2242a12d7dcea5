"""The new ``.metadata`` and data files of a key rewrite: the source's ``.metadata`` objects, edited and pickled
again through :func:`ckptdoctor.pickle.unpickler.dumps_taken` (read back through the allowlist before it is
written), the data files linked or laid out by :func:`ckptdoctor.formats.dcp_writer.plan_copies`. The staged
write around them is :mod:`ckptdoctor.ops.rewrite.write`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptdoctor import atomic
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.formats import dcp_keys, dcp_writer, torch_dist
from ckptdoctor.formats.dcp_writer import CopiedFile
from ckptdoctor.gc_pause import gc_paused
from ckptdoctor.ops.rewrite.request import CommonWrite, KeyEdit, Progress, StripResult
from ckptdoctor.pickle import unpickler


def _link_data_files(src: Path, stage: Path, metadata: Any, keep: set[str]) -> list[CopiedFile]:
    """Hard-link (or copy) every data file that holds a kept item; returns them with their kept items."""
    files = []
    for name, items in dcp_writer.kept_storage(metadata, keep).items():
        atomic.link_or_copy(src / name, stage / name)
        files.append(CopiedFile(name, len(items), (stage / name).stat().st_size))
    return files


def _new_metadata(held: list, edit: KeyEdit, stage: Path) -> tuple[list[str], bytes]:
    """The edited ``.metadata`` pickled (and read back through the allowlist); the common state rewritten into
    the staging dir first when the edit changes it. Returns the names the common rewrite wrote and the pickle.

    ``held``: a list holding the source's ``.metadata`` object, its only reference; the object is taken out of
    it and let go once pickled, so the read-back check reuses its memory."""
    metadata = held[0]
    dcp_keys.edit_metadata(metadata, edit.keep, edit.renames)
    common = edit.common(stage) if edit.common is not None else CommonWrite([])
    common.apply(metadata, stage / ".metadata")
    del metadata
    with gc_paused():
        payload = unpickler.dumps_taken(held)  # stand-ins become the torch classes again
    return common.written, payload


def edited(checkpoint: Checkpoint, edit: KeyEdit, stage: Path, progress: Progress, result: StripResult) -> list[str]:
    """The new ``.metadata`` from the source's objects, edited and pickled again, and the data files; the names the
    common rewrite wrote."""
    src = checkpoint.iteration_dir
    # The one reference to the source's .metadata object (see _new_metadata); the cyclic GC is paused by the load
    if edit.metadata is not None:
        held = [edit.metadata.take()]
    else:
        held = [torch_dist.load_metadata_object(src / ".metadata")]
    if edit.compact:
        # The new layout is known before a byte moves: the copy runs in a helper process (threads where none can
        # start; see dcp_writer.BackgroundCopy) while this process builds, pickles and checks the new .metadata.
        copies = dcp_writer.plan_copies(dcp_writer.kept_storage(held[0], edit.keep - edit.rewritten))
        with dcp_writer.BackgroundCopy(src, stage, copies, progress, edit.jobs) as copy:
            rebuilt, payload = _new_metadata(held, edit, stage)
            result.files = copy.result()
        result.bytes_copied = sum(f.bytes for f in result.files)
        atomic.fault_point(f"{edit.step}:data-written")
    else:
        result.files = _link_data_files(src, stage, held[0], edit.keep)
        atomic.fault_point(f"{edit.step}:data-written")
        rebuilt, payload = _new_metadata(held, edit, stage)
    atomic.write_atomic(stage / ".metadata", payload)
    result.metadata_bytes = len(payload)
    return rebuilt
