"""``diff A B --values --stats`` (issue #38 point 2): ``check --health``'s statistics of two checkpoints side by
side, per key and per layer / expert of stacked keys, with relative change."""

from __future__ import annotations

import csv
import io
import json
import shutil

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


# --- --all-iterations and --format csv ------------------------------------------------------------------------------


@pytest.fixture
def save_dir(tmp_path):
    """A save dir of three iterations made of real fixtures: 5 and 15 the MoE checkpoint, 10 the same with one
    expert zeroed (it moves at 10 and moves back at 15)."""
    save = tmp_path / "save"
    save.mkdir()
    for iteration, source in ((5, MOE), (10, ZERO_EXPERT), (15, MOE)):
        shutil.copytree(source / "iter_0000010", save / f"iter_{iteration:07d}")
    (save / "latest_checkpointed_iteration.txt").write_text("15")
    return save


def _series(capsys, save, *extra: object) -> dict:
    rc, out, err = run_main(capsys, "diff", save, "--values", "--stats", "--all-iterations", "--format", "json", *extra)
    assert rc == 1, err  # rows moved between iterations
    doc = json.loads(out)
    assert doc["schema"] == "ckptdoctor.diff/1"
    jsonschema.Draft202012Validator(shipped_schema("diff")).validate(doc)
    return doc


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_all_iterations_refuses_an_iteration_it_cannot_read_whole(capsys, save_dir, damage):
    """A half-written iteration (a rank's data file missing or cut short) was measured from what was left: its
    missing half showed as the weights moving. As with two checkpoints, it is an error naming the file."""
    data = sorted((save_dir / "iter_0000015").glob("*.distcp"))[-1]
    if damage == "missing":
        data.unlink()
    else:
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    rc, out, err = run_main(capsys, "diff", save_dir, "--values", "--stats", "--all-iterations", "--format", "json")
    assert rc == 2 and "iter_0000015: cannot measure its tensors" in err and data.name in err, err
    assert {"missing": "CKD113", "truncated": "CKD114"}[damage] in err


def test_all_iterations_side_by_side(capsys, save_dir):
    doc = _series(capsys, save_dir)
    assert doc["iterations"] == [5, 10, 15] and doc["save_dir"] == str(save_dir)
    series = doc["series"]
    pair = _stats(capsys, MOE, ZERO_EXPERT)
    assert series["count"] == len(series["rows"]) and series["keys"] >= pair["keys"]
    assert {r["key"] for r in pair["rows"]} <= {r["key"] for r in series["rows"]}
    moved = [row for row in series["rows"] if any(p["equal_previous"] is False for p in row["points"])]
    assert series["changed"] == len(moved) == pair["changed"]
    for row in moved:  # the zeroed expert: to 0 at 10 (-100%), back at 15 (from 0: no ratio), as it was at 5
        assert row["slice"] == {"layer": 0, "expert": 1}
        first, zeroed, back = row["points"]
        assert [p["iteration"] for p in row["points"]] == [5, 10, 15]
        assert (first["l2_change"], first["equal_previous"]) == (None, None)
        assert zeroed["stats"]["l2"] == 0 and zeroed["l2_change"] == -1 and zeroed["equal_previous"] is False
        assert back["stats"] == first["stats"] and back["l2_change"] is None and back["equal_previous"] is False
    for row in series["rows"]:
        if row not in moved:
            assert all(p["equal_previous"] and p["l2_change"] == 0 for p in row["points"][1:]), row["key"]
    # the per-layer table: layer 0 moved at 10 and 15, layer 1 never
    layers = {layer["layer"]: layer for layer in series["layers"]}
    assert set(layers) == {0, 1}
    assert layers[0]["moved"] == [0, len(moved), len(moved)] and layers[1]["moved"] == [0, 0, 0]
    assert layers[0]["l2"][0] == layers[0]["l2"][2] > layers[0]["l2"][1]
    assert layers[0]["l2_change"][0] is None and layers[0]["l2_change"][1] < 0 < layers[0]["l2_change"][2]
    assert layers[1]["l2_change"] == [None, 0, 0]


def test_all_iterations_limit_caps_rows_not_counts(capsys, save_dir):
    full = _series(capsys, save_dir)["series"]
    capped = _series(capsys, save_dir, "--limit", "3")["series"]
    assert capped["rows"] == full["rows"][:3] and capped["count"] == full["count"] > 3
    assert capped["changed"] == full["changed"] and capped["layers"] == full["layers"]


def test_all_iterations_csv_one_row_per_key_and_iteration(capsys, save_dir):
    full = _series(capsys, save_dir)["series"]
    rc, out, err = run_main(capsys, "diff", save_dir, "--values", "--stats", "--all-iterations", "--format", "csv")
    assert rc == 1, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == [
        "key", "layer", "expert", "iteration", "count", "zeros", "min", "max", "mean", "std", "l2", "rel_change"
    ]  # fmt: skip
    assert len(rows) == sum(len(row["points"]) for row in full["rows"]) > 2 * full["count"]
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    zeroed = [r for r in rows if r["layer"] == "0" and r["expert"] == "1" and r["key"] == fc1]
    assert [r["iteration"] for r in zeroed] == ["5", "10", "15"]
    assert [r["rel_change"] for r in zeroed] == ["", "-1.0", ""]  # from 0 at 15: no ratio
    assert zeroed[1]["zeros"] == zeroed[1]["count"] and float(zeroed[1]["l2"]) == 0
    point = next(r for r in full["rows"] if r["key"] == zeroed[0]["key"] and r["slice"] == {"layer": 0, "expert": 1})
    assert float(zeroed[0]["l2"]) == point["points"][0]["stats"]["l2"]  # repr: the JSON's float, exactly


