"""``ckptdoctor diff`` as diff(1), git diff and h5diff users expect (issue #11): ignores, -q, --stat,
--name-only, complete JSON, one definition of a key, --report, no library warnings."""

from __future__ import annotations

import json
import math
import struct
import warnings

import jsonschema
import pytest
from conftest import FIXTURES, patch_record, run_main, shipped_schema, squash

from ckptdoctor.cli import main

SCHEMA = shipped_schema("diff")
SRC, TP4 = str(FIXTURES / "core019_convert_src_tp1"), str(FIXTURES / "core019_convert_tp4")


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["diff", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys, *args: str) -> tuple[int, dict]:
    rc, out, err = _run(capsys, *args, "--format", "json")
    assert rc in (0, 1), err
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    return rc, report


@pytest.fixture
def other_run(copy_fixture):
    """core016_tp1 saved again by a second run: same model and step, other ``save``/``load`` dirs."""
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.formats.torch_zip import dump_torch_zip

    save = copy_fixture("core016_tp1")
    common = open_checkpoint(save).common_state()
    common["args"].save = "/runs/second/checkpoints"
    common["args"].load = "/runs/second/checkpoints"
    (save / "iter_0000010" / "common.pt").write_bytes(dump_torch_zip(common))
    return str(save)


# --- 1. --ignore-arg, --ignore-layout, [tool.ckptdoctor.diff] --------------------------------------------


def test_ignore_arg_makes_two_runs_equal(capsys, other_run):
    base = str(FIXTURES / "core016_tp1")
    rc, out, _ = _run(capsys, base, other_run)
    assert rc == 1 and "load:" in out and "save:" in out and "differences: 2 args differ" in out
    rc, out, _ = _run(capsys, base, other_run, "--ignore-arg", "save", "--ignore-arg", "load")
    assert rc == 0
    assert "args: 0 differ; 2 ignored (load, save)" in out
    assert out.rstrip().endswith("no differences (ignored: 2 args)")
    rc, out, _ = _run(capsys, base, other_run, "--ignore-arg", "save|load")  # a regex
    assert rc == 0
    rc, out, _ = _run(capsys, base, other_run, "--ignore-arg", "sav")  # full match: 'sav' is not 'save'
    assert rc == 1 and "args: 2 differ" in out
    rc, report = _json(capsys, base, other_run, "--ignore-arg", "save|load")
    assert rc == 0 and report["identical"] and report["args"]["ignored"] == ["load", "save"]
    assert report["ignored"] == {"layout": False, "args": ["save|load"], "strict_args": False}
    assert report["summary"]["args"] == 0


def test_ignore_arg_invalid_regex_exits_2(capsys, other_run):
    rc, _, err = _run(capsys, str(FIXTURES / "core016_tp1"), other_run, "--ignore-arg", "(save")
    assert rc == 2 and "--ignore-arg" in err and "invalid regex" in err


def test_ignore_layout(capsys):
    rc, out, _ = _run(capsys, SRC, TP4, "--section", "model")
    assert rc == 1 and out.rstrip().endswith("differences: 6 keys chunked differently (layout)")
    rc, out, _ = _run(capsys, SRC, TP4, "--section", "model", "--ignore-layout")
    assert rc == 0
    assert "(ignored: --ignore-layout)" in out and "6 keys chunked differently (layout, not content):" in out
    assert out.rstrip().endswith("no differences (ignored: layout (6 keys chunked differently))")
    rc, report = _json(capsys, SRC, TP4, "--section", "model", "--ignore-layout")
    assert rc == 0 and report["identical"] and report["layout"]["count"] == report["summary"]["layout"] == 6


def test_pyproject_diff_table(capsys, monkeypatch, tmp_path, other_run):
    base = str(FIXTURES / "core016_tp1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.ckptdoctor.diff]\nignore-args = ["save", "load"]\nignore-layout = true\n'
    )
    rc, out, _ = _run(capsys, base, other_run)
    assert rc == 0 and out.rstrip().endswith("no differences (ignored: 2 args)")
    rc, out, _ = _run(capsys, SRC, TP4, "--section", "model")
    assert rc == 0 and "ignored: layout" in out
    rc, out, _ = _run(capsys, SRC, TP4, "--section", "model", "--no-ignore-layout")  # the command line wins
    assert rc == 1
    (tmp_path / "pyproject.toml").write_text('[tool.ckptdoctor.diff]\nignore_arg = ["save"]\n')
    rc, _, err = _run(capsys, base, other_run)
    assert rc == 2 and "pyproject.toml" in err and "unknown key 'ignore_arg'" in err
    (tmp_path / "pyproject.toml").write_text('[tool.ckptdoctor.diff]\nignore-layout = "yes"\n')
    rc, _, err = _run(capsys, base, other_run)
    assert rc == 2 and "ignore-layout must be bool" in err


