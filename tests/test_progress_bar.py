"""The one progress display (commands/progress_bar.py): bytes done, rate and ETA on one redrawn line."""

from __future__ import annotations

import io

from ckptdoctor.commands.progress_bar import ProgressBar, progress_bar


def test_line_shows_bytes_rate_and_eta():
    stream = io.StringIO()
    bar = ProgressBar(stream)
    bar.start("hashing", 4 << 30)
    bar.advance(1 << 30)
    line = bar.line(bar._started + 2.0)  # 1 GiB in 2 s: 512 MiB/s, 3 GiB left: 6 s
    assert line.startswith("hashing [######------------------]  25%")
    assert "1.0 GiB / 4.0 GiB" in line and "512.0 MiB/s" in line and line.endswith("ETA 0:00:06")
    bar.finish()
    out = stream.getvalue()
    assert out.startswith("\r\x1b[K") and out.endswith("\n") and out.count("\n") == 1


def test_phases_each_end_their_line_and_labels_are_escaped():
    stream = io.StringIO()
    bar = ProgressBar(stream)
    bar.start("comparing with base", 10)
    bar.advance(10)
    bar.start("copying\x1b[2J kept items", 0)  # a new phase ends the previous line first
    bar.finish()
    bar.finish()  # a second finish draws nothing more
    out = stream.getvalue()
    assert out.count("\n") == 2 and "\x1b[2J" not in out
    assert "comparing with base [########################] 100%" in out


def test_no_bar_when_stderr_is_not_a_terminal():
    assert progress_bar() is None  # pytest captures stderr
    assert progress_bar(False) is None
