"""Text output wrapped to the width (issue #35 item 10): each command over the real fixtures fits 100 columns off a
terminal (a single unbreakable piece aside), COLUMNS narrows it, and the words are those of the unwrapped text in
the same order; commands, paths, tables and JSON are never broken."""

from __future__ import annotations

import io
import json
import os
import re
import shutil

import pytest
from conftest import FIXTURES, REPO, run_main

from ckptdoctor.render import wrap
from ckptdoctor.render.wrap import DEFAULT_WIDTH, output_width, wrap_block

UNWRAPPED = "100000"  # a COLUMNS no line reaches: the text as it was before wrapping

# command line (relative paths, run from the repository root), whether a fixture line is wider than 60 columns
# and breakable (so COLUMNS=60 must add lines)
CASES = {
    "inspect": (["inspect", "fixtures/core019_moe_ep2"], True),
    "check": (["check", "--isolated", "fixtures/core016_convert_tp4"], True),
    "can-load": (["can-load", "fixtures/core019_tp2_dp2", "--target", "tp=2,pp=2"], True),
    "can-load --suggest": (["can-load", "fixtures/core019_moe_ep2", "--suggest"], True),
    "fix-args": (["fix-args", "fixtures/core016_convert_tp4"], True),
    "repair": (["repair", "fixtures/core016_convert_tp4"], True),
    "diff": (["diff", "fixtures/core016_convert_src_tp1", "fixtures/core016_convert_tp4"], True),
    "show": (["show", "fixtures/core019_tp1", "embedding.word_embeddings.weight", "--no-stats"], False),
    "strip-frozen": (["strip-frozen", "fixtures/core016_peft_full_tp1", "--dry-run"], True),
    "edit": (["edit", "fixtures/core014_tp1", "--drop-section", "optimizer", "--dry-run"], True),
    "verify-export": (["verify-export", "fixtures/core019_tp1", "fixtures/hf/core019_tied_pp2"], True),
}


def _run(capsys, monkeypatch, args, columns=None, stream="out"):
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    _, out, err = run_main(capsys, *args)
    return out if stream == "out" else err


def _single_piece(line: str) -> bool:
    """One unbreakable piece: a path, a command, or check's ``path: CODE [severity]`` head."""
    return len(line.split()) == 1 or re.fullmatch(r"\S+: CKD\d+ \[\w+\]", line) is not None


def _words(text: str, command: str) -> list[str]:
    if command == "fix-args":  # a too-wide table's "why" column goes under each row: its header and rule with it
        text = "\n".join(line for line in text.splitlines() if not line.startswith(("code ", "------")))
    return text.split()


def _check_wrapped(command, wide, at_100, at_60, narrows):
    assert at_100.splitlines(), command
    too_long = [line for line in at_100.splitlines() if len(line) > DEFAULT_WIDTH and not _single_piece(line)]
    assert too_long == [], command
    assert _words(at_100, command) == _words(wide, command)
    assert _words(at_60, command) == _words(wide, command)
    whole = set(at_100.splitlines())
    # wider than 60: only lines that are never wrapped (tables, fix: commands) or one unbreakable piece
    wider = [line for line in at_60.splitlines() if len(line) > 60]
    assert [line for line in wider if line not in whole and not _single_piece(line)] == []
    if narrows:
        assert max(map(len, wide.splitlines())) > DEFAULT_WIDTH
        assert len(at_60.splitlines()) > len(at_100.splitlines()) > len(wide.splitlines())


@pytest.mark.parametrize("command", list(CASES))
def test_text_fits_the_width_with_the_same_words(command, capsys, monkeypatch):
    args, narrows = CASES[command]
    monkeypatch.chdir(REPO)
    wide = _run(capsys, monkeypatch, args, UNWRAPPED)
    at_100 = _run(capsys, monkeypatch, args)
    at_60 = _run(capsys, monkeypatch, args, "60")
    _check_wrapped(command, wide, at_100, at_60, narrows)


def test_latest_good_stderr_lines_fit_the_width(capsys, monkeypatch, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "core019_tp2", save)
    next((save / "iter_0000010").glob("*.distcp")).unlink()
    monkeypatch.chdir(tmp_path)
    args = ["latest-good", "save"]
    wide = _run(capsys, monkeypatch, args, UNWRAPPED, stream="err")
    assert "skipped save/iter_0000010: CKD113" in wide
    _check_wrapped(
        "latest-good",
        wide,
        _run(capsys, monkeypatch, args, stream="err"),
        _run(capsys, monkeypatch, args, "60", stream="err"),
        True,
    )
    assert _run(capsys, monkeypatch, args, "60") == ""  # no good one: stdout holds only the answer


