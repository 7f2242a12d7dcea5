"""``diff A B --values --stats`` (issue #38 point 2): ``check --health``'s statistics of two checkpoints side by
side, per key and per layer / expert of stacked keys, with relative change."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import FIXTURES, run_main, shipped_schema

from ckptdoctor import numpy_lazy

pytest.importorskip("numpy")

TP1 = FIXTURES / "core019_convert_src_tp1"
TP4 = FIXTURES / "core019_convert_tp4"  # TP1 resharded to TP4 by megatron-core: the same weights
MOE = FIXTURES / "core019_moe_ep2"
ZERO_EXPERT = FIXTURES / "core019_moe_zero_expert_ep2"  # MOE with one expert's weights zeroed


def _stats(capsys, a, b, *extra: object) -> dict:
    rc, out, err = run_main(capsys, "diff", a, b, "--values", "--stats", "--format", "json", *extra)
    assert rc in (0, 1), err
    doc = json.loads(out)
    jsonschema.Draft202012Validator(shipped_schema("diff")).validate(doc)
    return doc["stats"]


def test_resharded_checkpoint_has_equal_statistics(capsys):
    stats = _stats(capsys, TP1, TP4)
    assert stats["keys"] > 0 and stats["count"] == len(stats["rows"]) >= stats["keys"]
    assert stats["changed"] == 0
    for row in stats["rows"]:
        assert row["equal"] and row["a"] == row["b"], row["key"]
        assert (row["l2_change"], row["std_change"], row["mean_change"]) == (0, 0, 0), row["key"]
    # stacked keys get one row per layer
    assert any(row["slice"].get("layer") == 1 for row in stats["rows"])


def test_zeroed_expert_shows_in_its_slice_only(capsys):
    stats = _stats(capsys, MOE, ZERO_EXPERT)
    moved = [row for row in stats["rows"] if not row["equal"]]
    assert moved and stats["changed"] == len(moved)
    assert {tuple(sorted(row["slice"].items())) for row in moved} == {(("expert", 1), ("layer", 0))}
    for row in moved:
        assert "experts.experts." in row["key"]
        assert row["b"]["zeros"] == row["b"]["count"] > row["a"]["zeros"]
        assert row["b"]["l2"] == 0 and row["l2_change"] == -1 and row["std_change"] == -1
    assert stats["rows"][: len(moved)] == moved  # the largest change first
    for row in stats["rows"][len(moved) :]:
        assert row["a"] == row["b"] and row["l2_change"] == row["std_change"] == row["mean_change"] == 0
    # the other experts of the same key are rows of their own, unchanged
    of_key = [r for r in stats["rows"] if r["key"] == moved[0]["key"]]
    assert len({r["slice"]["expert"] for r in of_key}) > 1
    assert sum(not r["equal"] for r in of_key) == 1


def test_json_limit_caps_rows_not_counts(capsys):
    full = _stats(capsys, MOE, ZERO_EXPERT)
    capped = _stats(capsys, MOE, ZERO_EXPERT, "--limit", "3")
    assert len(capped["rows"]) == 3 and capped["count"] == full["count"] > 3
    assert capped["rows"] == full["rows"][:3] and capped["changed"] == full["changed"]


def test_text_table_is_bounded(capsys):
    full = _stats(capsys, MOE, ZERO_EXPERT)
    rc, out, _ = run_main(capsys, "diff", MOE, ZERO_EXPERT, "--values", "--stats", "--limit", "4")
    assert rc == 1
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stats "))
    assert (
        f"{full['keys']} keys in {full['count']} rows" in lines[start] and f"{full['changed']} changed" in lines[start]
    )
    header, *rows = lines[start + 1 : start + 6]
    assert header.split()[:3] == ["key", "slice", "L2"]
    assert rows[0].split()[:5] == [full["rows"][0]["key"], "layer", "0", "expert", "1"]
    assert rows[0].split()[-1] == "moved" and "-100%" in rows[0]
    assert all(row.split()[-1] == "same" for row in rows[len([r for r in full["rows"][:4] if not r["equal"]]) :])
    assert lines[start + 6].strip() == f"... {full['count'] - 4} more (--limit N, --all)"
    rc, out, _ = run_main(capsys, "diff", MOE, ZERO_EXPERT, "--values", "--stats", "--all")
    assert sum(line.rstrip().endswith((" same", " moved")) for line in out.splitlines()) == full["count"]


def test_default_text_limit(capsys):
    rc, out, _ = run_main(capsys, "diff", MOE, ZERO_EXPERT, "--values", "--stats")
    assert sum(line.rstrip().endswith((" same", " moved")) for line in out.splitlines()) == 20


def test_stats_needs_values(capsys):
    rc, out, err = run_main(capsys, "diff", MOE, ZERO_EXPERT, "--stats")
    assert rc == 2 and "--stats" in err and "needs --values" in err


def test_stats_without_numpy_is_one_clear_line(capsys, monkeypatch):
    monkeypatch.setattr(numpy_lazy, "_NUMPY", [None])
    rc, out, err = run_main(capsys, "diff", MOE, ZERO_EXPERT, "--values", "--stats")
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [
        "ckptdoctor: error: diff --stats (tensor statistics) needs the 'numpy' package, which is not installed: "
        "pip install 'ckptdoctor[torch]'"
    ]


def test_without_stats_json_has_no_stats(capsys):
    rc, out, _ = run_main(capsys, "diff", MOE, ZERO_EXPERT, "--values", "--format", "json")
    assert "stats" not in json.loads(out)
