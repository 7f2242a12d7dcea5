"""What a scan of a checkpoint finds wrong: one :class:`Problem` each, coded as ``check`` reports it.

Detected and worded once: :func:`ckptdoctor.checkpoint.scan` (layout and index) and
:func:`ckptdoctor.data_files.storage_problems` (data files) make them; ``open_checkpoint`` raises the first fatal
one, ``check``'s structure rules (where each code's rationale lives) report them all, and the write commands
refuse a damaged source from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor.errors import CkptError

UNSUPPORTED_FORMAT = "CKD103"
METADATA_JSON_MISSING = "CKD101"
METADATA_JSON_INVALID = "CKD102"
INDEX_MISSING = "CKD110"
INDEX_UNREADABLE = "CKD111"
STORAGE_ENTRY_MISSING = "CKD112"
DATA_FILE_MISSING = "CKD113"
DATA_FILE_TRUNCATED = "CKD114"
DATA_FILE_UNREFERENCED = "CKD115"
UNSAFE_PICKLE = "CKD401"
UNLISTED_GLOBAL = "CKD402"
PICKLE_LIMIT = "CKD403"
ARCHIVE_ANOMALY = "CKD404"
UNSAFE_CONFIG_TARGET = "CKD405"


@dataclass(frozen=True)
class LostChunk:
    """One chunk whose bytes are gone (CKD113 missing, CKD114 truncated data file): the key, the chunk's place in
    the global shape (``offsets``, ``sizes``; empty for a bytes item) and the data file that held it."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the iteration dir


LOST_KEYS_SHOWN = 3  # keys a text summary names; the JSON list is complete


def lost_count(lost: tuple[LostChunk, ...] | list[LostChunk]) -> str:
    """``12 chunks of 4 keys in 2 data files``: how much is lost, without names."""
    chunks, keys, files = len(lost), len({c.key for c in lost}), len({c.file for c in lost})
    return f"{_plural(chunks, 'chunk')} of {_plural(keys, 'key')} in {_plural(files, 'data file')}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def lost_summary(lost: tuple[LostChunk, ...] | list[LostChunk], shown: int = LOST_KEYS_SHOWN) -> str:
    """``lost 12 chunks of 4 keys: a, b, c (+1 more)``: the lost chunks in one bounded line (keys in name order)."""
    keys = sorted({chunk.key for chunk in lost})
    listed = ", ".join(keys[:shown]) + (f" (+{len(keys) - shown} more)" if len(keys) > shown else "")
    return f"lost {_plural(len(lost), 'chunk')} of {_plural(len(keys), 'key')}: {listed}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint's layout, as check reports it and as a command refuses it."""

    code: str
    path: Path  # the file or dir it concerns
    detail: str  # what is wrong, without the path
    fatal: bool = True  # an error: open_checkpoint refuses a scan's, the write commands a source's data-file ones
    error: CkptError | None = field(default=None, compare=False)  # a refusal raised as is (its own wording)
    lost: tuple[LostChunk, ...] = field(default=(), compare=False)  # CKD113/CKD114: the chunks whose bytes are gone

    def as_error(self) -> CkptError:
        return self.error if self.error is not None else CkptError(f"{self.path}: {self.detail}")
