"""One shape of JSON across commands (issue #35 item 7): a top-level ``schema`` in every command's output, the same
types for the same fields, and an error in ``--format json`` mode that is a JSON object on stdout too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO

from ckptdoctor.cli import main

TP1 = FIXTURES / "core019_tp1"

# every command with a JSON output, on a fixture it reads without error
COMMANDS = {
    "inspect": ("inspect", TP1),
    "show": ("show", TP1, "decoder.final_layernorm.weight"),
    "check": ("check", "--isolated", TP1),
    "diff": ("diff", TP1, FIXTURES / "core019_tp2"),
    "fix-args": ("fix-args", FIXTURES / "core019_convert_tp4"),
    "repair": ("repair", TP1),
    "latest-good": ("latest-good", TP1),
    "history": ("history", TP1),
    "strip-frozen": ("strip-frozen", FIXTURES / "core019_peft_full_tp1"),
    "edit": ("edit", FIXTURES / "core019_tp2", "--remove", r"^optimizer\."),
    "convert": ("convert", FIXTURES / "core019_tp2", "--to", "fsdp_dtensor"),
    "can-load": ("can-load", TP1, "--target", "tp=1"),
    "verify-export": ("verify-export", TP1, FIXTURES / "hf" / "core019_tp1"),
    "rules": ("rules",),
}


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_a_top_level_schema(name, capsys):
    rc, out, err = _run(capsys, *COMMANDS[name], "--format", "json")
    assert rc in (0, 1), err
    report = json.loads(out)
    assert report["schema"] == f"ckptdoctor.{name}/1"


def test_latest_good_counts_and_iteration_as_inspect_has_them(capsys):
    _, out, _ = _run(capsys, "latest-good", TP1, "--format", "json")
    report = json.loads(out)
    _, out, _ = _run(capsys, "inspect", TP1, "--format", "json")
    inspected = json.loads(out)
    assert report["iteration"] == inspected["iteration"] == 10  # an int in both
    assert report["release"] is False
    _, out, _ = _run(capsys, "check", "--isolated", TP1, "--format", "json")
    checked = json.loads(out)["checked"]
    assert isinstance(checked, list) and isinstance(report["checked"], list)  # a list in both
    assert report["checked"] == [str(TP1 / "iter_0000010")]


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "rules"])
def test_an_error_in_json_mode_is_a_json_object_too(name, capsys, tmp_path):
    missing = tmp_path / "nothing-here"
    args = [str(missing) if isinstance(a, Path) else a for a in COMMANDS[name][1:]]
    rc, out, err = _run(capsys, name, *args, "--format", "json")
    assert rc == 2
    if name == "check":  # check's own report names what is missing (a path of many may be)
        assert json.loads(out)["missing"] == [str(missing)] and str(missing) in err
        return
    error = json.loads(out)
    assert error["schema"] == "ckptdoctor.error/1" and error["command"] == name and error["exit_code"] == 2
    assert str(missing) in error["error"] and error["error"] in err  # the same message as the stderr line


def test_a_usage_error_in_json_mode_is_a_json_object_too(capsys):
    rc, out, err = _run(capsys, "inspect", TP1, "--format=json", "--no-such-option")
    assert rc == 2 and "--no-such-option" in err
    assert json.loads(out) == {
        "schema": "ckptdoctor.error/1",
        "command": "inspect",
        "error": "No such option '--no-such-option'.",
        "exit_code": 2,
    }


def test_text_mode_errors_leave_stdout_empty():
    proc = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "inspect", "/nonexistent/ckpt"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stdout == "" and "no such file or directory" in proc.stderr
