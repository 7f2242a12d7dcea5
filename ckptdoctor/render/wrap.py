"""Wrapping of long text lines to the output's width, one logical block at a time.

A renderer passes each prose line (a finding, a reason, an args group) through :func:`wrap_block` with the
hanging indent that keeps its continuation lines under the block's text; tables, JSON and ``fix:`` command
lines are never passed. Lines break only at whitespace: a path, a ``key=value`` pair, a flag, a short tuple
such as ``(2, 2)``, a backquoted command and an ``rm -rf PATH`` / ``mv SRC DST`` command stay whole on one
line (copy-pasteable), even where that one piece is wider than the width. Words and their order are
unchanged: only whitespace at a break becomes a newline and the indent.

:func:`output_width` is the width: ``COLUMNS`` when set (as click and :func:`shutil.get_terminal_size` honour
it), else the terminal's width when the stream is a terminal, else :data:`DEFAULT_WIDTH`.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from typing import TextIO

DEFAULT_WIDTH = 100
MIN_WIDTH = 20  # a COLUMNS of 5 would put every word on a line of its own: this is the narrowest honoured

# A shell word, quoted parts included (paths are shlex.quote'd), then the commands a message tells the user to
# run: each kept on one line. A backquoted span (`ckptdoctor inspect DIR`) is one piece too.
_WORD = r"(?:'[^'\n]*'|[^\s;'`])+"
_COMMAND = rf"(?:rm -rf {_WORD}|mv {_WORD} {_WORD})"
# A short tuple or list of plain values ("(2, 2)", "[1, 32, 8]") stays whole too.
_SEQUENCE = r"[(\[][^\s()\[\],]+(?:, [^\s()\[\],]+){1,7}[)\]]"
_PROTECTED = rf"`[^`\n]*`|\b{_COMMAND}(?: && {_COMMAND})*|{_SEQUENCE}"
_ATOM_RE = re.compile(rf"(?:{_PROTECTED}|\S)+")


def output_width(stream: TextIO | None = None) -> int:
    """The width to wrap ``stream``'s text to (``sys.stdout`` by default): ``COLUMNS`` when set to a number, the
    terminal's width when ``stream`` is a terminal, else :data:`DEFAULT_WIDTH`."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return max(int(columns), MIN_WIDTH)
    stream = sys.stdout if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        tty = False
    if not tty:
        return DEFAULT_WIDTH
    return max(shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns, MIN_WIDTH)


def _pieces(body: str) -> list[tuple[str, str]]:
    """``body`` as (whitespace before, unbreakable piece) pairs."""
    pieces = []
    end = 0
    for match in _ATOM_RE.finditer(body):
        pieces.append((body[end : match.start()], match.group()))
        end = match.end()
    return pieces


def wrap_block(
    text: str, width: int | None, indent: str | None = None, sep: str | None = None, *, head: int = 0
) -> str:
    """``text`` (one logical line) broken into lines of at most ``width`` columns where it can be; continuation
    lines start with ``indent`` (default: the text's own indent plus four spaces).

    With ``sep`` (e.g. two spaces between ``key=value`` pairs) lines break only at runs of ``sep``; an item wider
    than a line by itself is broken at its spaces. A piece wider than the width stays whole on a line of its own.
    A line never starts with ``fix:`` after a break (it would read as a fix line). The first ``head`` characters
    of ``text`` (a finding's ``path: CODE [severity]``) are never broken apart.
    ``width`` None leaves ``text`` as it is.
    """
    if width is None or len(text) <= width and "\n" not in text:
        return text
    if "\n" in text:
        return "\n".join(wrap_block(line, width, indent, sep, head=head) for line in text.split("\n"))
    body = text.lstrip()
    lead = text[: len(text) - len(body)]
    if indent is None:
        indent = lead + "    "
    room = width - len(indent)
    # (whitespace before, piece, whether a line may break before it)
    pieces: list[tuple[str, str, bool]] = []
    if sep is None:
        pieces = [(gap, piece, True) for gap, piece in _pieces(body)]
    else:
        parts = re.split(f"((?:{re.escape(sep)})+)", body)
        gap = ""
        for i, item in enumerate(parts):
            if i % 2:
                gap = item
                continue
            if not item.strip():
                continue
            inner = _pieces(item)
            splittable = len(item) > room  # an item wider than a whole line breaks at its own spaces
            first_gap = gap + inner[0][0] if pieces else inner[0][0]
            pieces.append((first_gap, inner[0][1], True))
            pieces += [(g, p, splittable) for g, p in inner[1:]]
    if head > len(lead):  # the pieces that start within the head join the first one
        end = len(pieces[0][1])
        while len(pieces) > 1 and len(lead) + end + len(pieces[1][0]) < head:
            gap, piece, _ = pieces.pop(1)
            pieces[0] = ("", pieces[0][1] + gap + piece, True)
            end = len(pieces[0][1])
    lines = []
    line = lead
    started = False
    for gap, piece, breakable in pieces:
        if not started:
            line += piece
            started = True
        elif not breakable or piece == "fix:" or len(line) + len(gap) + len(piece) <= width:
            line += gap + piece
        else:
            lines.append(line)
            line = indent + piece
    lines.append(line)
    return "\n".join(lines)


LABEL_HEAD = 17  # a "label           value" line keeps its label with the value's first piece


def wrap_lines(lines: list[str], width: int | None, indent: str | None = None, head: int = LABEL_HEAD) -> list[str]:
    """Each line of ``lines`` through :func:`wrap_block`; an element holding several lines (a table) is left as
    it is."""
    if width is None:
        return lines
    return [line if "\n" in line else wrap_block(line, width, indent, head=head) for line in lines]
