"""``ckptdoctor diff`` on the real megatron-core fixtures and on copies changed in the test."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, manifest, patch_record, run_cli, shipped_schema

from ckptdoctor.cli import main

SCHEMA = shipped_schema("diff")
# Same weights, different TP: the TP=4/TP=1 pairs were made by loading the TP=1 save into a TP=4 model and
# saving (fixtures/generate.py --convert-from); core019_tp1/_tp2 are same-seed runs whose model weights are
# identical after one step (the optimizer state differs by ~1e-9, reduction order).
SAME_WEIGHTS = [
    ("core019_tp1", "core019_tp2"),
    ("core019_convert_src_tp1", "core019_convert_tp4"),
    ("core019_convert_tp4", "core019_convert_src_tp1"),
    ("core016_convert_src_tp1", "core016_convert_tp4"),
]


def _diff(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["diff", *args, "--format", "json"])
    out, err = capsys.readouterr()
    assert rc in (0, 1), err
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    return rc, report


def _only(report: dict, side: str) -> dict[str, list[str]]:
    return {s: v[side]["keys"] for s, v in report["keys"].items() if v[side]["count"]}


def _model_keys(name: str) -> set[str]:
    return {
        k
        for k in manifest(name)["keys"]
        if not k.startswith(("optimizer.", "rng_state", "rerun_state", "common_state"))
    }


@pytest.mark.parametrize("a,b", SAME_WEIGHTS)
def test_same_weights_other_tp_is_layout_only_and_values_equal(capsys, a, b):
    pytest.importorskip("torch")
    rc, report = _diff(capsys, str(FIXTURES / a), str(FIXTURES / b), "--section", "model", "--values", "--all")
    assert rc == 1  # layout differs
    assert not _only(report, "only_a") and not _only(report, "only_b")
    assert report["changed"] == []
    assert report["keys"]["model"]["common"] == len(_model_keys(a)) == len(_model_keys(b))
    layout = report["layout"]
    tp_a, tp_b = manifest(a)["tp"], manifest(b)["tp"]
    assert (
        layout["summary"] == f"A: TP={tp_a} PP=1 ({tp_a} writer{'s' * (tp_a > 1)})  "
        f"B: TP={tp_b} PP=1 ({tp_b} writer{'s' * (tp_b > 1)})"
    )
    assert layout["differs"] and layout["count"] > 0
    assert all(k["section"] == "model" for k in layout["keys"])
    values = report["values"]
    assert values["mode"] == "bitwise"
    assert values["compared"] == values["equal"] == len(_model_keys(a))
    assert values["different"] == 0 and values["not_compared"] == 0 and values["max_abs_diff"] == 0.0
    s = report["summary"]
    assert s["only_a"] == s["only_b"] == s["changed"] == s["values_different"] == 0 and s["layout"] > 0


def test_each_chunk_is_read_once_across_layouts(capsys):
    """Streaming: every chunk of A and of B is read exactly once, even where one B chunk spans many A chunks."""
    pytest.importorskip("torch")
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.ops.diff.compare import KeyFilter, diff_checkpoints

    a = open_checkpoint(FIXTURES / "core019_convert_tp4")
    b = open_checkpoint(FIXTURES / "core019_convert_src_tp1")
    from ckptdoctor.progress import Progress

    class Seen(Progress):
        def __init__(self) -> None:
            self.phases: list[tuple[str, int]] = []
            self.steps: list[int] = []
            self.finished = 0

        def start(self, label: str, total_bytes: int) -> None:
            self.phases.append((label, total_bytes))

        def advance(self, nbytes: int) -> None:
            self.steps.append(nbytes)

        def finish(self) -> None:
            self.finished += 1

    seen = Seen()
    report = diff_checkpoints(a, b, KeyFilter(sections=("model",)), values=True, progress=seen)
    model_bytes = [sum(e.nbytes for e in c.entries.values() if e.section == "model") for c in (a, b)]
    assert report.values.bytes_read == {"a": model_bytes[0], "b": model_bytes[1]}
    assert seen.phases == [("reading values", sum(model_bytes))] and seen.finished == 1
    assert sum(seen.steps) == sum(model_bytes) and min(seen.steps) > 0
    largest = max(
        c.storage.length for ckpt in (a, b) for e in ckpt.entries.values() if e.section == "model" for c in e.chunks
    )
    assert report.values.workers == 2 and 0 < report.values.peak_in_flight <= 3 * largest


def test_optimizer_state_within_tolerance(capsys):
    pytest.importorskip("torch")
    fixture_a, fixture_b = str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2")
    _, bitwise = _diff(capsys, fixture_a, fixture_b, "--section", "optimizer", "--values")
    values = bitwise["values"]
    assert values["different"] > 0 and 0 < values["max_abs_diff"] < 1e-6
    assert all(r["mismatched"] > 0 and r["max_abs_diff"] > 0 for r in values["different_keys"])
    _, tolerant = _diff(
        capsys, fixture_a, fixture_b, "--section", "optimizer", "--values", "--atol", str(values["max_abs_diff"])
    )
    assert tolerant["values"]["mode"] == "tolerance" and tolerant["values"]["different"] == 0
    assert tolerant["values"]["max_abs_diff"] == values["max_abs_diff"]


class _RawBytes:
    """A DCP load planner keeping bytes items raw (DefaultLoadPlanner would torch.load them)."""

    @staticmethod
    def make():
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        class RawBytes(DefaultLoadPlanner):
            def load_bytes(self, read_item, value):
                buffer = self.state_dict[read_item.dest_index.fqn]
                buffer.write(value.read())
                buffer.seek(0)

        return RawBytes(flatten_state_dict=False)


def _rewrite_with_dcp(source: Path, dest: Path, change) -> None:
    """Load every item of ``source`` with PyTorch DCP, apply ``change`` to the state, save it to ``dest``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckptdoctor.checkpoint import open_checkpoint

    ckpt = open_checkpoint(source)
    state = {
        key: torch.empty(e.shape, dtype=getattr(torch, e.dtype.removeprefix("torch.")))
        if e.kind == "tensor"
        else io.BytesIO()
        for key, e in ckpt.entries.items()
    }
    with pytest.warns(UserWarning):  # "torch.distributed ... uninitialized": single process, as intended
        dcp.load(state, checkpoint_id=str(ckpt.iteration_dir), planner=_RawBytes.make(), no_dist=True)
    change(state)
    out = dest / ckpt.iteration_dir.name
    out.mkdir(parents=True)
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=str(out), planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    shutil.copy(ckpt.iteration_dir / "metadata.json", out / "metadata.json")
    if (ckpt.iteration_dir / "common.pt").exists():
        shutil.copy(ckpt.iteration_dir / "common.pt", out / "common.pt")
    (dest / "latest_checkpointed_iteration.txt").write_text(ckpt.iteration_dir.name.removeprefix("iter_").lstrip("0"))


