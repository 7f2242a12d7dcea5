"""One write model for every command that writes a checkpoint (issue #35 item 6): ``-o/--output DIR`` or
``--in-place`` writes, ``--dry-run`` plans and writes nothing, no target prints the report or plan; ``--write``
still works with a target, saying on stderr that it is deprecated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, file_digests

from ckptdoctor.cli import main

ITER = "iter_0000010"

# each write command with arguments that give it something to write on its fixture
COMMANDS = {
    "fix-args": ("core019_convert_tp4", ()),
    "repair": ("core019_tp1", ()),  # the fixture copy loses its metadata.json below: repair rewrites it
    "strip-frozen": ("core019_peft_full_tp1", ()),
    "edit": ("core019_tp2", ("--remove", r"^optimizer\.")),
}


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _source(name: str, copy_fixture) -> Path:
    save = copy_fixture(COMMANDS[name][0])
    if name == "repair":
        (save / ITER / "metadata.json").unlink()
    return save


@pytest.mark.parametrize("name", list(COMMANDS))
def test_output_alone_writes(name, capsys, copy_fixture, tmp_path):
    save = _source(name, copy_fixture)
    before = file_digests(save)
    rc, _, err = _run(capsys, name, save, *COMMANDS[name][1], "-o", tmp_path / "out")
    assert rc == 0, err
    assert (tmp_path / "out" / ITER / ".metadata").is_file()
    assert "deprecated" not in err
    assert file_digests(save) == before  # the source is read-only


@pytest.mark.parametrize("name", list(COMMANDS))
def test_no_target_and_dry_run_write_nothing(name, capsys, copy_fixture, tmp_path):
    save = _source(name, copy_fixture)
    before = file_digests(save)
    rc_plain, out_plain, err = _run(capsys, name, save, *COMMANDS[name][1], "--format", "json")
    assert rc_plain in (0, 1), err  # the report or plan, never a usage error
    json.loads(out_plain)
    rc_dry, out_dry, err = _run(capsys, name, save, *COMMANDS[name][1], "-o", tmp_path / "out", "--dry-run")
    assert rc_dry in (0, 1), err
    assert not (tmp_path / "out").exists()
    rc_dry, _, err = _run(capsys, name, save, *COMMANDS[name][1], "--in-place", "--dry-run")
    assert rc_dry in (0, 1), err
    assert file_digests(save) == before


@pytest.mark.parametrize("name", list(COMMANDS))
def test_write_flag_deprecated_but_accepted(name, capsys, copy_fixture, tmp_path):
    save = _source(name, copy_fixture)
    rc, _, err = _run(capsys, name, save, *COMMANDS[name][1], "--write", "-o", tmp_path / "out")
    assert rc == 0, err
    assert err.splitlines()[0].startswith("ckptdoctor: --write is deprecated")
    assert (tmp_path / "out" / ITER / ".metadata").is_file()


@pytest.mark.parametrize("name", list(COMMANDS))
def test_usage_errors(name, capsys, tmp_path):
    src = FIXTURES / COMMANDS[name][0]
    extra = COMMANDS[name][1]
    rc, _, err = _run(capsys, name, src, *extra, "-o", tmp_path / "out", "--in-place")
    assert rc == 2 and "give one of -o/--output DIR and --in-place, not both" in err
    rc, _, err = _run(capsys, name, src, *extra, "--write")
    assert rc == 2 and "--write needs -o/--output DIR or --in-place" in err
    rc, _, err = _run(capsys, name, src, *extra, "--write", "--dry-run", "--in-place")
    assert rc == 2 and "--dry-run writes nothing" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_shows_one_model(name, capsys):
    rc, out, _ = _run(capsys, name, "--help")
    assert rc == 0
    for option in ("-o, --output", "--in-place", "--dry-run", "--force"):
        assert option in out
    assert "--write" not in out  # deprecated: accepted, not offered
