"""``check --deep`` / ``--health`` on a legacy zarr checkpoint (megatron-core 0.14's ``zarr`` backend): its chunk
files are raw row-major elements, read for NaN/Inf (CKD313) and statistics like torch_dist's chunks."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run_main

np = pytest.importorskip("numpy")

ZARR = FIXTURES / "core014_zarr_tp2"
ITER = ZARR / "iter_0000010"
FC1 = "decoder.layers.mlp.linear_fc1.weight"


def _run(capsys, *args: str) -> tuple[int, str]:
    from ckptdoctor.cli import main

    rc = main(list(args))
    return rc, capsys.readouterr().out


def _whole_array(array_dir: Path) -> np.ndarray:
    """The array assembled from its chunk files by the zarr v2 rules (C order, no compressor), here in the test."""
    meta = json.loads((array_dir / ".zarray").read_text())
    out = np.empty(meta["shape"], dtype=np.dtype(meta["dtype"]))
    chunks = meta["chunks"]
    for chunk_file in array_dir.iterdir():
        if chunk_file.name.startswith("."):
            continue
        grid = [int(g) for g in chunk_file.name.split(".")]
        where = tuple(slice(g * c, g * c + c) for g, c in zip(grid, chunks))
        out[where] = np.frombuffer(chunk_file.read_bytes(), dtype=out.dtype).reshape(chunks)
    return out


def test_health_gives_every_zarr_arrays_statistics(capsys):
    rc, out = _run(capsys, "check", "--isolated", "--health", "--format", "json", str(ZARR))
    assert rc == 0
    keys = {k["key"]: k for k in json.loads(out)["health"][0]["keys"]}
    arrays = [d for d in ITER.iterdir() if (d / ".zarray").is_file() and not d.name.endswith("_extra_state")]
    assert arrays and set(keys) >= {d.name for d in arrays}
    for array_dir in arrays:
        values = _whole_array(array_dir).astype(np.float64)
        stats = keys[array_dir.name]
        assert stats["count"] == values.size
        assert stats["zeros"] == int((values == 0).sum())
        assert stats["min"] == values.min() and stats["max"] == values.max()
        assert stats["mean"] == pytest.approx(values.mean(), rel=1e-12, abs=1e-15)
        assert stats["std"] == pytest.approx(values.std(), rel=1e-9, abs=1e-15)


def test_deep_finds_a_nan_in_a_zarr_chunk(capsys, tmp_path):
    import shutil

    copy = tmp_path / "zarr"
    shutil.copytree(ZARR, copy)
    chunk = copy / "iter_0000010" / FC1 / "1.2.0"
    data = bytearray(chunk.read_bytes())
    data[8:12] = struct.pack("<f", float("nan"))
    chunk.write_bytes(bytes(data))
    rc, out = _run(capsys, "check", "--isolated", "--deep", str(copy))
    assert rc == 1
    assert "CKD313" in out and FC1 in out, out
    rc, out = _run(capsys, "check", "--isolated", str(copy))  # without --deep no value is read
    assert rc == 0, out
    rc, out = _run(capsys, "check", "--isolated", "--deep", str(ZARR))
    assert rc == 0, out


def test_a_zarr_sharded_object_decodes_as_its_torch_dist_twin(capsys):
    """megatron-core saves a rank's rng state [dict] as torch.save([[dict]]) in a DCP record and as torch.save([dict])
    in a legacy zarr save's object file; both load as [dict]. One unwrap too many made zarr vs torch_dist differ."""
    decoded = {}
    for name in ("core014_zarr_tp2", "core015_tp2"):
        rc, out, err = run_main(capsys, "show", FIXTURES / name, "rng_state", "--decode", "--format", "json")
        assert rc == 0, err
        value = json.loads(out)["decoded"]
        decoded[name] = next(iter(value.values())) if isinstance(value, dict) else value
    for value in decoded.values():
        assert isinstance(value, list) and len(value) == 1 and "random_rng_state" in value[0], value
    rc, out, err = run_main(
        capsys, "diff", FIXTURES / "core014_zarr_tp2", FIXTURES / "core015_tp2", "--values", "--section", "rng"
    )
    assert "bytes and decoded objects differ" not in out and "1 equal, 0 differ" in out, out
