"""The one progress display: bytes done, rate and ETA on one stderr line, only when stderr is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ckptdoctor.progress import Progress
from ckptdoctor.render.common import human_bytes
from ckptdoctor.text_safety import escape

_REDRAW_S = 0.1  # at most ten redraws a second: a bar must not cost what it measures
_WIDTH = 24


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressBar(Progress):
    """``label [#####-----]  41%  1.2 GiB / 3.0 GiB  310 MiB/s  ETA 0:00:06``, redrawn in place."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._label = ""
        self._total = 0
        self._done = 0
        self._started = 0.0
        self._drawn = 0.0
        self._active = False

    def start(self, label: str, total_bytes: int) -> None:
        if self._active:
            self.finish()
        self._label, self._total, self._done = escape(label), max(total_bytes, 0), 0
        self._started = self._drawn = time.monotonic()
        self._active = True
        self._draw(time.monotonic())

    def advance(self, nbytes: int) -> None:
        if not self._active:
            return
        self._done += nbytes
        now = time.monotonic()
        if now - self._drawn >= _REDRAW_S:
            self._draw(now)

    def finish(self) -> None:
        if self._active:
            self._draw(time.monotonic())
            self._stream.write("\n")
            self._stream.flush()
            self._active = False

    def line(self, now: float) -> str:
        elapsed = max(now - self._started, 1e-9)
        done = min(self._done, self._total) if self._total else self._done
        fraction = done / self._total if self._total else 1.0
        filled = int(fraction * _WIDTH)
        rate = self._done / elapsed
        parts = [
            f"{self._label} [{'#' * filled}{'-' * (_WIDTH - filled)}] {fraction:4.0%}",
            f"{human_bytes(done)} / {human_bytes(self._total)}",
            f"{human_bytes(int(rate))}/s",
        ]
        if rate > 0 and done < self._total:
            parts.append(f"ETA {_clock((self._total - done) / rate)}")
        return "  ".join(parts)

    def _draw(self, now: float) -> None:
        self._drawn = now
        self._stream.write("\r\x1b[K" + self.line(now))
        self._stream.flush()


def progress_bar(enabled: bool = True) -> ProgressBar | None:
    """A bar on stderr when ``enabled`` and stderr is a terminal, else None (nothing drawn, nothing paid)."""
    return ProgressBar() if enabled and sys.stderr.isatty() else None
