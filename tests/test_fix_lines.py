"""Every ``fix:`` line check prints works when run as printed (issue #35 item 4): on each corruption below, each
printed command is run and must succeed and make its findings go away; where the fixer would refuse, no line."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES

from ckptdoctor.cli import main
from ckptdoctor.ops.fixes import _codes_fixed

ITER = "iter_0000010"


def _corrupt(name: str, save: Path) -> Path:
    """Apply corruption ``name`` to a copy of a fixture at ``save``; return the path to check."""
    src = "core019_convert_tp4" if name == "converted-args" else "core019_tp2"
    shutil.copytree(FIXTURES / src, save)
    it = save / ITER
    if name == "metadata-json-missing":
        (it / "metadata.json").unlink()
    elif name == "metadata-json-and-data-missing":
        (it / "metadata.json").unlink()
        (it / "__1_0.distcp").unlink()
    elif name == "junk-dir-with-distcp":
        junk = save.parent / "junk"
        junk.mkdir()
        shutil.copy(it / "__0_0.distcp", junk / "__0_0.distcp")
        shutil.rmtree(save)
        return junk
    elif name == "unreferenced-distcp":
        shutil.copy(it / "__0_0.distcp", it / "__9_0.distcp")
    elif name == "tracker-to-missing-iteration":
        (save / "latest_checkpointed_iteration.txt").write_text("20")
    elif name == "leftover-of-a-write":
        staging = save / ".iter_0000010.ckptdoctor-tmp-20261206T000000-abcd"  # an interrupted strip-frozen -o
        staging.mkdir()
        (staging / "__0_0.distcp").write_bytes(b"half")
    return save


CORRUPTIONS = [
    "metadata-json-missing",
    "metadata-json-and-data-missing",
    "junk-dir-with-distcp",
    "unreferenced-distcp",
    "tracker-to-missing-iteration",
    "leftover-of-a-write",
    "converted-args",
]


def _check(capsys, path: Path) -> list[dict]:
    main(["check", "--isolated", str(path), "--format", "json"])
    return json.loads(capsys.readouterr().out)["findings"]


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_every_printed_fix_succeeds_as_printed(name, capsys, tmp_path):
    path = _corrupt(name, tmp_path / "save")
    findings = _check(capsys, path)
    assert findings, name
    fixes = {f["fix"] for f in findings if f["fix"]}
    for fix in sorted(fixes):
        words = shlex.split(fix)
        assert words[0] == "ckptdoctor"
        rc = main(words[1:])
        out, err = capsys.readouterr()
        assert rc == 0, f"{fix}: exit {rc}\n{out}\n{err}"
    fixed = {(f["code"], f["path"]) for f in findings if f["fix"]}
    after = {(f["code"], f["path"]) for f in _check(capsys, path)}
    assert not fixed & after, f"{name}: still reported after the fix: {fixed & after}"


@pytest.mark.parametrize("name", ["metadata-json-and-data-missing", "junk-dir-with-distcp"])
def test_no_fix_line_where_the_fixer_refuses(name, capsys, tmp_path):
    path = _corrupt(name, tmp_path / "save")
    findings = _check(capsys, path)
    assert any(f["code"] == "CKD101" for f in findings)
    assert not any(f["fix"] for f in findings), findings
    main(["check", "--isolated", str(path)])
    assert "fix:" not in capsys.readouterr().out


def test_no_in_place_fix_on_object_storage():
    assert _codes_fixed("ckptdoctor repair s3://bucket/run/iter_0000010 --in-place") == set()
    assert _codes_fixed("ckptdoctor fix-args msc://profile/run --in-place") == set()
