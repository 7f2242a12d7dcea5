"""``ckptdoctor show CKPT KEY``: metadata and chunk grid without torch; statistics, slice and export with it."""

from __future__ import annotations

import io
import json
import math
import struct
import subprocess
import sys
import zipfile
import zlib

import pytest
from conftest import FIXTURES, run_cli

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.cli import main

KEY = "decoder.layers.self_attention.linear_qkv.weight"
CKPT = FIXTURES / "core019_tp2"


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_metadata_and_chunk_grid_without_torch():
    result = run_cli("show", str(CKPT), KEY, block=("torch", "megatron"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "global shape    2x96x32   (6,144 elements)" in out
    assert "chunk grid      2 x 2 x 1 (chunks per axis)" in out
    assert "__1_0.distcp" in out and "statistics need torch" in out
    assert "IMPORTED:\n" in result.stderr  # neither torch nor megatron was imported
    result = run_cli("show", str(CKPT), KEY, "--stats", block=("torch", "megatron"))
    assert result.returncode == 2 and "pip install" in result.stderr


def test_statistics_and_slice_match_torch(capsys):
    torch = pytest.importorskip("torch")
    from ckptdoctor.values.read import read_tensor

    full = read_tensor(open_checkpoint(CKPT), KEY)
    rc, out, _ = _run(capsys, "show", CKPT, KEY, "--slice", "0,:4,:4", "--format", "json")
    assert rc == 0
    report = json.loads(out)
    assert report["schema"] == "ckptdoctor.show/1" and report["grid"] == [2, 2, 1] and len(report["chunks"]) == 4
    stats = report["stats"]
    assert stats["nan"] == stats["posinf"] == stats["neginf"] == 0 and stats["finite"] == full.numel()
    assert math.isclose(stats["min"], float(full.min())) and math.isclose(stats["max"], float(full.max()))
    assert math.isclose(stats["mean"], float(full.double().mean()), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(stats["std"], float(full.double().std(unbiased=False)), rel_tol=1e-6)
    assert report["slice"]["shape"] == [4, 4]
    assert torch.equal(torch.tensor(report["slice"]["values"]), full[0, :4, :4])
    rc, out, _ = _run(capsys, "show", CKPT, KEY, "--slice", "0,:2,:3")
    assert rc == 0 and "slice [0,:2,:3]  shape 2x3" in out and "min " in out and "nan 0" in out


def test_nan_and_inf_are_counted(capsys, copy_fixture):
    pytest.importorskip("torch")
    from ckptdoctor.values.read import read_chunk

    save = copy_fixture("core019_tp2")
    ckpt = open_checkpoint(save)
    chunk = ckpt.entries[KEY].chunks[0]
    first = read_chunk(ckpt, KEY, 0).reshape(-1)[:2].tolist()
    path = ckpt.iteration_dir / chunk.storage.relative_path
    blob = bytearray(path.read_bytes())
    region = blob[chunk.storage.offset : chunk.storage.offset + chunk.storage.length]
    at = bytes(region).index(struct.pack("<2f", *first))
    region[at : at + 8] = struct.pack("<2f", math.nan, -math.inf)
    # keep the zip member's CRC-32 right (the reader checks it): a NaN a training wrote, not a flipped byte
    with zipfile.ZipFile(io.BytesIO(bytes(region))) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
        name_len, extra_len = struct.unpack_from("<HH", region, info.header_offset + 26)
        start = info.header_offset + 30 + name_len + extra_len
    new_crc = zlib.crc32(bytes(region[start : start + info.compress_size]))
    region = bytearray(bytes(region).replace(struct.pack("<I", info.CRC), struct.pack("<I", new_crc)))
    blob[chunk.storage.offset : chunk.storage.offset + chunk.storage.length] = region
    path.write_bytes(bytes(blob))
    rc, out, err = _run(capsys, "show", save, KEY, "--format", "json")
    assert rc == 0, err
    stats = json.loads(out)["stats"]
    assert stats["nan"] == 1 and stats["neginf"] == 1 and stats["finite"] == 6144 - 2
    rc, out, _ = _run(capsys, "show", save, KEY)
    assert "nan 1   +inf 0   -inf 1" in out


def test_save_pt_and_npy(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    from ckptdoctor.values.read import read_tensor

    full = read_tensor(open_checkpoint(CKPT), KEY)
    rc, out, _ = _run(capsys, "show", CKPT, KEY, "--save", tmp_path / "t.pt", "--no-stats")
    assert rc == 0 and f"saved           {tmp_path / 't.pt'}" in out
    assert torch.equal(torch.load(tmp_path / "t.pt"), full)
    rc, _, _ = _run(capsys, "show", CKPT, KEY, "--slice", "1,:5", "--save", tmp_path / "s.npy")
    assert rc == 0
    assert np.array_equal(np.load(tmp_path / "s.npy"), full[1, :5].numpy())
    rc, _, err = _run(capsys, "show", CKPT, KEY, "--save", tmp_path / "s.npy")
    assert rc == 2 and "--force" in err
    rc, _, err = _run(capsys, "show", CKPT, KEY, "--save", tmp_path / "s.txt")
    assert rc == 2 and ".pt or .npy" in err


def test_errors(capsys):
    rc, _, err = _run(capsys, "show", CKPT, KEY.replace("qkv", "qkvv"))
    assert rc == 2 and f"did you mean '{KEY}'" in err
    rc, _, err = _run(capsys, "show", CKPT, KEY, "--slice", "0,x")
    assert rc == 2 and "--slice" in err
    rc, _, err = _run(capsys, "show", CKPT, KEY, "--slice", "0,0,0,0")
    assert rc == 2 and "indices" in err
    extra = next(k for k, e in open_checkpoint(CKPT).entries.items() if e.kind != "tensor")
    rc, out, _ = _run(capsys, "show", CKPT, extra)
    assert rc == 0 and "kind bytes" in out
    rc, _, err = _run(capsys, "show", CKPT, extra, "--slice", "0")
    assert rc == 2 and "not a tensor" in err


# --- issue #35 point 11 ------------------------------------------------------------------------------------


def test_logical_keys_diff_prints_are_shown(capsys):
    """`diff` and `inspect` name a ShardedObject by its logical key (`rng_state`); `show` takes that key too."""
    rc, out, _ = _run(capsys, "diff", FIXTURES / "core019_tp1", CKPT)
    assert "rng_state: 1 shard of [1, 1] -> 2 shards of [1, 2]" in out
    rc, out, err = _run(capsys, "show", CKPT, "rng_state")
    assert rc == 0 and err == "", err
    assert "key             rng_state" in out and "kind object" in out and "shard grid      1x2" in out
    assert "rng_state/shard_0.0_1.2, rng_state/shard_0.1_1.2" in out and "in 2 shard(s)" in out
    rc, out, _ = _run(capsys, "show", CKPT, "rng_state", "--format", "json")
    report = json.loads(out)
    assert rc == 0 and report["kind"] == "object" and report["shape"] == [1, 2]
    assert [c["offsets"] for c in report["chunks"]] == [[0, 0], [0, 1]]
    assert all(c["file"].endswith(".distcp") and c["length"] > 0 for c in report["chunks"])
    rc, _, err = _run(capsys, "show", CKPT, "rng_state", "--stats")
    assert rc == 2 and "rng_state is a sharded object, not a tensor" in err


def test_a_key_suffix_suggests_the_keys_it_ends(capsys):
    rc, _, err = _run(capsys, "show", CKPT, "linear_qkv.weight")
    assert rc == 2 and err.count("\n") == 1
    assert f"did you mean '{KEY}', 'optimizer.state.exp_avg.{KEY}', 'optimizer.state.exp_avg_sq.{KEY}'?" in err
    rc, _, err = _run(capsys, "show", CKPT, "weight")
    assert rc == 2 and "did you mean 'output_layer.weight'" in err and "more ending so" in err


def test_torchs_numpy_warning_is_not_shown(tmp_path):
    """torch warns "Failed to initialize NumPy" when numpy is missing; `diff` hid it, `show` printed it."""
    pytest.importorskip("torch")
    code = (
        "import sys\n"
        "class NoNumpy:\n"  # numpy not installed, as torch sees it (ModuleNotFoundError)
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'numpy':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoNumpy())\n"
        "from ckptdoctor.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    for args in (["show", str(CKPT), KEY], ["show", str(CKPT), KEY, "--save", str(tmp_path / "t.pt")]):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "min " in proc.stdout, proc.stderr
        assert "NumPy" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
