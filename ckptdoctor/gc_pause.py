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
