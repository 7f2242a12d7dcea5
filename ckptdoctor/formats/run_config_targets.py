"""The code in a Megatron-Bridge ``run_config.yaml``: every ``_target_`` it holds, judged against an allowlist.

Bridge dumps its ``ConfigContainer`` with ``yaml.safe_dump`` (``to_yaml``: dataclasses as mappings led by
``_target_: <module>.<class>``, functions and dtypes as ``{_target_: <name>, _call_: false}``, partials with
``_partial_: true``, enums with ``_args_: [<value>]``) and reads it back with ``yaml.safe_load``. Its load and
convert paths then hand sections to a Hydra-style ``instantiate`` (``load_model_config`` the ``model`` section,
``load_tokenizer`` the ``tokenizer`` section): ``_target_`` is imported by its dotted name and called with the
sibling keys as arguments (``_partial_: true`` makes a ``functools.partial``, ``_call_: false`` only imports it);
from 0.3 every read of the file also imports each ``_target_``'s module (``apply_run_config_backward_compat``), and
a ``model`` mapping with ``_builder_`` is rebuilt by ``ModelConfig.from_dict`` and its builder class imported.
So ``_target_: os.system`` with an argument runs a command on whoever loads the checkpoint: see
``docs/run_config_targets.md`` for the Bridge files this follows.

:func:`scan_targets` finds every ``_target_`` and ``_builder_`` in the text, at any depth, in block or flow style,
with the ``_call_`` / ``_partial_`` siblings that decide how it is used, and judges each against
:data:`~ckptdoctor.formats.run_config_allowlist.ALLOWLIST` (exact names, each with the uses it may have and why that
use runs nothing the file names). It reads the text with a linear line scanner, never a YAML library: whatever it
cannot attribute with certainty (a tag, an anchor, an alias, a merge key, a complex key, a tab, a multi-line value
of a special key, an OmegaConf interpolation, ``_target_`` inside a string, a second document) is itself a finding.
A text with no findings holds only allowed targets, each found where a YAML loader finds it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Literal

from ckptdoctor.formats.run_config_allowlist import Use, allowed_uses
from ckptdoctor.text_safety import escape

FindingKind = Literal["refused", "unreadable", "duplicate"]

MAX_TEXT_CHARS = 16 << 20  # run_config.py's MAX_RUN_CONFIG_BYTES: the reader refuses a larger file
MAX_LINES = 500_000  # Bridge writes under 2,000: a longer file is refused unread (the scan stays seconds)
MAX_FINDINGS = 1000  # then the scan stops: the file is refused anyway
MAX_TARGETS = 10000  # Bridge writes ~50
MAX_DEPTH = 64  # nested mappings, lists and flow collections together; Bridge writes ~6
MAX_ESCAPES = 200_000  # backslash escapes in double-quoted strings, all together; Bridge writes a few
_SHOWN = 200  # characters of a target or a path kept in a finding
_KEY_SHOWN = 64  # characters of one key in a path

_USE_WORDS: dict[str, str] = {
    "call": "called",
    "partial": "made a functools.partial",
    "reference": "referenced with _call_: false",
    "builder": "named by _builder_",
}


@dataclasses.dataclass(frozen=True)
class TargetUse:
    """A ``_target_`` (or ``_builder_``) found in the text: 1-based line, key path, the name, how it is used."""

    line: int
    path: str
    target: str
    use: Use


@dataclasses.dataclass(frozen=True)
class TargetFinding:
    """Something that makes the file unsafe to hand to Bridge: a refused target or a part that cannot be checked.

    ``target`` is the target's name (refused, duplicate) or the text that could not be read (unreadable); ``use``
    is None where it cannot be told."""

    line: int
    path: str
    target: str | None
    use: Use | None
    kind: FindingKind
    reason: str


@dataclasses.dataclass(frozen=True)
class TargetScan:
    """What :func:`scan_targets` saw. ``truncated``: it stopped early (too many findings or targets, too deep)."""

    targets: tuple[TargetUse, ...]
    findings: tuple[TargetFinding, ...]
    truncated: bool

    @property
    def refused(self) -> bool:
        """True where the file may not be handed to Bridge's instantiate."""
        return bool(self.findings) or self.truncated


# --- messages ---------------------------------------------------------------------------------------------------


def describe(finding: TargetFinding) -> str:
    """One terminal-safe line for ``finding``: where, what, how it is used, why it is refused."""
    where = f"line {finding.line}" + (f", {escape(finding.path)}" if finding.path else "")
    what = ""
    if finding.target is not None:
        what = f" {escape(repr(finding.target))}"
        if finding.use is not None:
            what += f" ({_USE_WORDS[finding.use]})"
    label = {"refused": "refused", "unreadable": "cannot be checked", "duplicate": "duplicated"}[finding.kind]
    return f"run_config.yaml {where}:{what} {label}: {escape(finding.reason)}"


def summarize(scan: TargetScan, limit: int = 5) -> str:
    """A short message for a whole scan: how many targets, how many findings, the first ``limit`` described."""
    if not scan.refused:
        return f"run_config.yaml: {len(scan.targets)} _target_ entries, all on the allowlist"
    lines = [
        f"run_config.yaml: {len(scan.findings)} finding(s) among {len(scan.targets)} _target_ entries"
        + (" (scan stopped early)" if scan.truncated else "")
    ]
    lines += ["  " + describe(finding) for finding in scan.findings[:limit]]
    if len(scan.findings) > limit:
        lines.append(f"  ... and {len(scan.findings) - limit} more")
    return "\n".join(lines)


# --- the scanner --------------------------------------------------------------------------------------------------

