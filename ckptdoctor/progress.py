"""The one progress protocol of byte-bound operations (check --deep, diff --values, seal, strip-frozen, edit).

Operations never print: they tell a :class:`Progress` how far they got, in bytes, phase by phase; the CLI
draws it (``commands/progress_bar.py``) when stderr is a terminal. ``None`` where nobody watches.
"""

from __future__ import annotations


class Progress:
    """Receives the progress of one operation. The base class ignores everything (a null progress)."""

    def start(self, label: str, total_bytes: int) -> None:
        """A phase begins (a checkpoint's deep pass, reading values, hashing, copying, ...)."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes of the current phase are done."""

    def finish(self) -> None:
        """The current phase ended."""