# --- 2. -q, --stat, --name-only ---------------------------------------------------------------------------


def test_quiet_prints_nothing(capsys):
    rc, out, err = _run(capsys, SRC, TP4, "-q")
    assert (rc, out, err) == (1, "", "")
    rc, out, err = _run(capsys, SRC, SRC, "--quiet", "--format", "json")
    assert (rc, out, err) == (0, "", "")


def test_stat(capsys):
    rc, out, _ = _run(capsys, SRC, TP4, "--stat")
    assert rc == 1
    lines = out.splitlines()
    assert lines[0].split() == ["section", "only", "A", "only", "B", "changed", "layout"]
    rows = {line.split()[0]: [int(n) for n in line.split()[1:]] for line in lines[1:] if ":" not in line}
    assert rows["model"] == [0, 0, 0, 6] and rows["optimizer"] == [18, 0, 0, 0]
    assert "args: 8 differ" in lines and "common state and metadata.json: 3 differ" in lines
    assert (
        lines[-1] == "differences: 19 keys only in A, 7 keys chunked differently (layout), 8 args differ, "
        "3 common-state differences"
    )
    rc, _, err = _run(capsys, SRC, TP4, "--stat", "--format", "json")
    assert rc == 2 and "--stat" in err


def test_name_only(capsys):
    rc, out, _ = _run(capsys, SRC, TP4, "--name-only")
    assert rc == 1
    rc2, report = _json(capsys, SRC, TP4)
    expected = {k for s in report["keys"].values() for k in s["only_a"]["keys"] + s["only_b"]["keys"]}
    expected |= {c["key"] for c in report["layout"]["keys"]}
    assert out.splitlines() == sorted(expected) and len(expected) == 19 + 7
    rc, out, _ = _run(capsys, SRC, SRC, "--name-only")
    assert (rc, out) == (0, "")


# --- 3. JSON complete unless --limit; text says what it leaves out ----------------------------------------


def test_json_complete_unless_limit(capsys):
    rc, report = _json(capsys, SRC, TP4)
    opt = report["keys"]["optimizer"]["only_a"]
    assert report["limit"] is None and opt["count"] == len(opt["keys"]) == 18
    rc, report = _json(capsys, SRC, TP4, "--limit", "5")
    opt = report["keys"]["optimizer"]["only_a"]
    assert report["limit"] == 5 and opt["count"] == 18 and len(opt["keys"]) == 5


def test_text_limit_says_how_many_left_out(capsys):
    rc, out, _ = _run(capsys, SRC, TP4)
    assert "    only in A  optimizer." in out and "more not listed" not in out  # 18 <= 20: all listed
    rc, out, _ = _run(capsys, SRC, TP4, "--limit", "5")
    assert "    ... 13 more (--limit N, --all)" in out  # optimizer: 18 keys, 5 listed
    assert "    ... 2 more (--limit N, --all)" in out  # layout: 7 keys, 5 listed
    assert "15 more not listed (at most 5 per list; --limit N, --all)" in out
    rc, out, _ = _run(capsys, SRC, TP4, "--limit", "5", "--all")
    assert "more not listed" not in out


# --- 4. one definition of a key -----------------------------------------------------------------------------


