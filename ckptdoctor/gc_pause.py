"""The one switch of Python's cyclic garbage collector.

Reading a checkpoint's index builds 10^5-10^6 small objects that hold no reference cycles. The collector's
repeated full scans over them cost a third of a structural diff and more than half of a ``.metadata`` load,
and free nothing (reference counting frees what is dropped). Every place that builds such objects pauses the
collector through :func:`gc_paused`, which nests and restores the state it found: the console entry point
pauses it for the whole short-lived process, library callers get it back as it was.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# The console entry point ends the process with os._exit once its output is flushed (see cli.run), so what a
# command still holds then is never freed. A command's index of 10^6 chunks freed one object at a time when the
# command returns cost ~0.3 s of a 5 s inspect: such a command hands it here instead, and in that short-lived
# process it stays referenced until the exit. Library callers (no short-lived process) free it as usual.
_HELD_UNTIL_EXIT: list[object] = []
_short_lived = False


def short_lived_process() -> None:
    """Called once by the console entry point, whose process ends with ``os._exit``."""
    global _short_lived
    _short_lived = True


def hold_until_exit(obj: object) -> None:
    """Keep ``obj`` (a command's last reference to a large index) until ``os._exit`` in a short-lived process."""
    if _short_lived:
        _HELD_UNTIL_EXIT.append(obj)
