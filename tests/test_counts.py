"""Counts say what inspect and diff count (issue #35 item 8): logical keys first, DCP entries beside them; a write
reports as linked every file it hard-linked. Big plans are summarised by reason unless ``--keys`` (item 14)."""

from __future__ import annotations

import json
import os
import re

from conftest import FIXTURES

from ckptdoctor.cli import main

PEFT = FIXTURES / "core019_peft_full_tp1"


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_strip_frozen_counts_logical_keys_as_inspect_does(capsys):
    rc, out, _ = _run(capsys, "inspect", PEFT, "--format", "json")
    model = json.loads(out)["sections"]["model"]
    rc, text, err = _run(capsys, "strip-frozen", PEFT)
    assert rc == 0, err
    match = re.search(
        r"model section   (\d+) keys \((\d+) entries\) kept .*, (\d+) keys \((\d+) entries\) dropped", text
    )
    assert match, text
    kept_keys, kept_entries, dropped_keys, dropped_entries = map(int, match.groups())
    assert kept_keys + dropped_keys == model["keys"] == 21  # as inspect counts them: a sharded object is one key
    assert kept_entries + dropped_entries == model["entries"] == 29
    assert dropped_keys < dropped_entries  # the _extra_state objects are saved in two shards each


def test_dry_run_summarises_by_reason_and_lists_keys_when_asked(capsys):
    rc, text, _ = _run(capsys, "strip-frozen", PEFT, "--dry-run")
    assert rc == 0 and "(--keys lists every key)" in text
    assert "decoder.layers.self_attention.linear_qkv.weight" not in text
    assert re.search(r"^drop\s+\d+ keys \(\d+ entries\)\s+\S+ \S+\s+frozen \(optimizer\)$", text, re.M), text
    rc, text, _ = _run(capsys, "strip-frozen", PEFT, "--dry-run", "--keys")
    assert "decoder.layers.self_attention.linear_qkv.weight" in text and "--keys lists" not in text
    rc, text, _ = _run(capsys, "edit", FIXTURES / "core019_tp2", "--remove", r"^optimizer\.")
    assert re.search(r"^remove\s+18 keys \(18 entries\)", text, re.M), text
    rc, text, _ = _run(capsys, "edit", FIXTURES / "core019_tp2", "--remove", r"^optimizer\.", "--keys")
    assert "optimizer.state.exp_avg.decoder.final_layernorm.weight" in text


def test_fix_args_counts_every_hard_link(capsys, tmp_path):
    out_dir = tmp_path / "out"
    rc, text, err = _run(capsys, "fix-args", FIXTURES / "core019_convert_tp4", "-o", out_dir)
    assert rc == 0, err
    linked = int(re.search(r"(\d+) linked", text).group(1))
    hard_links = [p for p in out_dir.rglob("*") if p.is_file() and os.stat(p).st_nlink > 1]
    assert linked == len(hard_links) == 5  # 4 data files and metadata.json
