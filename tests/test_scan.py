"""One tolerant scan (issue #10): ``open_checkpoint`` refuses with the first problem ``check`` reports, worded the
same; ``check`` reports them all; the write commands' refusal of a damaged source reads the same storage problems."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import FIXTURES, fixture_names

from ckptdoctor.checkpoint import open_checkpoint, scan_iteration_dir, scan_path
from ckptdoctor.cli import main
from ckptdoctor.data_files import storage_problems
from ckptdoctor.errors import CkptError, UnsafePickleError
from ckptdoctor.ops.rewrite.write import structural_problems

ITER = "iter_0000010"


def _break(kind: str, iteration_dir: Path) -> None:
    if kind == "no-metadata-json":
        (iteration_dir / "metadata.json").unlink()
    elif kind == "bad-json":
        (iteration_dir / "metadata.json").write_text("{not json")
    elif kind == "no-backend":
        (iteration_dir / "metadata.json").write_text('{"format": 1}')
    elif kind == "other-backend":
        (iteration_dir / "metadata.json").write_text('{"sharded_backend": "fsdp_dtensor"}')
    elif kind == "legacy":
        (iteration_dir / "mp_rank_00").mkdir()
    elif kind == "no-index":
        (iteration_dir / ".metadata").unlink()
    elif kind == "garbage-index":
        (iteration_dir / ".metadata").write_bytes(random.Random(1).randbytes(512))
    elif kind == "unsafe-index":
        (iteration_dir / ".metadata").write_bytes(b"cos\nsystem\n(S'true'\ntR.")


KINDS = {
    "no-metadata-json": "CKD101",
    "bad-json": "CKD102",
    "no-backend": "CKD102",
    "other-backend": "CKD103",
    "legacy": "CKD103",
    "no-index": "CKD110",
    "garbage-index": "CKD111",
    "unsafe-index": "CKD401",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_open_refuses_with_the_problem_check_reports(capsys, copy_fixture, kind):
    iteration_dir = copy_fixture("core019_tp1") / ITER
    _break(kind, iteration_dir)
    scanned = scan_iteration_dir(iteration_dir)
    first = next(p for p in scanned.problems if p.fatal)
    assert first.code == KINDS[kind]
    with pytest.raises(CkptError) as raised:
        open_checkpoint(iteration_dir)
    assert str(raised.value) == str(first.as_error())
    if kind == "unsafe-index":  # a refused pickle keeps its own type (and exit code) and wording
        assert isinstance(raised.value, UnsafePickleError) and "os.system" in str(raised.value)
    else:
        assert str(raised.value) == f"{first.path}: {first.detail}"
    rc = main(["check", "--isolated", "--format", "json", str(iteration_dir)])
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert rc == 1
    reported = [f for f in findings if f["code"] == first.code]
    assert reported, findings
    if kind != "unsafe-index":
        assert reported[0]["message"] == first.detail and reported[0]["path"] == str(first.path)


def test_scan_goes_on_after_a_problem(copy_fixture):
    """A missing metadata.json does not stop the scan: the index is still read (check needs it for the rest)."""
    iteration_dir = copy_fixture("core019_tp2") / ITER
    (iteration_dir / "metadata.json").unlink()
    scanned = scan_iteration_dir(iteration_dir)
    assert [p.code for p in scanned.problems] == ["CKD101"]
    assert scanned.checkpoint is not None and len(scanned.checkpoint.entries) > 10
    assert scanned.index_known


@pytest.mark.parametrize("name", fixture_names())
def test_real_fixtures_scan_clean(name):
    scanned = scan_path(FIXTURES / name)
    assert scanned.problems == []
    assert scanned.checkpoint is not None
    assert storage_problems(scanned.checkpoint) == ([], set())
    assert scanned.location.backend in ("torch_dist", "zarr")


def test_storage_problems_are_what_strip_refuses(copy_fixture):
    iteration_dir = copy_fixture("core019_tp2") / ITER
    with open(iteration_dir / "__1_0.distcp", "r+b") as f:
        f.truncate(100)
    (iteration_dir / "__0_0.distcp").unlink()
    checkpoint = open_checkpoint(iteration_dir)  # data files are not the index: the checkpoint still opens
    problems, bad = storage_problems(checkpoint)
    assert [p.code for p in problems] == ["CKD113", "CKD114"]
    assert bad == {"__0_0.distcp", "__1_0.distcp"}
    assert structural_problems(checkpoint) == [f"{p.path}: {p.code} {p.detail}" for p in problems]


def test_empty_unreferenced_data_file_is_no_finding(capsys, copy_fixture):
    """DCP writes an empty .distcp for a rank with nothing to save: nothing wasted, nothing mixed up. A non-empty
    file no entry references is still a CKD115 warning."""
    iteration_dir = copy_fixture("core019_tp2") / ITER
    (iteration_dir / "__7_0.distcp").write_bytes(b"")
    assert main(["check", "--isolated", str(iteration_dir)]) == 0
    capsys.readouterr()
    (iteration_dir / "__8_0.distcp").write_bytes(b"x")
    assert main(["check", "--isolated", "--format", "json", str(iteration_dir)]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert [(f["code"], Path(f["path"]).name) for f in findings] == [("CKD115", "__8_0.distcp")]


@pytest.mark.parametrize("name", ["core019_tp2", "core016_tp1"])
def test_metadata_commands_fit_a_small_address_space(name):
    """Reading a pickle reserves what the file holds, not the 1 GiB pickle limit: every metadata command runs
    with 300 MB of address space to spare (a 1 GiB ``read()`` was a MemoryError under such a limit)."""
    from conftest import run_ckptdoctor

    path = FIXTURES / name
    for args in (["inspect", path], ["check", "--isolated", path], ["fix-args", path], ["diff", path, path]):
        result = run_ckptdoctor(*args, memory_headroom=300 << 20)
        assert result.returncode == 0, (args, result.stderr)
        assert "error" not in result.stderr
