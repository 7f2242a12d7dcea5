"""Resource limits for every pickle ckptdoctor reads: the defaults, or what the command line set.

:mod:`ckptdoctor.pickle.scanner` enforces them before the unpickler runs; readers that size a read by the limit
(``.metadata``, bytes items) ask :func:`current_limits`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptdoctor.errors import PickleLimitError


@dataclass(frozen=True)
class PickleLimits:
    """Limits for one pickle. The defaults fit every checkpoint seen (DCP ``.metadata`` of 200k keys is
    ~70 MB); raise ``max_bytes`` for legitimate giants with ``--max-pickle-bytes``."""

    max_bytes: int = 1 << 30
    max_tuple_depth: int = 200
    max_string: int = 256 << 20
    # Ints, floats and tuples hash the same in every process, so n keys built to collide cost O(n**2) to
    # insert (hash flooding: 100k such keys in 1.2 MB of pickle take ~40 s). No checkpoint keys this many.
    max_hashed_keys: int = 50_000
    # Bytes of a binary integer (LONG1 / LONG4; a protocol 0 INT / LONG / FLOAT line: 3 characters per byte).
    # 64 bytes is 512 bits, far beyond any int a checkpoint holds (int64 sizes, 32-bit RNG words). Python
    # refuses to print an int of more than 4,300 digits (and takes quadratic time to): a few KB of pickle
    # could otherwise stop every report that shows it.
    max_int_bytes: int = 64

    def check_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise self.size_refusal(size)

    def size_refusal(self, size: int) -> PickleLimitError:
        """The refusal of a pickle of ``size`` bytes: what :meth:`check_size` raises, and what a reader raises that
        learns a file's size before reading it (``storage.files.TooLarge``: nothing of it read)."""
        return PickleLimitError(
            f"pickle of {size} bytes exceeds the limit of {self.max_bytes} bytes (raise it with --max-pickle-bytes)"
        )


DEFAULT_LIMITS = PickleLimits()
_current = DEFAULT_LIMITS


def current_limits() -> PickleLimits:
    """The limits in force: the defaults, or what the command line set (``--max-pickle-bytes``)."""
    return _current


def set_limits(limits: PickleLimits) -> None:
    """Set the limits for this process (the CLI does, once, before any read)."""
    global _current
    _current = limits
