"""The data files of a checkpoint against its index: missing, unreadable, truncated or unreferenced files,
and chunks the index places nowhere. Metadata and file sizes only; no tensor bytes are read."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.torch_dist import referenced_data_files
from ckptdoctor.problems import (
    DATA_FILE_MISSING,
    DATA_FILE_TRUNCATED,
    DATA_FILE_UNREFERENCED,
    STORAGE_ENTRY_MISSING,
    LostChunk,
    Problem,
    lost_summary,
)
from ckptdoctor.storage.files import check_regular

BACKUP_METADATA_RE = re.compile(r"^\.metadata\.bak-[0-9T]+(?:-[0-9a-f]+)?$")
# relative data file -> (range end, key, offsets, sizes) of each chunk stored there
_ChunksByFile = dict[str, list[tuple[int, str, tuple[int, ...], tuple[int, ...]]]]


def storage_problems(checkpoint: Checkpoint) -> tuple[list[Problem], set[str]]:
    """Chunks without a storage entry, missing, unreadable and truncated data files, unreferenced data files;
    and the set of bad data files. The one storage check: ``check`` (CKD112-115) and the write commands'
    refusal of a damaged source both read it."""
    problems: list[Problem] = []
    directory = checkpoint.iteration_dir
    ends: dict[str, int] = {}
    unplaced: list[str] = []
    for entry in checkpoint.entries.values():
        for chunk in entry.chunks:
            storage = chunk.storage
            if storage is None:
                unplaced.append(entry.key)
                continue
            end = storage.offset + storage.length
            if end > ends.get(storage.relative_path, -1):
                ends[storage.relative_path] = end
    if unplaced:
        keys = sorted(set(unplaced))
        example = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        problems.append(
            Problem(
                STORAGE_ENTRY_MISSING,
                directory / ".metadata",
                f"{len(unplaced)} chunk(s) have no storage entry: {example}",
            )
        )
    by_file: _ChunksByFile | None = None
    bad: set[str] = set()
    sizes = checkpoint.data_files
    for relative, end in sorted(ends.items()):
        size = sizes.get(relative)
        why = _unreadable(directory / relative, size)
        if why is not None:
            bad.add(relative)
            by_file = by_file or _chunks_by_file(checkpoint)
            lost = _lost_in(by_file, relative)
            problems.append(
                Problem(
                    DATA_FILE_MISSING,
                    directory if why == "missing" else directory / relative,
                    f"{relative} missing: {lost_summary(lost)}"
                    if why == "missing"
                    else f"unreadable ({why}): {lost_summary(lost)}",
                    lost=lost,
                )
            )
            continue
        if size is None:  # not listed with the data files (a zarr chunk): ask the file itself
            size = _size(directory / relative)
        if end > size:
            bad.add(relative)
            by_file = by_file or _chunks_by_file(checkpoint)
            lost = _lost_in(by_file, relative, past=size)
            problems.append(
                Problem(
                    DATA_FILE_TRUNCATED,
                    directory / relative,
                    f"truncated: {size} bytes, but .metadata places data up to byte {end}; {lost_summary(lost)}",
                    lost=lost,
                )
            )
    if checkpoint.dcp is None:  # legacy zarr: a chunk file is the raw elements, its size is all there is to check
        problems += _zarr_chunk_sizes(checkpoint, bad)
    # DCP writes an empty file for a rank with nothing to save: no space wasted, nothing mixed up
    unreferenced = {name for name in set(sizes) - set(ends) if sizes[name] != 0}
    kept = _kept_for_backups(directory, unreferenced) if unreferenced else set()
    for name in sorted(unreferenced - kept):
        problems.append(
            Problem(DATA_FILE_UNREFERENCED, directory / name, "no .metadata entry references this file", fatal=False)
        )
    return problems, bad


MAX_BACKUPS_READ = 32  # the newest; each read is bounded by the unpickler's limits


def _kept_for_backups(directory: Path, names: set[str]) -> set[str]:
    """Which of ``names`` a ``.metadata.bak-<stamp>`` beside ``.metadata`` references: the data an in-place write's
    backup restores (``fix-args --in-place`` puts the common state in a new file each run, so after a second run
    the first run's file is referenced by the second run's backup only; quarantining it broke that restore).
    A backup that does not parse keeps nothing."""
    if not isinstance(directory, Path):  # object storage: no in-place write makes backups there
        return set()
    try:
        backups = sorted((name for name in os.listdir(directory) if BACKUP_METADATA_RE.match(name)), reverse=True)
    except OSError:
        return set()
    kept: set[str] = set()
    for name in backups[:MAX_BACKUPS_READ]:
        try:
            kept |= referenced_data_files(directory / name) & names
        except CkptError:
            continue
    return kept


def _zarr_chunk_sizes(checkpoint: Checkpoint, bad: set[str]) -> list[Problem]:
    """Legacy zarr chunk files whose size is not their chunk's element bytes (Megatron writes them uncompressed
    and unpadded): a truncated or grown chunk file, which every value reader refuses."""
    problems = []
    for entry in checkpoint.entries.values():
        if entry.kind != "tensor":
            continue
        for chunk in entry.chunks:
            storage = chunk.storage
            need = entry.chunk_nbytes(chunk)
            if storage is None or need is None or storage.length == need or storage.relative_path in bad:
                continue
            bad.add(storage.relative_path)
            problems.append(
                Problem(
                    DATA_FILE_TRUNCATED,
                    checkpoint.iteration_dir / storage.relative_path,
                    f"{'truncated' if storage.length < need else 'too long'}: {storage.length} bytes, but the chunk "
                    f"of {entry.key} at {list(chunk.offsets)} ({list(chunk.sizes)} of {entry.dtype}) needs {need}",
                    lost=(_lost_chunk(entry.key, chunk.offsets, chunk.sizes, storage.relative_path),),
                )
            )
    return problems


def _unreadable(path: Path, size: int | None) -> str | None:
    """Why a referenced data file cannot be read ("missing", or the OS's reason), or None. Never blocks: a FIFO
    named like a data file must not hang the scan."""
    try:
        check_regular(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1  # vanished since it was opened: every range is past its end


def _chunks_by_file(checkpoint: Checkpoint) -> _ChunksByFile:
    """Each data file's chunks (built only when a file is bad)."""
    by_file: _ChunksByFile = {}
    for entry in checkpoint.entries.values():
        for c in entry.chunks:
            if c.storage is not None:
                by_file.setdefault(c.storage.relative_path, []).append(
                    (c.storage.offset + c.storage.length, entry.key, c.offsets, c.sizes)
                )
    return by_file


def _lost_in(by_file: _ChunksByFile, relative: str, past: int = -1) -> tuple[LostChunk, ...]:
    """The chunks stored in ``relative`` whose byte range ends after ``past`` (all of them by default: a missing
    file), by key and then offsets."""
    lost = [
        _lost_chunk(key, offsets, sizes, relative)
        for end, key, offsets, sizes in by_file.get(relative, ())
        if end > past
    ]
    return tuple(sorted(lost, key=lambda chunk: (chunk.key, chunk.offsets)))


def _lost_chunk(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], relative: str) -> LostChunk:
    return LostChunk(key, tuple(map(int, offsets)), tuple(map(int, sizes)), relative)