def test_all_iterations_text_has_the_layer_table(capsys, save_dir):
    rc, out, err = run_main(capsys, "diff", save_dir, "--values", "--stats", "--all-iterations")
    assert rc == 1, err
    lines = out.splitlines()
    assert lines[0] == f"save dir {save_dir}: iterations 5, 10, 15"
    start = next(i for i, line in enumerate(lines) if line.startswith("layers "))
    header, layer0, layer1 = (line.split() for line in lines[start + 1 : start + 4])
    assert header == ["layer", "iter", "5", "iter", "10", "iter", "15"]
    assert layer0[0] == "0" and "moved)" in lines[start + 2] and "(0," not in lines[start + 2]
    assert layer1[0] == "1" and lines[start + 3].count("(0, 0/") == 2
    assert lines[-1].strip().startswith("... ") and lines[-1].strip().endswith("more (--limit N, --all)")


def test_two_checkpoints_csv(capsys):
    pair = _stats(capsys, MOE, ZERO_EXPERT)
    rc, out, err = run_main(capsys, "diff", MOE, ZERO_EXPERT, "--values", "--stats", "--format", "csv")
    assert rc == 1, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 2 * pair["count"]
    assert [r["iteration"] for r in rows[:4]] == ["A", "B", "A", "B"]
    first = pair["rows"][0]
    assert rows[1]["key"] == first["key"] and float(rows[1]["rel_change"]) == first["l2_change"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--values", "--all-iterations"), "needs --values --stats"),
        (("--values", "--stats", "--all-iterations", "B"), "no CHECKPOINT_B"),
        (("--values", "--stats"), "Missing argument 'CHECKPOINT_B'"),
        (("--values", "--format", "csv", "B"), "needs --values --stats"),
    ],
)
def test_all_iterations_and_csv_usage(capsys, save_dir, args, message):
    rc, out, err = run_main(capsys, "diff", save_dir, *[MOE if a == "B" else a for a in args])
    assert rc == 2 and message in err


# --- one read: the value comparison measures what it reads -----------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [(MOE, ZERO_EXPERT), (TP1, TP4), (FIXTURES / "core019_tp2", FIXTURES / "core019_tp1")],
)
def test_stats_in_the_values_read_equal_check_health_pass(capsys, monkeypatch, a, b):
    """--values --stats measures the chunks as the value comparison reads them: check --health's own pass is not
    run, and every row equals what that pass gives (forced here by a tap that measures nothing)."""
    from ckptdoctor.ops.diff import stats as diff_stats
    from ckptdoctor.values.health_tap import HealthTap

    real_scan = diff_stats.health_scan

    def no_second_read(*args, **kwargs):
        raise AssertionError("check --health's pass ran: the data was read twice")

    monkeypatch.setattr(diff_stats, "health_scan", no_second_read)
    one_read = _stats(capsys, a, b, "--jobs", "1")
    monkeypatch.setattr(diff_stats, "health_scan", real_scan)

    def missed(self, side, *args):
        self.missed[side] = True

    monkeypatch.setattr(HealthTap, "add", missed)
    assert _stats(capsys, a, b, "--jobs", "1") == one_read


def test_crowded_small_slices_are_measured_whole_in_both_reads(capsys, monkeypatch, tmp_path):
    """Past the checkpoint's budget of small slices a stacked key is one row, and the value comparison's read and
    check --health's pass (forked workers) agree on which keys: the budget is a function of the metadata."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckptdoctor.values import health
    from ckptdoctor.values.health_tap import HealthTap

    monkeypatch.setattr(health, "MAX_SMALL_SLICES", 64)
    generator = torch.Generator().manual_seed(0)
    state = {
        f"decoder.layers.{name}.weight": torch.randn(40, 8, generator=generator).to(torch.bfloat16)
        for name in ("input_layernorm", "pre_mlp_layernorm")  # 40 + 40 small slices: the second is crowded
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    one_read = _stats(capsys, tmp_path / "a", tmp_path / "b", "--jobs", "1")
    rows: dict[str, list[dict]] = {}
    for row in one_read["rows"]:
        rows.setdefault(row["key"], []).append(row["slice"])
    assert rows["decoder.layers.input_layernorm.weight"] == [{"layer": layer} for layer in range(40)]
    assert rows["decoder.layers.pre_mlp_layernorm.weight"] == [{}]

    def missed(self, side, *args):
        self.missed[side] = True

    monkeypatch.setattr(HealthTap, "add", missed)  # check --health's own pass instead, in two processes
    assert _stats(capsys, tmp_path / "a", tmp_path / "b", "--jobs", "2") == one_read