@pytest.mark.parametrize("name", ["core019_tp1", "core016_tp2"])
def test_one_tensor_changed_through_dcp(capsys, tmp_path, name):
    pytest.importorskip("torch")
    key = "decoder.layers.self_attention.linear_proj.weight"
    delta = {}

    def change(state):
        before = state[key].clone()
        state[key][1, 3, 5] += 0.3
        state[key][0, 0, 0] -= 1.7
        delta["max"] = float((state[key].double() - before.double()).abs().max())

    _rewrite_with_dcp(FIXTURES / name, tmp_path / "changed", change)
    rc, report = _diff(capsys, str(FIXTURES / name), str(tmp_path / "changed"), "--values")
    assert rc == 1
    assert not _only(report, "only_a") and not _only(report, "only_b") and report["changed"] == []
    assert report["args"]["count"] == 0 and report["common"]["count"] == 0
    values = report["values"]
    assert [r["key"] for r in values["different_keys"]] == [key]
    (only,) = values["different_keys"]
    assert only["max_abs_diff"] == pytest.approx(delta["max"], rel=0, abs=0) and only["mismatched"] == 2
    assert values["not_compared"] == 0
    assert (
        values["equal"]
        == values["compared"] - 1
        == sum(v["common"] for v in report["keys"].values()) - 1 - (1 if name.startswith("core019") else 0)
    )  # the common_state item is compared as common state
    assert values["bytes_read"]["a"] > 0 and values["bytes_read"]["b"] > 0  # both sides' values were decoded