def test_inspect_args_groups_break_between_pairs(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = _run(capsys, monkeypatch, ["inspect", "fixtures/core019_moe_ep2"])
    lines = out.splitlines()
    start = lines.index("args") + 1
    group = lines[start : lines.index("", start)]
    assert group[0].startswith("  parallelism: tensor_model_parallel_size=1  pipeline_model_parallel_size=1")
    hanging = " " * len("  parallelism: ")
    for line in group[1:]:
        if not line.startswith("  ") or line[2] != " ":
            hanging = " " * (line.index(": ") + 2)  # the next group
            continue
        assert line.startswith(hanging) and line[len(hanging)] != " "  # continuation under the group's first pair
    pairs = [p for line in group for p in line.split(": ", 1)[-1].split()]
    assert all("=" in p for p in pairs)  # each key=value pair whole on one line


def test_check_fix_lines_and_commands_stay_on_one_line(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = _run(capsys, monkeypatch, ["check", "--isolated", "fixtures/core016_convert_tp4"], "40")
    fixes = [line for line in out.splitlines() if line.lstrip().startswith("fix:")]
    assert fixes == ["    fix: ckptdoctor fix-args fixtures/core016_convert_tp4/iter_0000010 --in-place"] * 3
    lines = out.splitlines()
    assert lines[0] == "fixtures/core016_convert_tp4/iter_0000010/common.pt: CKD203 [warning]"  # the head whole
    assert lines[1].startswith("    no experts")  # the message continues under it
    assert lines[-3:-1] == ["Found 3 problems (1 error, 2 warnings)", "    in 1 checkpoint; 3 fixable (see the fix:"]
    assert lines[-1] == "    lines)."  # no continuation line starts with "fix:" (it would read as a fix line)


def test_json_and_annotations_are_never_wrapped(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    for args in (
        ["check", "--isolated", "--format", "json", "fixtures/core016_convert_tp4"],
        ["check", "--isolated", "--format", "github", "fixtures/core016_convert_tp4"],
        ["check", "--isolated", "--format", "sarif", "fixtures/core016_convert_tp4"],
        ["inspect", "--format", "json", "fixtures/core019_moe_ep2"],
        ["fix-args", "--format", "json", "fixtures/core016_convert_tp4"],
        ["can-load", "--format", "json", "fixtures/core019_tp2_dp2", "--target", "tp=2,pp=2"],
    ):
        assert _run(capsys, monkeypatch, args, "30") == _run(capsys, monkeypatch, args), args
    annotations = _run(capsys, monkeypatch, args=["check", "--isolated", "--format", "github", CASES["check"][0][-1]])
    assert max(map(len, annotations.splitlines())) > DEFAULT_WIDTH  # one workflow command a line, as GitHub reads it
    json.loads(_run(capsys, monkeypatch, ["inspect", "--format", "json", "fixtures/core019_moe_ep2"], "30"))


# --- wrap_block and output_width ----------------------------------------------------------------------------


def test_wrap_block_keeps_commands_paths_and_pairs_whole():
    path = "/data/runs/llama/checkpoints/iter_0000010.old-12345"
    text = f"{path}: CKD501 [warning] old tree being deleted when a run was interrupted; delete it: rm -rf {path}"
    wrapped = wrap_block(text, 40, head=len(f"{path}: CKD501 [warning]"))
    assert wrapped.split() == text.split()
    assert wrapped.splitlines()[0] == f"{path}: CKD501 [warning]"
    assert f"    rm -rf {path}" in wrapped.splitlines()  # the command on one line of its own, wider than 40
    moved = "restore it: mv 'a dir/x.bak' 'a dir/x' && rm -rf 'a dir/x.tmp'; then `ckptdoctor check 'a dir'` again"
    assert "mv 'a dir/x.bak' 'a dir/x' && rm -rf 'a dir/x.tmp';" in wrap_block(moved, 20)
    assert "`ckptdoctor check 'a dir'`" in wrap_block(moved, 20)
    assert "    ((2, 2) vs" in wrap_block("a mismatch ((2, 2) vs (4, 1) here)", 16)
    assert wrap_block("x" * 150, 100) == "x" * 150  # no mid-word break
    assert wrap_block("short line", 100) == "short line" and wrap_block("a " * 80, None) == "a " * 80


def test_wrap_block_breaks_at_the_separator_with_a_hanging_indent():
    text = "  group: a=1  b=[1, 2, 3]  c=some value  d=4"
    assert wrap_block(text, 24, " " * 9, sep="  ").splitlines() == [
        "  group: a=1",
        "         b=[1, 2, 3]",
        "         c=some value",
        "         d=4",
    ]
    assert wrap_block(text, 200, " " * 9, sep="  ") == text


def test_output_width(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert output_width(io.StringIO()) == DEFAULT_WIDTH  # not a terminal

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(wrap.shutil, "get_terminal_size", lambda fallback: os.terminal_size((132, 40)))
    assert output_width(Terminal()) == 132
    monkeypatch.setenv("COLUMNS", "72")
    assert output_width(io.StringIO()) == output_width(Terminal()) == 72  # the explicit override
    monkeypatch.setenv("COLUMNS", "3")
    assert output_width(io.StringIO()) == wrap.MIN_WIDTH
    monkeypatch.setenv("COLUMNS", "wide")
    assert output_width(io.StringIO()) == DEFAULT_WIDTH
