"""Seeded corruption of real fixtures: every command ends with a clean exit code, never an internal error.

Truncations, random byte flips and overwritten runs of bytes in `.metadata`, `common.pt`, `.distcp` files and
legacy zarr files. A corrupt checkpoint may be reported (exit 1/2) or, where the damage is in bytes the command
does not read, pass (exit 0); what must never happen is an exception escaping as "internal error".
"""

from __future__ import annotations

import importlib
import importlib.util
import random
import re
import shutil

import pytest
from conftest import FIXTURES

from ckptdoctor.cli import main

ONE_LINE_ERROR = re.compile(r"ckptdoctor: error: [^\n]*\S[^\n]*\n")
TARGETS = [
    ("core019_tp2", ".metadata"),
    ("core016_tp1", "common.pt"),
    ("core019_tp1", "__0_0.distcp"),
    ("core015_tp2", ".metadata"),
    ("core014_zarr_tp2", "embedding.word_embeddings.weight/.zarray"),
    ("core014_zarr_tp2", "embedding.word_embeddings.weight/0.0"),
]


def _corrupt(data: bytes, rng: random.Random, trial: int) -> bytes:
    if trial % 3 == 0:
        return data[: rng.randrange(0, len(data))]
    buf = bytearray(data)
    if trial % 3 == 1:
        for _ in range(rng.randint(1, 20)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    else:
        at = rng.randrange(len(buf))
        buf[at : at + 8] = bytes(rng.randrange(256) for _ in range(8))
    return bytes(buf)


@pytest.mark.parametrize("fixture,target", TARGETS)
def test_corrupted_fixture_never_raises(tmp_path, capsys, fixture, target):
    if importlib.util.find_spec("torch") is not None:
        # diff --values imports torch where values differ: here, once, not in the forked workers of every
        # trial's diff (~4 s each on 2 cores; the workers inherit it)
        importlib.import_module("torch")
    rng = random.Random(f"{fixture}/{target}")
    source = FIXTURES / fixture
    data = (source / "iter_0000010" / target).read_bytes()
    copy = tmp_path / fixture  # one copy: every command here only reads, so each trial rewrites the one file
    shutil.copytree(source, copy)
    names = sorted(p.name for p in copy.rglob("*"))
    for trial in range(12):
        (copy / "iter_0000010" / target).write_bytes(_corrupt(data, rng, trial))
        commands = [
            ["inspect", str(copy), "--format", "json"],
            ["check", str(copy), "--deep", "--isolated"],
            ["fix-args", str(copy)],
            ["diff", str(copy), str(source), "--values", "--quiet"],
        ]
        for command in commands:
            rc = main(command)
            err = capsys.readouterr().err
            assert rc in (0, 1, 2), (command, trial, rc, err)
            assert "internal error" not in err and "Traceback" not in err, (command, trial, err)
            if rc == 2:  # a clean error: exactly one line naming what is wrong (internal errors exit 2 too)
                assert ONE_LINE_ERROR.fullmatch(err), (command, trial, err)
        assert sorted(p.name for p in copy.rglob("*")) == names, trial  # nothing written beside the damage
