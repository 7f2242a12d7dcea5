"""A new ``.metadata`` with keys left out, written from the source's bytes (``_metadata_filter.c``): no object of
the source is built, so a rewrite of 200k keys holds the pickle and a few tables instead of every record.

The filter writes only where it recognises every place a key is listed (see the C source); otherwise, and where the
extension is not built, :func:`write_filtered` answers None and the caller edits the objects as before. What it
wrote is kept only if its counts are the caller's (keys and storage items kept, each data file's compacted size)
and if the file reads back as every reader reads a ``.metadata`` (the safety pre-pass, the allowlist, the index)
with the same keys and chunks.
"""

from __future__ import annotations

import array
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptdoctor import atomic
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import torch_dist
from ckptdoctor.formats.dcp_writer import FileCopy
from ckptdoctor.formats.files import open_regular, read_releasable
from ckptdoctor.formats.torch_dist import StorageLocation
from ckptdoctor.pickle_limits import current_limits

_filter: Callable[..., dict[str, Any]] | None
try:
    from ckptdoctor._metadata_filter import filter_metadata as _filter
except ImportError:  # no C compiler at install time: the object rewrite does it all
    _filter = None


@dataclass
class Expected:
    """What the written ``.metadata`` must hold, from the source's index: the kept keys and storage items, and for a
    compacted copy each data file's kept ranges (``copies``) in the order :func:`dcp_writer.layout` gives them."""

    keys: int
    storage_items: int
    ranges: dict[str, list[tuple[int, int]]] | None = None
    copies: list[FileCopy] | None = None
    chunks: int = 0  # chunks with a storage location, for the read-back


@dataclass
class Filtered:
    metadata_bytes: int
    garbage_items: int  # items left out of their containers but kept in the pickle (their objects are read later)
    reason: str | None = None  # why it did not write (None: it did)


def write_filtered(
    source: Path, dest: Path, keep: set[str], expected: Expected, repoint: tuple[str, StorageLocation] | None
) -> Filtered:
    """Write ``dest`` (atomically) from ``source`` with only the ``keep`` keys; storage offsets compacted where
    ``expected.ranges`` is given, and ``repoint``'s key pointed at a new place. ``reason`` is set (and nothing
    written) where the filter declines or what it wrote is not what ``expected`` says."""
    if _filter is None:
        return Filtered(0, 0, "the C extension is not built")
    try:
        with open_regular(source) as f:
            data = read_releasable(f, current_limits().max_bytes)
    except OSError as exc:
        raise CkptError(f"{source}: cannot read ({exc.strerror})") from None
    packed = None
    if expected.ranges is not None:
        packed = {
            name: array.array("q", [v for pair in pairs for v in pair]).tobytes()
            for name, pairs in expected.ranges.items()
        }
    target = None if repoint is None else (repoint[0], repoint[1].relative_path, repoint[1].length)
    outcome: dict = {}

    def fill(fd: int) -> bool:
        try:
            outcome.update(_filter(data, keep, packed, target, fd))
        finally:
            if hasattr(data, "close"):
                data.close()
        return "declined" not in outcome and _as_expected(outcome, expected, repoint) is None

    written = atomic.write_atomic_with(dest, fill, check=lambda path: _reads_back(path, expected))
    if not written:
        reason = outcome.get("declined") or _as_expected(outcome, expected, repoint) or "it does not read back"
        return Filtered(0, 0, reason)
    return Filtered(int(outcome["bytes"]), int(outcome["garbage_items"]))


def _as_expected(outcome: dict, expected: Expected, repoint: tuple[str, StorageLocation] | None) -> str | None:
    """Why the filter's counts are not the index's, or None."""
    if "declined" in outcome:
        return None
    if outcome["keys_kept"] != expected.keys or outcome["storage_kept"] != expected.storage_items:
        return (
            f"it kept {outcome['keys_kept']} keys and {outcome['storage_kept']} storage items, the index "
            f"{expected.keys} and {expected.storage_items}"
        )
    if outcome["repointed"] != (repoint is not None):
        return "the common state's storage item was not repointed"
    if expected.copies is not None and outcome["file_sizes"] != {c.name: c.bytes for c in expected.copies if c.items}:
        return "its compacted file sizes are not the copy's"
    return None


def _reads_back(path: Path, expected: Expected) -> bool:
    """The written file read as every command reads a ``.metadata`` (pre-pass, allowlist, index-only records):
    the same number of keys and of chunks with a place."""
    try:
        index = torch_dist.read_metadata(path)
    except (CkptError, OSError):
        return False
    chunks = sum(1 for item in index.items.values() for chunk in item.chunks if chunk.storage is not None)
    return len(index.items) == expected.keys and chunks == expected.chunks


def disabled() -> bool:
    """``CKPTDOCTOR_NO_METADATA_FILTER=1``: always the object rewrite (for comparing the two)."""
    return os.environ.get("CKPTDOCTOR_NO_METADATA_FILTER", "") not in ("", "0")
