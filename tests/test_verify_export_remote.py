"""``verify-export`` with either side on object storage (issue #39): the same moto S3 server as
``test_remote.py`` (``s3://`` through fsspec, ``msc://`` through multi-storage-client), behind the proxy that logs
every request. The report equals the local one, metadata-only work GETs the shards' headers and no tensor byte,
and ``--values`` reads each HF tensor's byte range."""

from __future__ import annotations

import json
import shutil

import pytest
import s3_server  # moto, s3fs and multi-storage-client are test dependencies: no skip
from conftest import FIXTURES

from ckptdoctor.cli import main
from ckptdoctor.formats.safetensors_header import read_header
from ckptdoctor.storage import interface

pytestmark = pytest.mark.xdist_group("s3")  # one moto server per worker, as test_remote.py

CKPT = "core019_moe_ep2"
HF = FIXTURES / "hf" / CKPT
PREFIXES = {"s3": f"s3://{s3_server.BUCKET}/", "msc": "msc://s3test/"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = s3_server.start()
    try:
        srv.upload_tree(FIXTURES / CKPT, CKPT)
        srv.upload_tree(HF, f"hf/{CKPT}")
        broken = tmp_path_factory.mktemp("broken") / CKPT
        shutil.copytree(HF, broken)
        (broken / "model-00002-of-00002.safetensors").unlink()
        srv.upload_tree(broken, f"broken/{CKPT}")
        srv.upload_tree(FIXTURES / "hf_bin" / "core019_tp1", "hf_bin/core019_tp1")
        srv.msc_file = srv.msc_config(  # type: ignore[attr-defined]
            tmp_path_factory.mktemp("msc") / "msc.yaml", {"s3test": s3_server.BUCKET}
        )
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def remote(server, monkeypatch):
    for name, value in server.env(server.msc_file).items():
        monkeypatch.setenv(name, value)
    interface.forget_stores()
    server.log.clear()
    yield server
    interface.forget_stores()


def _json(capsys, ckpt: str, hf: str, *extra: str) -> tuple[int, dict]:
    interface.forget_stores()
    capsys.readouterr()
    rc = main(["verify-export", ckpt, hf, *extra, "--format", "json"])
    out, err = capsys.readouterr()
    assert rc in (0, 1), err
    return rc, json.loads(out)


def _same(report: dict, local: dict) -> None:
    for field in ("checkpoint", "hf_dir"):
        report.pop(field), local.pop(field)
    assert report == local


@pytest.mark.parametrize("backend", ["s3", "msc"])
def test_both_sides_on_object_storage_give_the_local_report_and_read_no_tensor_bytes(remote, capsys, backend):
    _, local = _json(capsys, str(FIXTURES / CKPT), str(HF))
    remote.log.clear()
    rc, report = _json(capsys, f"{PREFIXES[backend]}{CKPT}", f"{PREFIXES[backend]}hf/{CKPT}")
    assert rc == 0 and report["hf_dir"] == f"{PREFIXES[backend]}hf/{CKPT}"
    _same(report, local)
    shard_gets = [r for r in remote.log.gets() if r.key.endswith(".safetensors")]
    headers = {p.name: 8 + read_header(p).header_bytes for p in HF.glob("*.safetensors")}
    assert {r.key.rsplit("/", 1)[-1] for r in shard_gets} == set(headers)
    for name, header_bytes in headers.items():  # the 8-byte length and the JSON: nothing of the data
        got = sum(r.body_bytes for r in shard_gets if r.key.endswith(name))
        assert got == header_bytes


@pytest.mark.parametrize("side", ["checkpoint", "export"])
def test_values_with_one_side_on_object_storage_equal_the_local_comparison(remote, capsys, side):
    pytest.importorskip("torch")
    _, local = _json(capsys, str(FIXTURES / CKPT), str(HF), "--values")
    ckpt = f"{PREFIXES['s3']}{CKPT}" if side == "checkpoint" else str(FIXTURES / CKPT)
    hf = f"{PREFIXES['s3']}hf/{CKPT}" if side == "export" else str(HF)
    remote.log.clear()
    rc, report = _json(capsys, ckpt, hf, "--values")
    assert rc == 0 and report["values_compared"] == report["expected_tensors"] > 0
    _same(report, local)
    if side == "export":  # every tensor's bytes came over the wire: the whole data buffers, each range once
        data = sum(p.stat().st_size for p in HF.glob("*.safetensors"))
        shard_bytes = sum(r.body_bytes for r in remote.log.gets() if r.key.endswith(".safetensors"))
        assert shard_bytes == data


def test_a_missing_shard_on_object_storage_is_named(remote, capsys):
    rc, report = _json(capsys, str(FIXTURES / CKPT), f"{PREFIXES['s3']}broken/{CKPT}")
    assert rc == 1
    assert [f["shard"] for f in report["findings"] if f["code"] == "shard-missing"] == [
        "model-00002-of-00002.safetensors"
    ]


def test_an_hf_url_that_holds_nothing_is_one_line(remote, capsys):
    interface.forget_stores()
    capsys.readouterr()
    rc = main(["verify-export", str(FIXTURES / CKPT), f"{PREFIXES['s3']}nothing/here"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "s3://" in err


def test_a_bin_export_on_object_storage_is_refused_in_one_line(remote, capsys):
    interface.forget_stores()
    capsys.readouterr()
    rc = main(["verify-export", str(FIXTURES / "core019_tp1"), f"{PREFIXES['s3']}hf_bin/core019_tp1"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "pytorch_model-00001-of-00003.bin" in err and "on object storage is not read" in err
    assert not [r for r in remote.log.gets() if r.key.endswith(".bin")]  # not a byte of it fetched