def _patch_element(path: Path, chunk, element: int, add: float, crc: bool = True) -> tuple[float, float]:
    """Add ``add`` to fp32 element ``element`` of ``chunk``'s record in its data file, in place; with ``crc`` the
    record's CRC-32 is rewritten too (as a save of those values would write it). (old, new)."""
    import struct

    from ckptdoctor.formats.archive import parse_archive

    blob = path.read_bytes()[chunk.storage.offset : chunk.storage.offset + chunk.storage.length]
    start = next(m.start for k, m in parse_archive(blob, "chunk").members.items() if "/data/" in k)
    (old,) = struct.unpack_from("<f", blob, start + 4 * element)
    (new,) = struct.unpack("<f", struct.pack("<f", old + add))
    patch_record(path, chunk.storage, 4 * element, struct.pack("<f", new), crc)
    return old, new


def test_value_patched_in_place_same_layout(capsys, copy_fixture):
    """Same chunk grid, one stored float changed in the data file (its record's CRC-32 with it): the decode path
    finds exactly that key."""
    from ckptdoctor.checkpoint import open_checkpoint

    pytest.importorskip("torch")
    save = copy_fixture("core019_tp2")
    ckpt = open_checkpoint(save)
    key = "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc2.weight"
    chunk = ckpt.entries[key].chunks[-1]
    old, new = _patch_element(ckpt.iteration_dir / chunk.storage.relative_path, chunk, 7, 2.0)
    rc, report = _diff(capsys, str(FIXTURES / "core019_tp2"), str(save), "--values")
    assert rc == 1 and report["layout"]["count"] == 0
    (only,) = report["values"]["different_keys"]
    assert only["key"] == key and only["mismatched"] == 1 and only["max_abs_diff"] == pytest.approx(new - old)
    assert report["values"]["equal"] == report["values"]["compared"] - 1