def test_one_definition_of_a_key(capsys):
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.logical_items import logical_items

    rc, report = _json(capsys, str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2"))
    layout = report["layout"]
    assert layout["count"] == report["summary"]["layout"] == len(layout["keys"]) == 20
    rc, out, _ = _run(capsys, str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2"))
    assert "  20 keys chunked differently (layout, not content):" in out
    assert "differences: 20 keys chunked differently (layout)" in out
    for side, name in (("a", "core019_tp1"), ("b", "core019_tp2")):
        ckpt = open_checkpoint(FIXTURES / name)
        assert (
            report[side]["keys"]
            == len(logical_items(ckpt))
            == sum(s["common"] + s[f"only_{side}"]["count"] for s in report["keys"].values())
        )
        assert report[side]["entries"] == len(ckpt.entries)
    # rng_state: one logical key (a ShardedObject), one DCP item per shard at TP=2
    assert report["b"]["entries"] > report["b"]["keys"]


# --- 5. --values --report N, relative difference, norm of the difference ------------------------------------


def test_values_report_first_mismatches(capsys, copy_fixture):
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.formats.archive import parse_archive

    pytest.importorskip("torch")
    save = copy_fixture("core019_tp2")
    ckpt = open_checkpoint(save)
    key = "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc2.weight"
    patched = []
    for chunk, element, delta in ((ckpt.entries[key].chunks[-1], 7, 2.0), (ckpt.entries[key].chunks[0], 3, -1.0)):
        path = ckpt.iteration_dir / chunk.storage.relative_path
        blob = path.read_bytes()[chunk.storage.offset : chunk.storage.offset + chunk.storage.length]
        start = next(m.start for k, m in parse_archive(blob, "chunk").members.items() if "/data/" in k)
        (old,) = struct.unpack_from("<f", blob, start + 4 * element)
        (new,) = struct.unpack("<f", struct.pack("<f", old + delta))
        patch_record(path, chunk.storage, 4 * element, struct.pack("<f", new))  # its CRC-32 rewritten too
        local, rest = [], element  # row-major index of ``element`` inside the chunk
        for size in reversed(chunk.sizes):
            local.insert(0, rest % size)
            rest //= size
        patched.append(([o + i for o, i in zip(chunk.offsets, local)], old, new))
    patched.sort()
    rc, report = _json(capsys, str(FIXTURES / "core019_tp2"), str(save), "--values", "--report", "5")
    assert rc == 1
    (only,) = report["values"]["different_keys"]
    assert only["key"] == key and only["mismatched"] == 2
    assert only["mismatches"] == [
        {"index": idx, "a": pytest.approx(old), "b": pytest.approx(new)} for idx, old, new in patched
    ]
    diffs = [abs(new - old) for _, old, new in patched]
    assert only["norm_diff"] == pytest.approx(math.hypot(*diffs), rel=1e-6)
    assert only["max_rel_diff"] == pytest.approx(max(abs(new - old) / abs(new) for _, old, new in patched), rel=1e-6)
    rc, report = _json(capsys, str(FIXTURES / "core019_tp2"), str(save), "--values", "--report", "1")
    assert [m["index"] for m in report["values"]["different_keys"][0]["mismatches"]] == [patched[0][0]]
    rc, report = _json(capsys, str(FIXTURES / "core019_tp2"), str(save), "--values")
    assert report["values"]["different_keys"][0]["mismatches"] is None  # --report 0: off
    rc, out, _ = _run(capsys, str(FIXTURES / "core019_tp2"), str(save), "--values", "--report", "5")
    assert rc == 1 and "max rel diff" in squash(out) and "norm of diff" in squash(out)
    first = patched[0]
    assert f"    [{', '.join(map(str, first[0]))}]  A " in out
    rc, _, err = _run(capsys, str(FIXTURES / "core019_tp2"), str(save), "--report", "5")
    assert rc == 2 and "--values" in err


def test_values_report_across_layouts(capsys):
    """TP=1 vs TP=2 optimizer state (same-seed runs, ~1e-9 apart): global indexes, in row-major order."""
    pytest.importorskip("torch")
    rc, report = _json(
        capsys,
        str(FIXTURES / "core019_tp1"),
        str(FIXTURES / "core019_tp2"),
        "--values",
        "--section",
        "optimizer",
        "--report",
        "4",
    )
    assert rc == 1
    for r in report["values"]["different_keys"]:
        if r["kind"] != "tensor":
            continue
        assert 0 < len(r["mismatches"]) <= min(4, r["mismatched"])
        indexes = [m["index"] for m in r["mismatches"]]
        assert indexes == sorted(indexes)
        assert all(m["a"] != m["b"] for m in r["mismatches"])
        assert r["norm_diff"] >= r["max_abs_diff"] > 0


# --- 6. no library warnings ---------------------------------------------------------------------------------


def test_library_warnings_silenced(capsys, monkeypatch):
    """torch's 'Failed to initialize NumPy' (and any library warning) is not shown by --values."""
    pytest.importorskip("torch")
    import ckptdoctor.values.read as values

    real = values.require_torch

    def noisy(purpose: str):
        warnings.warn_explicit(
            "Failed to initialize NumPy: _ARRAY_API not found",
            UserWarning,
            "torch/_subclasses/functional_tensor.py",
            276,
            module="torch._subclasses",
        )
        return real(purpose)

    monkeypatch.setattr(values, "require_torch", noisy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc, out, err = _run(capsys, SRC, TP4, "--section", "model", "--values")
    assert rc == 1 and "values (bitwise)" in out
    assert not [w for w in seen if "NumPy" in str(w.message)] and "NumPy" not in err


# --- issue #35 point 12: args one side's core never saved ---------------------------------------------------

GTP_ARGS = [
    "expert_gtp_weight_remat_size",
    "expert_tensor_parallel_num_weight_shards",
    "gtp_weight_remat_size",
    "tensor_parallel_num_weight_shards",
]
ERA_ARGS = sorted([*GTP_ARGS, "cuda_graph_modules", "inference_cuda_graph_scope"])


def _rewrite_args(save, **changes) -> None:
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.formats.torch_zip import dump_torch_zip

    common = open_checkpoint(save).common_state()
    for name, value in changes.items():
        if value is None:
            delattr(common["args"], name)
        else:
            setattr(common["args"], name, value)
    (save / "iter_0000010" / "common.pt").write_bytes(dump_torch_zip(common))


@pytest.fixture
def saved_by_016_and_019(copy_fixture, tmp_path):
    """One training state saved by core 0.16 and by core 0.19. The 0.16 side's args as Megatron-LM 0.16 saves them
    (no GTP weight-shard args: they came with core 0.19); the 0.19 side without its rerun state (0.16 saves none)."""
    old = copy_fixture("core016_tp1")
    _rewrite_args(old, **dict.fromkeys(GTP_ARGS))
    new = tmp_path / "core019_tp1"
    assert main(["edit", "--drop-section", "rerun", str(FIXTURES / "core019_tp1"), "-o", str(new)]) == 0
    return old, new


def test_args_one_sides_core_never_saved_do_not_decide_the_exit_status(capsys, saved_by_016_and_019):
    old, new = saved_by_016_and_019
    same = ("--ignore-arg", "save|load")  # the runs' own dirs
    for a, b, has, lacks in ((old, new, "B", "A"), (new, old, "A", "B")):
        rc, out, _ = _run(capsys, str(a), str(b), *same)
        assert rc == 0, out
        assert f"tensor_parallel_num_weight_shards: 1 (only in {has}; era: {lacks}'s core never saved it)" in out
        assert f"args {', '.join(ERA_ARGS)} only in {has}: first saved by core 0.19, and {lacks}'s core" in out
        assert "args: 0 differ; 2 ignored (load, save); 6 only in the side whose core saves them" in out
        verdict = "no differences (ignored: 2 args, 6 args one side's core never saved (--strict-args))"
        assert out.rstrip().endswith(verdict)
        rc, report = _json(capsys, str(a), str(b), *same)
        assert rc == 0 and report["identical"] and report["args"]["count"] == report["summary"]["args"] == 0
        assert report["args"]["era"] == ERA_ARGS and report["ignored"]["strict_args"] is False
        assert sorted(d["name"] for g in report["args"]["groups"].values() for d in g if d["era"]) == ERA_ARGS
        rc, out, _ = _run(capsys, str(a), str(b), *same, "--strict-args")
        assert rc == 1 and "differences: 6 args differ" in out and "counted as differences (--strict-args)" in out
        rc, report = _json(capsys, str(a), str(b), *same, "--strict-args")
        assert rc == 1 and report["args"]["count"] == 6 and report["ignored"]["strict_args"] is True
    # an arg absent for another reason (not in the era table) still counts
    _rewrite_args(old, seed=None)
    rc, out, _ = _run(capsys, str(old), str(new), *same)
    assert rc == 1 and "seed: 1234 (only in B)" in out and "differences: 1 arg differs" in out


def test_a_key_pattern_that_matches_nothing_is_an_error(capsys):
    """A typo in a CI gate's --key compared nothing and passed (exit 0, "no differences")."""
    a, b = str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2")
    rc, out, err = run_main(capsys, "diff", a, b, "--key", "final_layernorm", "--key", "linear_qvk")
    assert rc == 2 and "--key 'linear_qvk' matches no key of A or B" in err and err.count("\n") == 1, err
    rc, out, err = run_main(capsys, "diff", a, b, "--key", "final_layernorm")
    assert rc in (0, 1) and not err


def test_report_lines_tell_the_two_values_apart():
    from ckptdoctor.render.diff import mismatch_values

    assert mismatch_values(1.0, 1.0000001) == ("1", "1.0000001")
    assert mismatch_values(0.5, 0.25) == ("0.5", "0.25")
    assert mismatch_values(1.0, 1.0 + 2**-52) == ("1.0", "1.0000000000000002")
    assert mismatch_values(3, 4) == ("3", "4")
