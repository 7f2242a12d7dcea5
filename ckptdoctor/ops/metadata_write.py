"""The new ``.metadata`` and data files of a key rewrite, one of two ways: written from the source pickle's bytes
(:mod:`ckptdoctor.formats.metadata_filter`, where it recognises everything) or from the source's objects, edited and
pickled again (everything else: renames, held objects, a filter that declines). Both lay the data out the same way
(:func:`ckptdoctor.formats.dcp_writer.layout`) and give the same result; the staged write around them is
:mod:`ckptdoctor.ops.key_write`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptdoctor import atomic, safe_pickle
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.formats import dcp_keys, dcp_writer, torch_dist
from ckptdoctor.formats.dcp_writer import CopiedFile
from ckptdoctor.formats.metadata_filter import Expected, Source, packed, write_filtered
from ckptdoctor.gc_pause import gc_paused
from ckptdoctor.ops.key_edit import CommonWrite, KeyEdit, Progress, StripResult


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
        payload = safe_pickle.dumps_taken(held)  # stand-ins become the torch classes again
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


def filtered(
    checkpoint: Checkpoint, edit: KeyEdit, stage: Path, progress: Progress, result: StripResult
) -> list[str] | None:
    """The new ``.metadata`` written from the source's bytes (:mod:`ckptdoctor.formats.metadata_filter`: no record
    of it is built) and the data files, laid out from the index (a compacted copy runs while the filter writes);
    the names the common rewrite wrote. None (no ``.metadata`` or data file left) where the filter declines: the
    caller edits the objects instead. The source's index is let go before the filter reads the pickle."""
    src, entries, dcp = checkpoint.iteration_dir, checkpoint.entries, checkpoint.dcp
    if dcp is None:  # no .metadata (legacy zarr)
        return None
    source = Source(src / ".metadata", dcp.source_identity, dcp.unlisted)
    kept_keys = [key for key in edit.keep if key in entries]
    chunks = sum(1 for key in kept_keys for chunk in entries[key].chunks if chunk.storage is not None)
    # compacted: the kept items' new places (from the index, as the filter lays them out); else the files to link
    ranges = dcp_writer.kept_ranges(entries, edit.keep - edit.rewritten if edit.compact else edit.keep)
    copies = dcp_writer.layout(ranges)
    expected = Expected(len(kept_keys), chunks)
    if edit.compact:
        expected.ranges, expected.copies = packed(ranges), copies
    del kept_keys, ranges
    common = edit.common(stage) if edit.common is not None else CommonWrite([])
    checkpoint.release_entries()
    if edit.compact:
        # the layout is the index's: the copy runs (in a helper process) while the filter writes the .metadata
        with dcp_writer.BackgroundCopy(src, stage, copies, progress, edit.jobs) as copy:
            outcome = write_filtered(source, stage / ".metadata", edit.keep, expected, common.repoint)
            if outcome.reason is None:
                result.files = copy.result()
            else:
                copy.stop()
        if outcome.reason is not None:  # the object rewrite copies again (its files are created afresh)
            for copied in copies:
                (stage / copied.name).unlink(missing_ok=True)
    else:
        outcome = write_filtered(source, stage / ".metadata", edit.keep, expected, common.repoint)
    if outcome.reason is not None:
        result.metadata_filter = f"declined: {outcome.reason}"
        return None
    result.metadata_filter = "filtered"
    result.metadata_bytes = outcome.metadata_bytes
    if edit.compact:
        result.bytes_copied = sum(f.bytes for f in result.files)
    else:
        for copied in copies:
            atomic.link_or_copy(src / copied.name, stage / copied.name)
            result.files.append(CopiedFile(copied.name, copied.items, (stage / copied.name).stat().st_size))
    atomic.fault_point(f"{edit.step}:data-written")
    return common.written