_SPECIAL = frozenset({"_target_", "_builder_", "_call_", "_partial_"})
_TRUE = frozenset({"true", "True", "TRUE"})
_FALSE = frozenset({"false", "False", "FALSE"})
# What YAML loaders refuse or read differently: C0/C1 controls but tab, LF and CR (PyYAML refuses them), the YAML
# 1.1 line breaks NEL, LS and PS (text to YAML 1.2), a BOM past the start, surrogates and non-characters.
_BAD_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff\ufffe\uffff]")
_NOT_BLANK = re.compile("[^ \n]")
# Fast paths over runs of plain lines (C speed; each stops at a line it cannot vouch for, the slow path reads it).
_COMMENTS = re.compile(r"(?:[ ]*#[^\n]*\n)+")  # comment-only lines
# The lookaheads sit only on "_" and "$" (unrolled loops: every character matches one way, no backtracking blowup).
_SAFE_MARK = r"(?:_(?!target_|builder_)|\$(?!\{))"  # a "_" or "$" that starts no special name or interpolation


def _safe(chars: str) -> str:
    """Any run of ``chars`` (a class body without "_" and "$") and of safe "_" / "$"."""
    return rf"[{chars}]*(?:{_SAFE_MARK}[{chars}]*)*"


_WORD = rf"(?:[A-Za-z0-9.+/]|{_SAFE_MARK}){_safe('A-Za-z0-9.+/-')}"  # a word: no "-" first, no ': ', no ' #'
_KEY = rf"[A-Za-z0-9]{_safe('A-Za-z0-9.+/-')}"  # a plain key that is not special (nor "<<")
_SINGLE = "'" + _safe("^'\n_$") + "'"  # one line, no doubled quote
_DOUBLE = '"' + _safe('^"\\\\\n_$') + '"'  # one line, no escape
_QUOTED = f"{_SINGLE}|{_DOUBLE}"
_ANY_VALUE = rf"(?:{_WORD}|{_QUOTED})"
_ITEM, _ENTRY = rf"[ ]*{_ANY_VALUE}[ ]*,", rf"[ ]*{_KEY}: [ ]*{_ANY_VALUE}[ ]*,"
_FLOW_RUNS = (re.compile(rf"(?:{_ITEM})+"), re.compile(rf"(?:{_ENTRY})+"))  # within a line
_FLOW_LINES = (re.compile(rf"(?:{_ITEM}\n?)+"), re.compile(rf"(?:{_ENTRY}\n?)+"))  # over lines
# A line going on with a plain value: no tab, no ': ', no ' #', not ending in ':', not a comment.
_BLOCK_TEXT = _safe("^\n_$")
_MORE_TAIL = r"[^\n\t:# _$]*(?:(?: (?!#)|:(?! )|#|" + _SAFE_MARK + r")[^\n\t:# _$]*)*(?<!:)\n"
_SQ_BODY = re.compile(r"[^']*(?:''[^']*)*")  # a single-quoted string's text up to its quote
_DQ_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*')  # a double-quoted string's text up to its quote
_FLOW_STOP = re.compile(r"[,\[\]{}:#]")
_NEVER_PLAIN = frozenset("{[&*!|>%@`,]}#'\"")  # a plain scalar cannot start with these
_ESCAPES = {
    "0": "\0",
    "a": "\a",
    "b": "\b",
    "t": "\t",
    "\t": "\t",
    "n": "\n",
    "v": "\v",
    "f": "\f",
    "r": "\r",
    "e": "\x1b",
    " ": " ",
    '"': '"',
    "/": "/",
    "\\": "\\",
    "N": "\x85",
    "_": "\xa0",
    "L": "\u2028",
    "P": "\u2029",
}
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_OPEN, _ESCAPED_BREAK = -1, -2  # quoted_scan's end when the string goes on over the line break


class _Stop(Exception):
    """The scan ends early: too many findings or targets, or structure it can no longer follow."""


def _show(text: str, limit: int = _SHOWN) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _join(path: str, key: str) -> str:
    key = _show(key, _KEY_SHOWN)
    return f"{path}.{key}" if path else key


def _comment_at(text: str) -> int:
    """Where a comment starts in ``text`` read as plain (a ``#`` first or after a space); len(text) where none."""
    if text.startswith("#"):
        return 0
    index = text.find(" #")
    return len(text) if index < 0 else index


def _indicator(text: str, chars: str) -> bool:
    """``text`` starts with one of ``chars`` used as an indicator (followed by a space or the end)."""
    return bool(text) and text[0] in chars and (len(text) == 1 or text[1] == " ")


def _is_dash(text: str) -> bool:
    return _indicator(text, "-")


@dataclasses.dataclass
class _Value:
    """A value as far as judging needs it: one line of text (decoded), or what it is instead."""

    kind: Literal["scalar", "multiline", "node", "null", "bad"]
    text: str = ""
    quoted: bool = False


