"""A new ``.metadata`` with keys left out, written from the source's bytes (``_metadata_filter.c``): no object of
the source is built, so a rewrite of 200k keys holds the pickle and a few tables instead of every record.

The filter writes only where it recognises every place a key is listed (see the C source); otherwise, and where the
extension is not built, :func:`write_filtered` says why it did not (``Filtered.reason``) and the caller edits the
objects as before. What it
wrote is kept only if its counts are the caller's (keys and storage items kept, each data file's compacted size);
see :func:`write_filtered` for why what it writes needs no second read through the allowlist.
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
from ckptdoctor.formats.dcp_writer import FileCopy
from ckptdoctor.formats.files import open_regular, stat_identity
from ckptdoctor.formats.torch_dist import StorageLocation
from ckptdoctor.safe_globals import UnlistedGlobal

_filter: Callable[..., dict[str, Any]] | None
try:
    from ckptdoctor._metadata_filter import filter_metadata as _filter
except ImportError:  # no C compiler at install time: the object rewrite does it all
    _filter = None


@dataclass
class Expected:
    """What the written ``.metadata`` must hold, from the source's index: the kept keys and storage items, and for a
    compacted copy each data file's kept (offset, length) ranges, :func:`packed`, and the new files."""

    keys: int
    storage_items: int
    ranges: dict[str, bytes] | None = None
    copies: list[FileCopy] | None = None


def packed(ranges: dict[str, list[tuple[int, int]]]) -> dict[str, bytes]:
    """Each file's ranges, in the order :func:`dcp_writer.layout` lays them out, as native int64 pairs (the filter
    compares them with its own): 16 bytes a range instead of a tuple of two ints."""
    return {name: array.array("q", [v for pair in pairs for v in pair]).tobytes() for name, pairs in ranges.items()}


@dataclass
class Filtered:
    metadata_bytes: int
    reason: str | None = None  # why it did not write (None: it did)


@dataclass
class Source:
    """The ``.metadata`` to filter as the index read it: its identity then (:func:`files.file_identity`) and the
    globals outside the allowlist it named (tolerated in a read, refused in what is written)."""

    path: Path
    identity: tuple[int, ...] | None
    unlisted: tuple[UnlistedGlobal, ...] = ()


def write_filtered(
    source: Source, dest: Path, keep: set[str], expected: Expected, repoint: tuple[str, StorageLocation] | None
) -> Filtered:
    """Write ``dest`` (atomically) from ``source`` with only the ``keep`` keys; storage offsets compacted where
    ``expected.ranges`` is given, and ``repoint``'s key pointed at a new place. ``reason`` is set (and nothing
    written) where the filter declines or what it wrote is not what ``expected`` says.

    What is written holds only bytes of the source, except the new offsets, lengths and path: the same globals,
    read back in the same places. So it is written only from the file the index read, unchanged since (its
    identity before the read and after the filter's second pass; the filter's two passes hash every byte and must
    agree), and only where that read met no global outside the allowlist. The pickle written is then read by the
    filter's first pass again: one Metadata object, the expected keys and storage items, nothing left out."""
    if _filter is None:
        return Filtered(0, "the C extension is not built")
    if source.unlisted:
        return Filtered(0, "the source names globals outside the allowlist")
    if source.identity is None:
        return Filtered(0, "not a local file read by the index")
    target = None if repoint is None else (repoint[0], repoint[1].relative_path, repoint[1].length)
    outcome: dict = {}
    try:
        source_file = open_regular(source.path)
    except OSError as exc:
        raise CkptError(f"{source.path}: cannot read ({exc.strerror})") from None

    def unchanged() -> bool:
        return stat_identity(os.fstat(source_file.fileno())) == source.identity

    def fill(fd: int) -> bool:
        try:
            outcome.update(_filter(source_file.fileno(), keep, expected.ranges, target, fd))
        except ValueError as exc:  # the file changed size while read: the object rewrite reads it again
            outcome["declined"] = str(exc)
        except OSError as exc:
            raise CkptError(f"{source.path}: cannot read ({exc.strerror})") from None
        if "declined" not in outcome and not unchanged():
            outcome["declined"] = "the file changed since the index read it"
        return "declined" not in outcome and _as_expected(outcome, expected, repoint) is None

    with source_file:
        if not unchanged():
            return Filtered(0, "the file changed since the index read it")
        written = atomic.write_atomic_with(dest, fill, check=lambda path: _reads_back(path, keep, expected))
    if not written:
        reason = outcome.get("declined") or _as_expected(outcome, expected, repoint) or "it does not read back"
        return Filtered(0, reason)
    return Filtered(int(outcome["bytes"]))


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


def _reads_back(path: Path, keep: set[str], expected: Expected) -> bool:
    """The pickle written, walked again by the filter's first pass: every key and storage item kept, none left out."""
    assert _filter is not None
    with open_regular(path) as written:
        again = _filter(written.fileno(), keep, None, None, -1)
    return (
        "declined" not in again
        and again["keys_dropped"] == again["storage_dropped"] == again["other_dropped"] == 0
        and (again["keys_kept"], again["storage_kept"]) == (expected.keys, expected.storage_items)
    )


def disabled() -> bool:
    """``CKPTDOCTOR_NO_METADATA_FILTER=1``: always the object rewrite (for comparing the two)."""
    return os.environ.get("CKPTDOCTOR_NO_METADATA_FILTER", "") not in ("", "0")
