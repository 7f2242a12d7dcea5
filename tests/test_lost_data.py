"""Issue #37 item 3: the data a missing (CKD113) or truncated (CKD114) data file loses, as data: every lost chunk in
the finding's JSON ``lost`` ({key, offsets, sizes, file}), summarised in its message, and the same chunks in
``repair``'s and ``latest-good``'s reports. The chunks' byte ranges come from ``show`` (and, in the mcore tier,
from torch's own DCP reader), never from the code under test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, run_main, shipped_schema, squash

ITER = "iter_0000010"
NAME = "core019_tp2"


def _json(capsys, *args: object, schema: str, codes: tuple[int, ...] = (1,)) -> dict:
    rc, out, err = run_main(capsys, *args, "--format", "json")
    assert rc in codes, (rc, err)
    doc = json.loads(out)
    jsonschema.Draft202012Validator(shipped_schema(schema)).validate(doc)
    return doc


def _chunks(capsys, save: Path) -> list[tuple[str, tuple, tuple, str, int, int]]:
    """Every chunk of the intact checkpoint as ``show`` lists it: (key, offsets, sizes, file, offset, length)."""
    keys = _json(capsys, "inspect", save, "--keys", schema="inspect", codes=(0,))["keys"]
    out = []
    for row in keys:
        shown = _json(capsys, "show", save, row["key"], schema="show", codes=(0,))
        for c in shown["chunks"]:
            out.append((row["key"], tuple(c["offsets"]), tuple(c["sizes"]), c["file"], c["offset"], c["length"]))
    return out


def _as_set(lost: list[dict]) -> set[tuple]:
    return {(c["key"], tuple(c["offsets"]), tuple(c["sizes"]), c["file"]) for c in lost}


def _summary(lost: set[tuple]) -> str:
    keys = sorted({c[0] for c in lost})
    more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
    return f"lost {len(lost)} chunks of {len(keys)} keys: {', '.join(keys[:3])}{more}"


@pytest.fixture
def save(tmp_path: Path) -> Path:
    dest = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, dest)
    return dest


def test_a_truncated_file_loses_only_the_chunks_past_its_end(capsys, save):
    chunks = _chunks(capsys, save)
    in_file = sorted((c for c in chunks if c[3] == "__1_0.distcp"), key=lambda c: c[4])
    cut = in_file[len(in_file) // 2][4] + 1  # inside a chunk halfway through the file: it and all after it are lost
    with open(save / ITER / "__1_0.distcp", "r+b") as f:
        f.truncate(cut)
    expected = {c[:4] for c in in_file if c[4] + c[5] > cut}
    kept = {c[:4] for c in in_file} - expected
    assert expected and kept  # the test means something: some chunks of the file survive

    report = _json(capsys, "check", save, schema="check")
    (found,) = [f for f in report["findings"] if f["code"] == "CKD114"]
    assert _as_set(found["lost"]) == expected and len(found["lost"]) == len(expected)
    assert found["message"].endswith(_summary(expected)), found["message"]
    assert [(c["key"], c["offsets"]) for c in found["lost"]] == sorted((c["key"], c["offsets"]) for c in found["lost"])

    rc, out, _ = run_main(capsys, "check", save)
    assert rc == 1 and _summary(expected) in out


def test_a_missing_file_loses_every_chunk_it_held(capsys, save):
    chunks = _chunks(capsys, save)
    (save / ITER / "__0_0.distcp").unlink()
    expected = {c[:4] for c in chunks if c[3] == "__0_0.distcp"}

    report = _json(capsys, "check", save, schema="check")
    (found,) = [f for f in report["findings"] if f["code"] == "CKD113"]
    assert _as_set(found["lost"]) == expected
    bytes_items = [c for c in found["lost"] if c["key"].startswith("common_state/")]
    assert bytes_items and all(c["offsets"] == [] and c["sizes"] == [] for c in bytes_items)
    assert found["message"] == f"__0_0.distcp missing: {_summary(expected)}"
    assert all("lost" not in f for f in report["findings"] if f["code"] not in ("CKD113", "CKD114"))

    # repair names the same chunks: its unrepairable finding carries them, its way out counts them
    repair = _json(capsys, "repair", save, schema="repair")
    (unrepairable,) = [f for f in repair["unrepairable"] if f["code"] == "CKD113"]
    assert _as_set(unrepairable["lost"]) == expected
    keys = len({c[0] for c in expected})
    count = f"{len(expected)} chunks of {keys} keys in 1 data file"
    counted = f"the data of CKD113, CKD131 is lost from this checkpoint ({count})"
    assert counted in repair["way_out"], repair["way_out"]
    rc, out, _ = run_main(capsys, "repair", save)
    assert rc == 1 and counted in squash(out) and _summary(expected) in squash(out)

    # latest-good's skipped errors are check's findings, lost chunks and all
    latest = _json(capsys, "latest-good", save, schema="latest-good")
    (error,) = [e for e in latest["skipped"][0]["errors"] if e["code"] == "CKD113"]
    assert _as_set(error["lost"]) == expected


def test_a_clean_checkpoint_has_no_lost_field(capsys, save):
    report = _json(capsys, "check", save, schema="check", codes=(0,))
    assert report["findings"] == []
    (save / ITER / "__0_0.distcp").write_bytes(
        (save / ITER / "__0_0.distcp").read_bytes() + b"x"
    )  # longer: nothing lost
    report = _json(capsys, "check", save, schema="check", codes=(0, 1))
    assert all("lost" not in f for f in report["findings"])


@pytest.mark.mcore
def test_the_lost_chunks_are_those_torchs_reader_places_past_the_end(capsys, save):
    """The premise, against torch's own DCP reader: the chunks whose byte range torch places past the cut."""
    pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(save / ITER)).read_metadata()
    size = (save / ITER / "__1_0.distcp").stat().st_size
    cut = size // 2
    with open(save / ITER / "__1_0.distcp", "r+b") as f:
        f.truncate(cut)
    expected = set()
    for index, info in metadata.storage_data.items():
        if info.relative_path != "__1_0.distcp" or info.offset + info.length <= cut:
            continue
        item = metadata.state_dict_metadata[index.fqn]
        if hasattr(item, "chunks"):
            (chunk,) = [c for c in item.chunks if tuple(c.offsets) == tuple(index.offset)]
            expected.add((index.fqn, tuple(chunk.offsets), tuple(chunk.sizes), info.relative_path))
        else:
            expected.add((index.fqn, (), (), info.relative_path))
    report = _json(capsys, "check", save, schema="check")
    (found,) = [f for f in report["findings"] if f["code"] == "CKD114"]
    assert expected and _as_set(found["lost"]) == expected