@dataclasses.dataclass
class _Collector:
    """One mapping (block or flow): its special keys, judged when the mapping ends."""

    path: str
    entries: dict[str, list[tuple[int, _Value]]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Slot:
    """Where a value goes: ``key`` of ``collector``, or (no collector) the list item at ``path``."""

    path: str
    line: int
    collector: _Collector | None = None
    key: str = ""


@dataclasses.dataclass
class _Frame:
    """An open block mapping or list: its indentation, and a key or an item still waiting for its value."""

    kind: Literal["map", "seq"]
    indent: int
    path: str
    collector: _Collector | None = None
    pending: _Slot | None = None
    count: int = 0


@dataclasses.dataclass
class _Plain:
    """A plain value that may go on over lines indented deeper than ``indent``."""

    indent: int
    slot: _Slot


@dataclasses.dataclass
class _Quoted:
    """A quoted value going on over lines."""

    double: bool
    slot: _Slot
    pieces: list[str]
    joined: bool  # the line ended in an escaped line break
    reported: bool = False


@dataclasses.dataclass
class _Block:
    """A ``|`` / ``>`` block scalar: every line indented past ``parent`` (or empty) is its text."""

    parent: int
    explicit: int
    slot: _Slot
    content: int | None = None


@dataclasses.dataclass
class _FlowNode:
    """One open ``{...}`` or ``[...]``; ``pair``: a list entry that became a one-pair mapping (``[k: v]``)."""

    kind: Literal["map", "seq"]
    path: str
    collector: _Collector | None
    state: Literal["key", "colon", "value", "after"] = "key"
    key: _Value | None = None
    key_line: int = 0
    value: _Value | None = None
    pair: bool = False
    count: int = 0


@dataclasses.dataclass
class _Flow:
    """Open flow collections, innermost last (they may go on over lines)."""

    stack: list[_FlowNode]


# Lines inside a quoted string that do not close it (escapes, escaped line breaks and doubled quotes included).
_DQ_LINES = re.compile(r'(?:(?!---|\.\.\.)[^"\\\n]*(?:\\[^\n][^"\\\n]*)*(?:\\)?\n)+')
_SQ_LINES = re.compile(r"(?:(?!---|\.\.\.)[^'\n]*(?:''[^'\n]*)*\n)+")


@functools.lru_cache(maxsize=256)
def _runs(kind: str, indent: int) -> re.Pattern[str]:
    """Runs of lines the scanner passes at C speed, at ``indent``: plain ``key: word`` entries of a mapping,
    plain ``- word`` items of a list, lines going on with a plain value, lines of a block scalar."""
    margin = f"[ ]{{{indent}}}"  # a count, not the spaces: an indentation can be megabytes
    if kind == "map":
        line = rf"{margin}{_KEY}: {_ANY_VALUE}\n"
    elif kind == "seq":
        line = rf"{margin}- {_ANY_VALUE}\n"
    elif kind == "more":
        line = rf"{margin} *(?:[^ \n\t#:_$]|:(?! )|{_SAFE_MARK}){_MORE_TAIL}"
    else:
        line = rf"[ ]*\n|{margin}{_BLOCK_TEXT}\n"
    return re.compile(rf"(?:{line})+")


class _Scanner:
    def __init__(self) -> None:
        self.findings: list[TargetFinding] = []
        self.targets: list[TargetUse] = []
        self.truncated = False
        self.frames: list[_Frame] = []
        self.mode: _Plain | _Quoted | _Block | _Flow | None = None
        self.lineno = 0
        self.started = False  # content seen: a "---" is only allowed before it
        self.escapes = 0
        self.root_done = False

    # -- findings

    def finding(
        self,
        kind: FindingKind,
        reason: str,
        path: str = "",
        target: str | None = None,
        use: Use | None = None,
        line: int | None = None,
    ) -> None:
        shown = None if target is None else _show(target.strip())
        self.findings.append(TargetFinding(line or self.lineno, _show(path), shown, use, kind, reason))
        if len(self.findings) >= MAX_FINDINGS:
            self.truncated = True
            raise _Stop

    def unreadable(self, reason: str, text: str | None = None, path: str = "") -> None:
        self.finding("unreadable", reason, path, text)

    def fatal(self, reason: str, text: str | None = None, path: str = "") -> None:
        self.unreadable(reason + "; the rest of the file is not read", text, path)
        raise _Stop

    def check_string(self, text: str, path: str) -> bool:
        """A string value: text to a YAML loader, but a target named in it, or an interpolation, may not stay text."""
        if "${" in text:
            self.unreadable(
                "an OmegaConf interpolation: instantiate resolves it (${oc.decode:...} parses YAML) before it "
                "reads _target_, so what it becomes cannot be checked here",
                text,
                path,
            )
            return True
        for name in ("_target_", "_builder_"):
            if name in text:
                self.unreadable(
                    f"a string value holds {name}: text to a YAML loader, refused as a string parsed again "
                    "(an OmegaConf resolver, a JSON or YAML field) becomes a target",
                    text,
                    path,
                )
                return True
        return False

    # -- lines

    def run(self, text: str) -> None:
        self.lineno = 1
        if len(text) > MAX_TEXT_CHARS:
            self.fatal(f"longer than {MAX_TEXT_CHARS} characters")
        if text.count("\n") + text.count("\r") >= MAX_LINES:
            self.truncated = True
            self.fatal(f"more than {MAX_LINES} lines, where Bridge writes a few thousand")
        self.lineno = 0
        if text.startswith("\ufeff"):
            text = text[1:]
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        self.bad_characters(text)
        pos, end = 0, len(text)
        while pos < end:
            skipped = self.fast(text, pos)
            if skipped > pos:
                self.lineno += text.count("\n", pos, skipped)
                pos = skipped
                continue
            newline = text.find("\n", pos)
            if newline < 0:
                newline = end
            self.lineno += 1
            self.line(text[pos:newline])
            pos = newline + 1
        self.lineno = text.count("\n") + 1
        self.finish()

    def bad_characters(self, text: str) -> None:
        """Characters YAML loaders refuse or read as line breaks, anywhere (comments included): one finding a line."""
        line, counted, last = 1, 0, 0
        for match in _BAD_CHARS.finditer(text):
            line += text.count("\n", counted, match.start())
            counted = match.start()
            if line != last:
                last = line
                self.finding(
                    "unreadable",
                    f"character U+{ord(match.group()):04X}: a control character, a Unicode line or paragraph "
                    "separator or a BOM, that YAML loaders refuse or read as a line break",
                    line=line,
                )

    def fast(self, text: str, pos: int) -> int:
        """Past the run of lines from ``pos`` that need no reading one by one (``pos`` where there is none)."""
        mode = self.mode
        if mode is None or isinstance(mode, (_Plain, _Flow)):
            match = _NOT_BLANK.search(text, pos)
            if match is None:
                return len(text)
            start = text.rfind("\n", pos, match.start()) + 1
            if start > pos:
                return start  # blank lines
            if text[match.start()] == "#":
                comments = _COMMENTS.match(text, pos)
                if comments is not None:
                    if isinstance(mode, _Plain):
                        self.mode = None  # a comment ends a plain value
                    return comments.end()
        if isinstance(mode, _Plain) and mode.indent >= 0 and mode.slot.key not in _SPECIAL:
            match = _runs("more", mode.indent + 1).match(text, pos)
            if match is not None:
                return match.end()
        if isinstance(mode, _Flow):
            return self.flow_items(mode.stack[-1], text, pos, _FLOW_LINES)
        if (mode is None or isinstance(mode, _Plain)) and self.frames:
            top = self.frames[-1]
            if mode is not None and mode.indent != top.indent:
                return pos
            match = _runs(top.kind, top.indent).match(text, pos)
            if match is None:
                return pos
            self.resolve_pending(top)
            lines = text.count("\n", pos, match.end())
            last = text[max(pos, text.rfind("\n", pos, match.end() - 1) + 1) : match.end() - 1].lstrip(" ")
            if top.kind == "map":
                slot = _Slot(_join(top.path, last.split(":", 1)[0]), self.lineno + lines)
            else:
                top.count += lines
                slot = _Slot(f"{top.path}[{top.count - 1}]", self.lineno + lines)
            self.started = True
            self.mode = None if last.endswith(("'", '"')) else _Plain(top.indent, slot)  # quoted: nothing goes on
            return match.end()
        if isinstance(mode, _Block) and mode.content is not None:
            match = _runs("block", mode.content).match(text, pos)
            return pos if match is None else match.end()
        if isinstance(mode, _Quoted):
            match = (_DQ_LINES if mode.double else _SQ_LINES).match(text, pos)
            if match is None:
                return pos
            span = text[pos : match.end() - 1]
            joined, mode.joined = mode.joined, False
            if joined:
                span = span.lstrip(" \t")
            elif mode.pieces:
                mode.pieces[-1] = mode.pieces[-1].rstrip(" \t")
            if mode.double:
                trailing = len(span) - len(span.rstrip("\\"))
                mode.joined = trailing % 2 == 1  # the run's last line ends in an escaped line break
                span = self.unescape(span[:-1] if mode.joined else span, self.lineno + 1)
            else:
                span = span.replace("''", "'")
            mode.pieces.append(span if joined else " " + span)
            return match.end()
        return pos

    def flow_items(self, node: _FlowNode, text: str, pos: int, runs: tuple[re.Pattern[str], re.Pattern[str]]) -> int:
        """Past a run of plain ``word,`` items (a list) or ``word: word,`` entries (a mapping) of ``node``."""
        if node.state != "key":
            return pos
        match = runs[node.kind == "map"].match(text, pos)
        if match is None:
            return pos
        if node.kind == "seq":
            node.count += text.count(",", pos, match.end())
        return match.end()

    def line(self, raw: str) -> None:
        mode = self.mode
        if isinstance(mode, _Block) and self.block_line(mode, raw):
            return
        marker = raw.startswith(("---", "...")) and (len(raw) == 3 or raw[3] in " \t")
        if marker and raw.startswith("---") and not self.started and not raw[3:].strip(" \t"):
            return
        if marker:
            self.fatal("a YAML document marker: a second document, or a document with properties", raw)
        if isinstance(mode, _Quoted):
            self.quoted_line(mode, raw)
            return
        stripped = raw.lstrip(" \t")
        if not stripped:
            return
        if "\t" in raw and not stripped.startswith("#"):  # a tab in a comment is nothing
            self.unreadable("a tab outside a multi-line string or a comment: YAML loaders disagree on tabs", raw)
        if isinstance(mode, _Flow):
            self.flow_text(mode, raw, 0)
            return
        indent = len(raw) - len(stripped)
        if stripped.startswith("#"):
            if isinstance(mode, _Plain):
                self.mode = None  # a comment ends a plain value
            return
        if isinstance(mode, _Plain):
            if indent > mode.indent:
                self.plain_more(mode, stripped)
                return
            self.mode = None
        if indent == 0 and stripped.startswith("%"):
            self.fatal("a YAML directive (%YAML, %TAG): it changes how the document is read", raw)
        self.started = True
        self.content(indent, stripped)

    def content(self, indent: int, text: str) -> None:
        """A line of block structure at column ``indent``."""
        while self.frames:
            top = self.frames[-1]
            if indent < top.indent or (indent == top.indent and top.kind == "seq" and not _is_dash(text)):
                self.close_frame()
            else:
                break
        if not self.frames:
            if self.root_done:
                self.unreadable("text after the end of the document's top-level node", text)
                self.check_string(text, "")
                return
            self.root_done = True
            self.node(-1, _Slot("", self.lineno), indent, text)
            return
        top = self.frames[-1]
        if indent > top.indent or (top.kind == "map" and top.pending is not None and _is_dash(text)):
            slot = top.pending  # a value on lines of its own, or "key:" then "- item" at the key's column
            if slot is None:
                self.unreadable("a line indented deeper than its mapping or list that belongs to nothing", text)
                self.check_string(text, top.path)
                return
            top.pending = None
            self.node(top.indent, slot, indent, text)
        elif top.kind == "map":
            self.resolve_pending(top)
            self.map_entry(top, indent, text)
        else:
            self.resolve_pending(top)
            self.seq_item(top, indent, text)

    def node(self, owner: int, slot: _Slot, indent: int, text: str) -> None:
        """A node that starts a line: a block list, a block mapping or a value (``owner``: its parent's column)."""
        if _is_dash(text):
            self.record(slot, _Value("node"))
            self.seq_item(self.push(_Frame("seq", indent, slot.path)), indent, text)
        elif (split := self.split_key(text)) is not None:
            self.record(slot, _Value("node"))
            self.map_entry(self.push(_Frame("map", indent, slot.path, _Collector(slot.path))), indent, text, split)
        else:
            self.value(owner, slot, text)

    def push(self, frame: _Frame) -> _Frame:
        if len(self.frames) >= MAX_DEPTH:
            self.truncated = True
            self.fatal(f"nested deeper than {MAX_DEPTH} levels", path=frame.path)
        self.frames.append(frame)
        return frame

    def close_frame(self) -> None:
        frame = self.frames.pop()
        self.resolve_pending(frame)
        if frame.collector is not None:
            self.judge(frame.collector)

    def resolve_pending(self, frame: _Frame) -> None:
        if frame.pending is not None:
            self.record(frame.pending, _Value("null"))
            frame.pending = None

    def map_entry(self, frame: _Frame, indent: int, text: str, split: tuple[str, str] | None = None) -> None:
        if split is None:
            split = self.split_key(text)
        if split is None:
            if text[0] in "\"'" and self.quoted_once(text) is None:
                self.fatal("a quoted string going on over lines where a mapping key is expected", text, frame.path)
            reason = "a line in a mapping that is not 'key: value'"
            if _indicator(text, "?"):
                reason = "a complex key ('? key'): the key can be anything"
            elif text[0] in "&*!":
                reason = "a key with an anchor, an alias or a tag"
            elif text[0] in "[{":
                reason = "a flow collection as a mapping key"
            self.unreadable(reason, text, frame.path)
            self.check_string(text, frame.path)
            return
        key, rest = split
        slot = _Slot(_join(frame.path, key), self.lineno, frame.collector, key)
        if key == "<<":
            self.unreadable("a merge key ('<<'): it copies another mapping's keys, _target_ included", text, slot.path)
        if not rest or rest.startswith("#"):
            frame.pending = slot
        else:
            self.value(frame.indent, slot, rest)

    def seq_item(self, frame: _Frame, indent: int, text: str) -> None:
        while True:  # "- - x": a list in a list, on one line
            slot = _Slot(f"{frame.path}[{frame.count}]", self.lineno)
            frame.count += 1
            rest = text[1:].lstrip(" ")
            column = indent + len(text) - len(rest)
            if not rest or rest.startswith("#"):
                frame.pending = slot
                return
            if _is_dash(rest):
                frame = self.push(_Frame("seq", column, slot.path))
                indent, text = column, rest
                continue
            split = self.split_key(rest)
            if split is not None:  # "- key: value" opens a mapping at the key's column
                frame = self.push(_Frame("map", column, slot.path, _Collector(slot.path)))
                self.map_entry(frame, column, rest, split)
            else:
                self.value(frame.indent, slot, rest)
            return

    def value(self, owner: int, slot: _Slot, text: str) -> None:
        """A value that is not a block collection, at the start of ``text``."""
        first = text[0]
        if first in "{[":
            self.record(slot, _Value("node"))
            flow = _Flow([])
            self.mode = flow
            self.open_flow(flow, first, slot.path)
            self.flow_text(flow, text, 1)
        elif first in "\"'":
            pieces: list[str] = []
            end = self.quoted_scan(text, 1, first == '"', pieces)
            if end < 0:
                self.mode = _Quoted(first == '"', slot, pieces, end == _ESCAPED_BREAK)
                return
            decoded = "".join(pieces)
            rest = text[end:].lstrip(" ")
            if rest and not rest.startswith("#"):
                self.unreadable("text after a quoted string", text, slot.path)
            self.record(slot, _Value("scalar", decoded, quoted=True))
            self.check_string(decoded, slot.path)
        elif first in "|>":
            self.block_start(owner, slot, text)
        elif first in "&*!":
            self.unreadable("an anchor, an alias or a tag: it can copy or retype a value", text, slot.path)
            self.record(slot, _Value("bad", text))
        elif _indicator(text, "?"):
            self.unreadable("a complex key ('? key'): the key can be anything", text, slot.path)
            self.record(slot, _Value("bad", text))
        elif first in _NEVER_PLAIN or _indicator(text, "-:"):
            self.unreadable("a value that is no YAML node here", text, slot.path)
            self.record(slot, _Value("bad", text))
        else:
            cut = _comment_at(text)
            body = text[:cut].rstrip(" \t")
            if ": " in body or ":\t" in body or body.endswith(":"):
                self.unreadable("': ' inside a plain value (a second key on one line)", text, slot.path)
            self.record(slot, _Value("scalar", body))
            self.check_string(body, slot.path)
            if cut == len(text):
                self.mode = _Plain(owner, slot)

    def plain_more(self, mode: _Plain, text: str) -> None:
        """A deeper line going on with a plain value (folded into it by a YAML loader)."""
        cut = _comment_at(text)
        body = text[:cut].rstrip(" \t")
        self.record(mode.slot, _Value("multiline", body), replace=True)
        if ": " in body or ":\t" in body or body.endswith(":"):
            self.unreadable("': ' in a plain value going on over lines (a key where none may be)", text, mode.slot.path)
        self.check_string(body, mode.slot.path)
        if cut < len(text):
            self.mode = None

    def record(self, slot: _Slot, value: _Value, replace: bool = False) -> None:
        collector = slot.collector
        if collector is None or slot.key not in _SPECIAL:
            return
        entries = collector.entries.get(slot.key)
        if replace and entries:
            entries[-1] = (entries[-1][0], value)
        else:
            self.add_entry(collector, slot.key, slot.line, value)

    def add_entry(self, collector: _Collector, key: str, line: int, value: _Value) -> None:
        """A special key of a mapping; a second one is a finding at once (a file of them stops the scan early)."""
        if key not in _SPECIAL:
            return
        entries = collector.entries.setdefault(key, [])
        entries.append((line, value))
        if len(entries) > 1:
            self.finding(
                "duplicate",
                f"a second {key} key in one mapping: YAML loaders keep the last, another reader may not",
                _join(collector.path, key),
                value.text if value.kind == "scalar" else None,
                line=line,
            )

    # -- keys and quoted strings

    def split_key(self, text: str) -> tuple[str, str] | None:
        """``(key, rest)`` where ``text`` is ``key: rest`` in block style (the key decoded); else None."""
        if text[0] in "\"'":
            once = self.quoted_once(text)
            if once is None:
                return None
            key, end = once
            rest = text[end:].lstrip(" ")
            if _indicator(rest, ":") or rest.startswith(":\t"):
                return key, rest[1:].lstrip(" \t")
            return None
        if text[0] in _NEVER_PLAIN or _indicator(text, "-?:"):
            return None
        body = text[: _comment_at(text)]
        colon = body.find(": ")
        tab = body.find(":\t")
        if tab >= 0 and (colon < 0 or tab < colon):
            colon = tab
        if colon < 0:
            trimmed = body.rstrip(" \t")
            if not trimmed.endswith(":"):
                return None
            colon = len(trimmed) - 1
        key = body[:colon].rstrip(" \t")
        if not key:
            return None
        return key, text[colon + 1 :].lstrip(" \t")

    def quoted_once(self, text: str) -> tuple[str, int] | None:
        """A quoted scalar closed on this line: (decoded, index past it); None where it goes on."""
        pieces: list[str] = []
        end = self.quoted_scan(text, 1, text[0] == '"', pieces)
        return None if end < 0 else ("".join(pieces), end)

    def quoted_scan(self, text: str, pos: int, double: bool, pieces: list[str]) -> int:
        """Decode a quoted scalar from ``pos`` into ``pieces``: the index past its closing quote, or _OPEN /
        _ESCAPED_BREAK where it goes on over the line break."""
        if not double:
            quoted = _SQ_BODY.match(text, pos)
            assert quoted is not None  # it matches the empty string
            after = quoted.end()
            pieces.append(text[pos:after].replace("''", "'"))
            return after + 1 if after < len(text) else _OPEN
        body = _DQ_BODY.match(text, pos)
        assert body is not None  # it matches the empty string
        after = body.end()
        pieces.append(self.unescape(text[pos:after]) if text.find("\\", pos, after) >= 0 else text[pos:after])
        if after == len(text):
            return _OPEN
        return after + 1 if text[after] == '"' else _ESCAPED_BREAK  # else a backslash ends the line

    def unescape(self, body: str, first_line: int | None = None) -> str:
        """A double-quoted string's text with YAML's escapes decoded (unknown ones are findings, on their line
        where ``body`` spans lines from ``first_line``)."""
        parts = body.split("\\")
        self.escapes += len(parts) - 1
        if self.escapes > MAX_ESCAPES:
            self.truncated = True
            self.fatal(f"more than {MAX_ESCAPES} escapes in double-quoted strings, where Bridge writes a few")
        out = [parts[0]]
        index, offset = 1, len(parts[0])  # offset: where the backslash before parts[index] is in body
        line, counted = first_line or self.lineno, 0
        while index < len(parts):
            part, at = parts[index], offset
            index += 1
            offset += 1 + len(part)
            if not part:  # an escaped backslash: the text after the pair is plain text
                out.append("\\")
                if index < len(parts):
                    out.append(parts[index])
                    offset += 1 + len(parts[index])
                    index += 1
                continue
            code = part[0]
            if code == "\n":  # an escaped line break: the next line's leading blanks go
                out.append(part[1:].lstrip(" \t"))
                continue
            if code in _ESCAPES:
                out += (_ESCAPES[code], part[1:])
                continue
            width = _HEX_WIDTH.get(code, 0)
            digits = part[1 : 1 + width]
            line += body.count("\n", counted, at)
            counted = at
            if width and len(digits) == width and _HEX_DIGITS.issuperset(digits):
                number = int(digits, 16)
                if number > 0x10FFFF or 0xD800 <= number <= 0xDFFF:
                    self.finding(
                        "unreadable", "an escape that is no Unicode character", "", "\\" + part[: 1 + width], line=line
                    )
                    number = 0xFFFD
                out += (chr(number), part[1 + width :])
                continue
            self.finding("unreadable", "an unknown escape in a double-quoted string", "", "\\" + part[:1], line=line)
            out.append(part)
        return "".join(out)

    def quoted_line(self, mode: _Quoted, raw: str) -> None:
        pieces = mode.pieces
        text = raw.lstrip(" \t")
        if not mode.joined:
            if pieces:
                pieces[-1] = pieces[-1].rstrip(" \t")
            pieces.append(" ")  # a line break folds into a space
        end = self.quoted_scan(text, 0, mode.double, pieces)
        if end < 0:
            mode.joined = end == _ESCAPED_BREAK
            if len(pieces) > 4096:  # bounded: check what is there, keep a tail a name could go on from
                joined = "".join(pieces)
                mode.reported = mode.reported or self.check_string(joined, mode.slot.path)
                pieces[:] = [joined[-16:]]
            return
        self.mode = None
        decoded = "".join(pieces)
        rest = text[end:].lstrip(" ")
        if _indicator(rest, ":"):
            self.unreadable("a quoted key going on over lines", raw, mode.slot.path)
        elif rest and not rest.startswith("#"):
            self.unreadable("text after a quoted string", raw, mode.slot.path)
        self.record(mode.slot, _Value("multiline", decoded))
        if not mode.reported:
            self.check_string(decoded, mode.slot.path)

    # -- block scalars

    def block_start(self, owner: int, slot: _Slot, text: str) -> None:
        header = text[1 : _comment_at(text)].rstrip(" \t")
        explicit = 0
        good = len(header) <= 2
        for char in header:
            if char in "123456789" and not explicit:
                explicit = int(char)
            elif char not in "+-":
                good = False
        if not good:
            self.unreadable("a block scalar header that is not |, >, a chomping sign and a digit", text, slot.path)
        self.record(slot, _Value("multiline"))
        self.mode = _Block(max(owner, 0), explicit, slot)

    def block_line(self, mode: _Block, raw: str) -> bool:
        """True where ``raw`` is text of the block scalar; False where the scalar ended before it."""
        stripped = raw.lstrip(" ")
        if not stripped.strip(" \t"):
            return True
        indent = len(raw) - len(stripped)
        if mode.content is None:
            if mode.explicit:
                mode.content = mode.parent + mode.explicit
            elif indent > mode.parent:
                mode.content = indent
        if mode.content is not None and indent >= mode.content:
            self.check_string(raw[mode.content :], mode.slot.path)
            return True
        self.mode = None
        return False

    # -- flow collections

    def open_flow(self, flow: _Flow, bracket: str, path: str) -> None:
        if len(self.frames) + len(flow.stack) >= MAX_DEPTH:
            self.truncated = True
            self.fatal(f"nested deeper than {MAX_DEPTH} levels", path=path)
        if bracket == "{":
            flow.stack.append(_FlowNode("map", path, _Collector(path)))
        else:
            flow.stack.append(_FlowNode("seq", path, None))

    def flow_text(self, flow: _Flow, text: str, pos: int) -> None:
        """Read ``text`` from ``pos`` inside open flow collections; the mode ends with the outermost one."""
        end = len(text)
        while pos < end:
            char = text[pos]
            if char in " \t":
                pos += 1
                continue
            if char == "#" and (pos == 0 or text[pos - 1] in " \t"):
                return
            node = flow.stack[-1]
            if node.state == "key" and char not in "}]":
                skipped = self.flow_items(node, text, pos, _FLOW_RUNS)
                if skipped > pos:
                    pos = skipped
                    continue
            if char in "}]":
                if (char == "}") != (node.kind == "map"):
                    self.fatal("a flow collection closed by the other bracket", text, node.path)
                self.flow_entry_end(node)
                flow.stack.pop()
                if node.collector is not None:
                    self.judge(node.collector)
                pos += 1
                if not flow.stack:
                    self.mode = None
                    rest = text[pos:].lstrip(" \t")
                    if rest and not rest.startswith("#"):
                        self.fatal("text after a flow collection (a complex key, or a second value)", text, node.path)
                    return
            elif char == ",":
                self.flow_entry_end(node)
                pos += 1
            elif char == ":" and node.state == "colon":
                node.state = "value"
                node.pair = node.kind == "seq"
                pos += 1
            elif char in "{[":
                if node.state != "value" and not (node.kind == "seq" and node.state == "key"):
                    self.fatal("a flow collection as a key, or where ',' is expected", text, node.path)
                path = self.flow_path(node)
                node.value, node.state = _Value("node"), "after"
                self.open_flow(flow, char, path)
                pos += 1
            elif char in "\"'":
                pieces: list[str] = []
                after = self.quoted_scan(text, pos + 1, char == '"', pieces)
                if after < 0:
                    self.fatal("a quoted string going on over lines inside a flow collection", text, node.path)
                pos = after
                self.flow_scalar(node, _Value("scalar", "".join(pieces), quoted=True), text)
            elif char in "&*!|>%@`:?" or (char == "-" and (pos + 1 == end or text[pos + 1] == " ")):
                self.fatal("an anchor, alias, tag or indicator in a flow collection", text, node.path)
            else:
                stop = self.flow_plain_end(text, pos)
                plain = text[pos:stop].rstrip(" \t")
                if "?" in plain or ":" in plain:
                    self.fatal("'?' or ':' inside a plain scalar in a flow collection (loaders disagree)", text)
                pos = stop
                self.flow_scalar(node, _Value("scalar", plain), text)

    @staticmethod
    def flow_plain_end(text: str, pos: int) -> int:
        """Where a plain scalar in a flow collection ends: a flow indicator, ': ', ':' before one, or ' #'."""
        end = len(text)
        while True:
            match = _FLOW_STOP.search(text, pos)
            if match is None:
                return end
            stop = match.start()
            char = text[stop]
            if char == ":":
                if stop + 1 == end or text[stop + 1] in " \t,[]{}":
                    return stop
            elif char == "#":
                if text[stop - 1] in " \t":
                    return stop
            else:
                return stop
            pos = stop + 1

    def flow_path(self, node: _FlowNode) -> str:
        """The path of the value being read in ``node``."""
        if node.kind == "seq":
            item = f"{node.path}[{node.count}]"
            return _join(item, node.key.text) if node.pair and node.key is not None else item
        return _join(node.path, node.key.text if node.key is not None else "")

    def flow_scalar(self, node: _FlowNode, value: _Value, line: str) -> None:
        if node.state == "key":
            node.key, node.key_line, node.state = value, self.lineno, "colon"
        elif node.state == "value":
            node.value, node.state = value, "after"
            self.check_string(value.text, self.flow_path(node))
        else:
            self.fatal("a scalar where ',' or the end is expected (a plain scalar over lines?)", line, node.path)

    def flow_entry_end(self, node: _FlowNode) -> None:
        """One entry of ``node`` is complete (at ',' or its closing bracket)."""
        key = node.key
        if node.kind == "map" or node.pair:
            value = node.value or _Value("null")
            if key is None:
                if node.state == "value":
                    self.fatal("a flow mapping entry with no key", None, node.path)
            else:
                path = _join(f"{node.path}[{node.count}]", key.text) if node.pair else _join(node.path, key.text)
                if key.text == "<<":
                    self.unreadable("a merge key ('<<'): it copies another mapping's keys", key.text, path)
                collector = node.collector
                if node.pair:
                    collector = _Collector(f"{node.path}[{node.count}]")
                assert collector is not None
                self.add_entry(collector, key.text, node.key_line, value)
                if node.pair:
                    self.judge(collector)
        elif key is not None:  # a list item read as a would-be key: a plain or quoted scalar
            self.check_string(key.text, f"{node.path}[{node.count}]")
        if node.kind == "seq" and node.state != "key":
            node.count += 1
        node.state, node.key, node.value, node.pair = "key", None, None, False

    # -- judging a mapping

    def judge(self, collector: _Collector) -> None:
        entries = collector.entries
        targets = entries.get("_target_", [])
        builders = entries.get("_builder_", [])
        if not targets and not builders:
            return
        use = self.use_of(collector)
        for line, value in targets:
            self.judge_one(line, _join(collector.path, "_target_"), value, use)
        for line, value in builders:
            self.judge_one(line, _join(collector.path, "_builder_"), value, "builder")

    def use_of(self, collector: _Collector) -> Use:
        """How Bridge's instantiate uses the mapping's target: ``_call_: false`` first, then ``_partial_: true``."""
        call = self.flag(collector, "_call_")
        if call is False:
            return "reference"
        return "partial" if self.flag(collector, "_partial_") is True else "call"

    def flag(self, collector: _Collector, name: str) -> bool | None:
        """The last ``name`` of the mapping as a plain true or false; None where absent or anything else."""
        found = collector.entries.get(name)
        if not found:
            return None
        line, value = found[-1]
        text = value.text if value.kind == "scalar" and not value.quoted else None
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        self.finding(
            "unreadable",
            f"{name} is not a plain true or false (a string, a number, or yes/no/on/off that YAML 1.1 and 1.2 "
            "read differently): judged as called",
            _join(collector.path, name),
            value.text if value.kind == "scalar" else None,
            line=line,
        )
        return None

    def judge_one(self, line: int, path: str, value: _Value, use: Use) -> None:
        if value.kind != "scalar":
            what = {"multiline": "a string over lines", "node": "a mapping or a list", "null": "empty"}
            self.finding(
                "unreadable",
                f"its value is {what.get(value.kind, 'unreadable')}, not a name on one line",
                path,
                value.text or None,
                use,
                line,
            )
            return
        target = value.text
        if len(self.targets) >= MAX_TARGETS:
            self.truncated = True
            self.fatal(f"more than {MAX_TARGETS} targets", path=path)
        self.targets.append(TargetUse(line, _show(path), _show(target), use))
        uses = allowed_uses(target)
        if use in uses:
            return
        if uses:
            reason = "on the allowlist only " + " or ".join(_USE_WORDS[u] for u in sorted(uses))
        else:
            reason = "not on the allowlist of Megatron-Bridge config targets"
        self.finding("refused", reason, path, target, use, line)

    # -- the end

    def finish(self) -> None:
        mode, self.mode = self.mode, None
        if isinstance(mode, _Quoted):
            self.unreadable("a quoted string never closed", None, mode.slot.path)
        elif isinstance(mode, _Flow):
            self.unreadable("a flow collection never closed", None, mode.stack[0].path)
            while mode.stack:
                node = mode.stack.pop()
                if node.collector is not None:
                    self.judge(node.collector)
        while self.frames:
            self.close_frame()


def scan_targets(text: str) -> TargetScan:
    """Every ``_target_`` / ``_builder_`` in a ``run_config.yaml`` text, judged; and what could not be checked.

    Linear in the text (at most :data:`MAX_TEXT_CHARS` characters), no YAML library, no recursion; it stops at
    :data:`MAX_FINDINGS` findings or :data:`MAX_DEPTH` levels (``truncated``)."""
    scanner = _Scanner()
    try:
        scanner.run(text)
    except _Stop:
        pass
    targets = sorted(scanner.targets, key=lambda target: target.line)
    findings = sorted(scanner.findings, key=lambda finding: finding.line)  # stable: a line's findings keep order
    return TargetScan(tuple(targets), tuple(findings), scanner.truncated)
