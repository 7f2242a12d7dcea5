"""The CRC-32 of zip records (``torch.save`` archives): :func:`crc32` is ``zlib.crc32``'s result.

The optional C module (``_crc32.c``) folds with carry-less multiplication where the processor has it, several
times zlib's speed (``bench/bench_crc.py``): ``check --deep`` verifies the CRC-32 of every record it reads, so the
checksum runs over every byte of a checkpoint. Elsewhere (no compiler at install, another processor) zlib runs.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

native_crc32: Callable[[Any, int, int], int] | None
try:
    from ckptdoctor.formats._crc32 import crc32 as native_crc32
    from ckptdoctor.formats._crc32 import folds as _folds
except ImportError:  # built without a compiler, or blocked (CKPTDOCTOR_NO_EXTENSIONS)
    native_crc32, FOLDS = None, 0
else:
    FOLDS = _folds()  # the widest fold this processor runs: 0 none, 1 128-bit, 2 512-bit

crc32: Callable[[Any, int], int]
if native_crc32 is not None and FOLDS:
    crc32 = native_crc32  # type: ignore[assignment]  # (its third argument has a default)
else:  # zlib's own loop is faster than the module's byte table
    crc32 = zlib.crc32


def implementation() -> str:
    """Which code computes :func:`crc32` here."""
    if crc32 is zlib.crc32:
        return "zlib"
    return "C, 512-bit folds" if FOLDS == 2 else "C, 128-bit folds"
