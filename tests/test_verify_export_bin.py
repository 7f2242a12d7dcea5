"""``verify-export`` of a ``pytorch_model*.bin`` export (issue #39): ``fixtures/hf_bin/core019_tp1`` was written
by ``transformers``' ``save_pretrained(..., safe_serialization=False)`` (``fixtures/make_hf_exports.py --bin``).
Its names, dtypes and shapes are read through the one archive decoder and the safe unpickler without torch; its
values stream one storage record at a time; a hostile ``.bin`` is refused in one line and never executed."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, run_cli, run_main, shipped_schema

CKPT = FIXTURES / "core019_tp1"
HF_BIN = FIXTURES / "hf_bin" / "core019_tp1"
BIN_INDEX = "pytorch_model.bin.index.json"


def _verify(capsys, hf: Path, *extra: str) -> tuple[int, dict]:
    rc, out, err = run_main(capsys, "verify-export", CKPT, hf, *extra, "--format", "json")
    assert rc in (0, 1), err
    report = json.loads(out)
    jsonschema.Draft202012Validator(shipped_schema("verify-export")).validate(report)
    return rc, report


@pytest.fixture
def bin_copy(tmp_path) -> Path:
    dest = tmp_path / "hf_bin"
    shutil.copytree(HF_BIN, dest)
    return dest


def _weight_map(hf: Path) -> dict[str, str]:
    return json.loads((hf / BIN_INDEX).read_text())["weight_map"]


def test_the_bin_export_matches_like_its_safetensors_twin(capsys):
    rc, report = _verify(capsys, HF_BIN)
    assert rc == 0 and report["counts"] == {"errors": 0, "warnings": 0, "infos": 0}
    rc, twin = _verify(capsys, FIXTURES / "hf" / "core019_tp1")
    strip = ("hf_dir", "shards", "tensors")
    assert {k: v for k, v in report.items() if k not in strip} == {k: v for k, v in twin.items() if k not in strip}
    unsharded = [{k: v for k, v in t.items() if k != "shard"} for t in report["tensors"]]
    assert unsharded == [{k: v for k, v in t.items() if k != "shard"} for t in twin["tensors"]]
    assert {t["shard"] for t in report["tensors"]} == set(_weight_map(HF_BIN).values())
    assert report["shards"] == len(set(_weight_map(HF_BIN).values())) == 3


def test_metadata_of_a_bin_export_is_read_without_torch():
    proc = run_cli("verify-export", str(CKPT), str(HF_BIN))
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED:\n" in proc.stderr  # neither torch nor megatron
    assert proc.stdout.splitlines()[-1].startswith("match: 21 expected tensors")


def test_values_of_the_bin_export_equal_the_checkpoint_at_any_jobs(capsys):
    pytest.importorskip("torch")
    rc, one = _verify(capsys, HF_BIN, "--values", "--jobs", "1")
    assert rc == 0 and one["values_compared"] == one["expected_tensors"] == 21
    assert {t["max_abs_diff"] for t in one["tensors"]} == {0.0}
    assert _verify(capsys, HF_BIN, "--values", "--jobs", "2")[1] == one


def test_a_changed_tensor_and_a_missing_shard_of_a_bin_export(capsys, bin_copy):
    torch = pytest.importorskip("torch")
    weight_map = _weight_map(bin_copy)
    changed = "model.layers.1.mlp.down_proj.weight"
    shard = bin_copy / weight_map[changed]
    state = torch.load(shard, weights_only=True)  # the test's own fixture: trusted
    state[changed] = torch.zeros_like(state[changed])
    torch.save(state, shard)
    rc, report = _verify(capsys, bin_copy, "--values")
    assert rc == 1
    assert [(f["code"], f["hf_name"]) for f in report["findings"]] == [("zeroed", changed)]
    gone = next(s for s in sorted(set(weight_map.values())) if s != shard.name)
    (bin_copy / gone).unlink()
    rc, report = _verify(capsys, bin_copy)
    assert rc == 1
    found = {(f["code"], f.get("shard")) for f in report["findings"] if f["code"] == "shard-missing"}
    assert found == {("shard-missing", gone)}
    missing = {f["hf_name"] for f in report["findings"] if f["code"] == "missing"}
    assert missing == {n for n, s in weight_map.items() if s == gone}


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _torch_zip(path: Path, pickled: bytes) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")


def test_a_bin_shard_whose_pickle_calls_os_system_is_refused_in_one_line_and_never_run(capsys, bin_copy, tmp_path):
    marker = tmp_path / "ran"
    shard = bin_copy / sorted(set(_weight_map(bin_copy).values()))[1]
    _torch_zip(shard, pickle.dumps(_Payload(marker), protocol=2))
    rc, out, err = run_main(capsys, "verify-export", CKPT, bin_copy)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert shard.name in err and "system" in err
    assert not marker.exists()


def test_a_bogus_zip_bin_and_a_legacy_bin_are_refused_in_one_line(capsys, bin_copy):
    shard = bin_copy / sorted(set(_weight_map(bin_copy).values()))[0]
    shard.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    rc, out, err = run_main(capsys, "verify-export", CKPT, bin_copy)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and shard.name in err
    assert "not a readable torch.save file" in err
    shard.write_bytes(pickle.dumps({"a": 1}, protocol=2))  # not a zip: a legacy torch.save or anything else
    rc, out, err = run_main(capsys, "verify-export", CKPT, bin_copy)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "not a torch.save zip archive" in err


def test_a_single_pytorch_model_bin_without_an_index(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    hf = tmp_path / "single"
    hf.mkdir()
    shutil.copy(HF_BIN / "config.json", hf / "config.json")
    state = {}
    for shard in sorted(set(_weight_map(HF_BIN).values())):
        state.update(torch.load(HF_BIN / shard, weights_only=True))
    torch.save(state, hf / "pytorch_model.bin")
    rc, report = _verify(capsys, hf, "--values")
    assert rc == 0 and report["shards"] == 1 and report["values_compared"] == 21