@pytest.mark.parametrize("numpy", [True, False], ids=["bit patterns", "torch"])
def test_value_changed_under_its_crc_is_refused_not_compared(capsys, copy_fixture, monkeypatch, numpy):
    """A stored float changed and its CRC-32 left as saved (a flipped bit): diff --values says which record of
    which chunk fails its CRC-32 and exits 2, on both read paths (numpy's bit patterns and torch's decode); it does
    not report the changed value as a difference (torch would load it, but it was never saved)."""
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.values import read

    pytest.importorskip("torch")
    if not numpy:
        monkeypatch.setattr(read, "numpy_or_none", lambda: None)
    save = copy_fixture("core019_tp2")
    ckpt = open_checkpoint(save)
    key = "decoder.layers.mlp.linear_fc2.weight"
    chunk = ckpt.entries[key].chunks[-1]
    _patch_element(ckpt.iteration_dir / chunk.storage.relative_path, chunk, 3, 2.0, crc=False)
    rc = main(["diff", str(FIXTURES / "core019_tp2"), str(save), "--values", "--jobs", "1"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", out
    assert f"{key} chunk at {list(chunk.offsets)}: record " in err and "fails its CRC-32" in err, err


def test_adapter_only_vs_full(capsys):
    pytest.importorskip("torch")
    full, trainable = "core019_peft_full_tp1", "core019_peft_trainable_tp1"
    rc, report = _diff(
        capsys,
        str(FIXTURES / full),
        str(FIXTURES / trainable),
        "--all",
        "--values",
        "--section",
        "model",
        "--section",
        "optimizer",
    )
    assert rc == 1
    missing = _model_keys(full) - _model_keys(trainable)
    assert missing and _only(report, "only_a") == {"model": sorted(missing)}
    assert not _only(report, "only_b")
    opt = report["keys"]["optimizer"]
    assert opt["common"] == len([k for k in manifest(full)["keys"] if k.startswith("optimizer.")]) > 0
    values = report["values"]
    assert values["different"] == 0 and values["not_compared"] == 0
    assert values["compared"] == opt["common"] + report["keys"]["model"]["common"]


def test_args_grouped_and_flagged(capsys):
    rc, report = _diff(capsys, str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2"))
    assert rc == 1
    groups = {g: {c["name"]: c for c in changes} for g, changes in report["args"]["groups"].items()}
    assert groups["parallelism"]["tensor_model_parallel_size"]["a"] == 1
    assert groups["parallelism"]["tensor_model_parallel_size"]["b"] == 2
    assert "tensor_parallel_num_weight_shards" in groups["parallelism-derived"]
    assert "save" in groups["training"]
    assert report["args"]["flags"] == []  # both checkpoints' args agree with their own layouts

    rc, report = _diff(capsys, str(FIXTURES / "core019_convert_src_tp1"), str(FIXTURES / "core019_convert_tp4"))
    flags = {(f["side"], f["arg"]): f for f in report["args"]["flags"]}
    flag = flags[("b", "tensor_parallel_num_weight_shards")]
    assert flag["equal_in_both"] and flag["saved"] == 1 and flag["correct"] == 4 and flag["severity"] == "error"
    assert not [f for f in report["args"]["flags"] if f["side"] == "a"]
    derived = {c["name"] for c in report["args"]["groups"]["parallelism-derived"]}
    assert "tensor_parallel_num_weight_shards" not in derived  # equal in A and B: only the flag shows it


def test_changed_args_in_common_pt(capsys, copy_fixture):
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.formats.torch_zip import dump_torch_zip

    save = copy_fixture("core016_tp1")
    common = open_checkpoint(save).common_state()
    common["args"].hidden_size = 48
    common["args"].lr = 0.5
    common["args"].my_new_flag = True
    common["iteration"] = 11
    (save / "iter_0000010" / "common.pt").write_bytes(dump_torch_zip(common))
    rc, report = _diff(capsys, str(FIXTURES / "core016_tp1"), str(save))
    assert rc == 1
    changes = {c["name"]: (g, c["change"]) for g, cs in report["args"]["groups"].items() for c in cs}
    assert changes == {
        "hidden_size": ("model shape", "changed"),
        "lr": ("training", "changed"),
        "my_new_flag": ("other", "only_b"),
    }
    assert [(c["field"], c["a"], c["b"]) for c in report["common"]["items"]] == [("iteration", 10, 11)]
    assert report["summary"]["only_a"] == report["summary"]["layout"] == 0


@pytest.mark.parametrize(
    "a,b", [("core016_tp1", "core019_tp1"), ("core016_convert_src_tp1", "core019_convert_src_tp1")]
)
def test_core016_vs_core019_no_spurious_common_state_difference(capsys, a, b):
    pytest.importorskip("torch")
    rc, report = _diff(capsys, str(FIXTURES / a), str(FIXTURES / b), "--values", "--all")
    listed = [k for side in ("only_a", "only_b") for keys in _only(report, side).values() for k in keys]
    assert not [k for k in listed if k.startswith("common_state")]
    assert report["keys"]["common"]["common"] == 0  # the common_state item is not compared as a key
    assert not [c for c in report["common"]["items"] if c["field"].startswith("metadata.json")]
    era = " ".join(report["era"])
    assert "common.pt" in era and "common_state/shard_0_1" in era and "common_backend" in era
    values = report["values"]
    assert values["different"] == 0 and values["compared"] == values["equal"] > 0
    # What does differ is real: keys core 0.19 adds (rerun state), args only one version knows.
    assert set(listed) <= {"rerun_state_machine_state"}


def test_identical_exit_zero_and_text(capsys):
    rc = main(["diff", str(FIXTURES / "core019_tp2"), str(FIXTURES / "core019_tp2" / "iter_0000010")])
    out, _ = capsys.readouterr()
    assert rc == 0 and out.rstrip().endswith("no differences")


def test_text_output_sections(capsys):
    rc = main(
        ["diff", str(FIXTURES / "core019_convert_src_tp1"), str(FIXTURES / "core019_convert_tp4"), "--limit", "2"]
    )
    out, _ = capsys.readouterr()
    assert rc == 1
    assert "layout  A: TP=1 PP=1 (1 writer)  B: TP=4 PP=1 (4 writers)" in out
    assert "parallelism:\n    tensor_model_parallel_size: 1 -> 4" in out
    assert "B CKD210 error: tensor_parallel_num_weight_shards=1" in out
    assert "more (--limit N, --all)" in out
    assert out.rstrip().split("\n\n")[-1].startswith("differences: ")  # the verdict, last (wrapped to the width)


def test_key_filters(capsys):
    a, b = str(FIXTURES / "core019_peft_full_tp1"), str(FIXTURES / "core019_peft_trainable_tp1")
    _, report = _diff(capsys, a, b, "--key", r"linear_qkv", "--exclude", r"adapter", "--all")
    listed = [k for keys in _only(report, "only_a").values() for k in keys]
    assert listed and all("linear_qkv" in k and "adapter" not in k for k in listed)
    assert report["args"] is None and report["common"] is None
    assert report["filters"] == {"sections": [], "keys": ["linear_qkv"], "exclude": ["adapter"]}


@pytest.mark.parametrize(
    "args,message",
    [
        (["nope"], "no such file"),
        ([str(FIXTURES / "core019_tp1"), "--key", "("], "invalid regex"),
        ([str(FIXTURES / "core019_tp1"), "--values", "--atol", "-1"], "must be >= 0"),
        ([str(FIXTURES / "core019_tp1"), "--values", "--rtol", "nan"], "must be a number >= 0, not nan"),
        ([str(FIXTURES / "core019_tp1"), "--atol", "1e-3"], "Invalid value for --atol: needs --values"),
        ([str(FIXTURES / "core019_tp1"), "--rtol", "1e-3"], "Invalid value for --rtol: needs --values"),
    ],
)
def test_errors_exit_2(capsys, args, message):
    rc = main(["diff", str(FIXTURES / "core019_tp2"), *args])
    _, err = capsys.readouterr()
    assert rc == 2 and message in err and "Traceback" not in err


def test_corrupt_chunk_is_a_clear_error(capsys, copy_fixture):
    pytest.importorskip("torch")
    save = copy_fixture("core019_tp1")
    data = save / "iter_0000010" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    rc = main(["diff", str(FIXTURES / "core019_tp1"), str(save), "--values", "--quiet"])
    _, err = capsys.readouterr()
    assert rc == 2 and "__0_0.distcp" in err and "truncated" in err and "Traceback" not in err


def test_structural_diff_needs_no_torch_and_values_say_what_is_missing():
    a, b = str(FIXTURES / "core016_tp1"), str(FIXTURES / "core019_tp2")
    result = run_cli("diff", a, b, "--format", "json", block=("torch", "megatron"))
    assert result.returncode == 1, result.stderr
    assert "IMPORTED:\n" in result.stderr  # neither torch nor megatron was imported
    assert json.loads(result.stdout)["layout"]["differs"]
    result = run_cli("diff", a, b, "--values", block=("torch",))
    assert result.returncode == 2 and "pip install 'ckptdoctor[torch]'" in result.stderr


def test_accumulator_bitwise_and_tolerance_semantics():
    torch = pytest.importorskip("torch")
    from ckptdoctor.values.diff import _Accumulator

    nan = float("nan")
    a = torch.tensor([1.0, nan, 0.0, 2.0])
    same = _Accumulator(torch, None, None)
    same.update(a, a.clone())
    assert same.mismatched == 0 and same.max_abs == 0.0  # same NaN positions are equal
    signed = _Accumulator(torch, None, None)
    signed.update(a, torch.tensor([1.0, nan, -0.0, 2.0]))
    assert signed.mismatched == 1 and signed.max_abs == 0.0  # bitwise: -0.0 is not 0.0
    tolerant = _Accumulator(torch, 0.01, None)
    tolerant.update(a, torch.tensor([1.005, nan, -0.0, 2.0]))
    assert tolerant.mismatched == 0 and tolerant.max_abs == pytest.approx(0.005)
    moved_nan = _Accumulator(torch, 1.0, None)
    moved_nan.update(a, torch.tensor([nan, 1.0, 0.0, 2.0]))
    assert moved_nan.mismatched == 2 and moved_nan.nan_mismatch == 2
    big = torch.arange(10_000_000, dtype=torch.float32).view(100, 100_000)
    slabbed = _Accumulator(torch, None, None)
    other = big.clone()
    other[99, 99_999] += 1
    slabbed.update(big, other)
    assert slabbed.elements == big.numel() and slabbed.mismatched == 1 and slabbed.max_abs == 1.0


@pytest.mark.parametrize("name", ["core016_tp2", "core019_tp1_pp2"])
def test_zero_copy_chunk_reads_match_read_chunk(name):
    torch = pytest.importorskip("torch")
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.values.read import read_chunk, read_chunk_view

    ckpt = open_checkpoint(FIXTURES / name)
    checked = 0
    for entry in ckpt.entries.values():
        for i, chunk in enumerate(entry.chunks if entry.kind == "tensor" else []):
            view, nbytes = read_chunk_view(ckpt, entry, chunk)
            reference = read_chunk(ckpt, entry.key, i)
            assert nbytes == chunk.storage.length
            assert view.dtype == reference.dtype and torch.equal(view, reference)
            checked += 1
    assert checked >= sum(len(e.chunks) for e in ckpt.entries.values() if e.kind == "tensor") > 0


def test_zarr_values_decode_against_torch_dist(capsys):
    """Legacy zarr chunks (raw C-order values) compare by value with a torch_dist save of the same init."""
    import json as _json

    from ckptdoctor.cli import main as _main

    rc = _main(
        [
            "diff",
            str(FIXTURES / "core014_zarr_tp2"),
            str(FIXTURES / "core014_tp1"),
            "--values",
            "--section",
            "model",
            "--key",
            r"^(embedding|output_layer|decoder\.layers\.self_attention)",
            "--format",
            "json",
        ]
    )
    report = _json.loads(capsys.readouterr().out)
    values = report["values"]
    assert values["compared"] >= 5 and values["equal"] == values["compared"], values
    assert values["not_compared"] == 0 and values["bytes_read"]["a"] > 0
    assert rc == 1  # layout and args differ (TP=2 zarr vs TP=1 torch_dist), values do not


def test_bucket_padding_is_neither_compared_nor_measured(capsys):
    """A distributed-optimizer bucket's padding between parameters is never written (it holds what memory held):
    two saves of the same parameters differ only there. diff --values leaves it out of the comparison (and says
    how much), show --stats out of the statistics, as check --deep and --health do."""
    pytest.importorskip("torch")
    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0."
    a, b = FIXTURES / "core019_inf_exp_avg_sq_dp2", FIXTURES / "core019_zero_moments_dp2"
    main(["diff", str(a), str(b), "--values", "--section", "optimizer", "--format", "json"])
    values = json.loads(capsys.readouterr().out)["values"]
    different = {v["key"]: v for v in values["different_keys"]}
    assert values["compared"] == 6 and bucket + "param" not in different  # equal but for its padding
    moments = different[bucket + "exp_avg"]  # zeroed in B: a real difference
    assert moments["elements"] == 28832  # compared: the parameters' elements, not the 28992 of the buffer
    assert moments["note"] == "160 bucket padding elements (never written) not compared"
    main(["show", str(b), bucket + "exp_avg", "--format", "json"])
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["padding"] == 160 and stats["finite"] == 28832
    assert stats["min"] == stats["max"] == 0.0  # every moment zeroed: the padding's garbage is not counted


def test_a_tensor_in_the_common_state_is_compared_by_its_values(capsys):
    """The optimizer's step count (a 0-d tensor in the common state) differs between the two real saves (1 and 10
    steps): diff reports it, with the values (a tensor's stand-in holds only a way to read its bytes, and tensors of
    other values were digested alike)."""
    rc, report = _diff(capsys, str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_trained_tp1"))
    changed = {f["path"]: f for item in report["common"]["items"] for f in item["fields"]}
    step = changed["optimizer.state.common_step"]
    assert rc == 1 and "value=1.0" in str(step["a"]) and "value=10.0" in str(step["b"]), step


def test_tensor_stand_ins_are_equal_exactly_when_their_values_are():
    torch = pytest.importorskip("torch")
    from ckptdoctor.formats.torch_zip import load_torch_zip
    from ckptdoctor.pickle.plain import same_value

    def loaded(value):
        buffer = io.BytesIO()
        torch.save({"step": value}, buffer)
        return load_torch_zip(buffer.getvalue(), "test")["step"]

    one, seven = loaded(torch.tensor(1.0)), loaded(torch.tensor(7.0))
    assert not same_value(one, seven) and same_value(one, loaded(torch.tensor(1.0)))
    assert repr(seven) == "tensor(torch.float32, shape=[], value=7.0)"
    pair = loaded(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert repr(pair) == "tensor(torch.bfloat16, shape=[2], values=[1.5, -2.0])"
    big = loaded(torch.zeros(100))
    assert repr(big) == "tensor(torch.float32, shape=[100])"  # no values beyond a few
    assert not same_value(big, loaded(torch.ones(100)))


def test_more_writers_is_not_another_layout(capsys):
    """DP=2 adds writers (4 data files for 2), not a layout: every key is chunked alike and every value equal, so the
    diff is clean (it said "layout differs" and exited 1); another TP still differs."""
    rc, report = _diff(capsys, str(FIXTURES / "core019_tp2"), str(FIXTURES / "core019_tp2_dp2"), "--section", "model")
    assert rc == 0 and report["layout"]["differs"] is False and report["identical"], report["layout"]
    assert report["layout"]["a"] != report["layout"]["b"]  # the summaries still name each side's writers
    rc, report = _diff(capsys, str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2"), "--section", "model")
    assert rc == 1 and report["layout"]["differs"] is True


def test_a_stacked_objects_layer_count_is_a_shape_change_not_layout(capsys):
    """2 layers vs 4: the stacked layers' _extra_state objects count other layers (a change of the model), the rng
    state's extra shard is PP's (layout)."""
    rc, report = _diff(capsys, str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp1_pp2"))
    changed = {c["key"]: c for c in report["changed"]}
    extra = changed["decoder.layers.mlp.linear_fc1._extra_state"]
    assert extra["fields"] == ["shape"] and (extra["a"]["shape"], extra["b"]["shape"]) == ([2], [4])
    layout = {k["key"] for k in report["layout"]["keys"]}
    assert "rng_state" in layout and not any(k.endswith("._extra_state") for k in layout), layout
    rc, report = _diff(capsys, str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2"))
    assert not any(c["key"].endswith("._extra_state") for c in report["changed"])  # TP alone: layout only
