"""``ckptdoctor diff``: the common state compared field by field (issue #37 point 2): the path of each differing field
(``optimizer.param_groups[0].lr: 0.001 -> 0.0005``), not the two values of the whole key."""

from __future__ import annotations

import json
import re

import pytest
from conftest import FIXTURES, run_main

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.formats.torch_zip import dump_torch_zip
from ckptdoctor.pickle.stand_ins import stand_in_class

DENSE = FIXTURES / "core019_tp1"
MOE = FIXTURES / "core019_moe_ep2"  # core 0.19, trained twice as long: its scheduler's steps differ


def _diff(capsys, *args: object) -> tuple[int, str]:
    rc, out, err = run_main(capsys, "diff", *args)
    assert rc in (0, 1), err
    return rc, out


def _common_items(capsys, a, b, *args: object) -> dict:
    rc, out = _diff(capsys, a, b, "--format", "json", *args)
    return {item["field"]: item for item in json.loads(out)["common"]["items"]}


def _shown(capsys, ckpt, path: str):
    rc, out, err = run_main(capsys, "show", ckpt, path, "--format", "json")
    assert rc == 0, err
    return json.loads(out)["value"]


def test_scheduler_fields_of_two_real_checkpoints(capsys):
    rc, out = _diff(capsys, DENSE, MOE)
    assert rc == 1
    item = _common_items(capsys, DENSE, MOE)["opt_param_scheduler"]
    paths = [f["path"] for f in item["fields"]]
    assert item["change"] == "changed" and item["fields_count"] == len(paths) > 0 and item["fields_complete"]
    assert "opt_param_scheduler.num_steps" in paths and "opt_param_scheduler.max_lr" not in paths
    for field in item["fields"]:
        name = field["path"]
        a, b = _shown(capsys, DENSE, f"common.{name}"), _shown(capsys, MOE, f"common.{name}")
        assert (field["change"], field["a"], field["b"]) == ("changed", a, b) and a != b
        assert f"  {name}: {a} -> {b}" in out.splitlines()
    assert not re.search(r"^  opt_param_scheduler: ", out, re.M)  # no blob of the whole scheduler


def test_a_changed_learning_rate_is_named_by_its_path(capsys, copy_fixture):
    save = copy_fixture("core016_tp1")
    common = open_checkpoint(save).common_state()
    before = common["optimizer"]["param_groups"][0]["lr"]
    common["optimizer"]["param_groups"][0]["lr"] = 0.0005
    common["opt_param_scheduler"]["num_steps"] += 2
    (save / "iter_0000010" / "common.pt").write_bytes(dump_torch_zip(common))
    rc, out = _diff(capsys, FIXTURES / "core016_tp1", save)
    assert rc == 1
    lines = out.splitlines()
    assert f"  optimizer.param_groups[0].lr: {before} -> 0.0005" in lines
    assert "common state and metadata.json: 2 differ" in lines
    assert not [line for line in lines if line.startswith("  optimizer: ")]
    items = _common_items(capsys, FIXTURES / "core016_tp1", save)
    assert items["optimizer"]["fields"] == [
        {"path": "optimizer.param_groups[0].lr", "change": "changed", "a": before, "b": 0.0005}
    ]
    assert [f["path"] for f in items["opt_param_scheduler"]["fields"]] == ["opt_param_scheduler.num_steps"]


def test_stand_ins_compared_by_their_recorded_fields(capsys, copy_fixture):
    rerun_mode = stand_in_class("megatron.core.rerun_state_machine", "RerunMode")
    sides = []
    for name, mode, iteration in (("a", "validate_results", 10), ("b", "disabled", 12)):
        save = copy_fixture("core016_tp1")
        save = save.rename(save.parent / name)
        common = open_checkpoint(save).common_state()
        common["rerun_state_machine"] = {"mode": rerun_mode(mode), "current_iteration": iteration}
        (save / "iter_0000010" / "common.pt").write_bytes(dump_torch_zip(common))
        sides.append(save)
    rc, out = _diff(capsys, *sides)
    lines = out.splitlines()
    assert "  rerun_state_machine.mode: RerunMode('validate_results') -> RerunMode('disabled')" in lines
    assert "  rerun_state_machine.current_iteration: 10 -> 12" in lines


def test_many_fields_are_capped_by_limit(capsys):
    item = _common_items(capsys, DENSE, MOE, "--limit", "1")["opt_param_scheduler"]
    assert len(item["fields"]) == 1 and item["fields_count"] > 1
    rc, out = _diff(capsys, DENSE, MOE, "--limit", "1")
    assert f"    ... {item['fields_count'] - 1} more (--limit N, --all)" in out.splitlines()
    assert len(_common_items(capsys, DENSE, MOE, "--all")["opt_param_scheduler"]["fields"]) == item["fields_count"]


def test_a_value_that_expands_exponentially_is_walked_within_bounds(capsys, copy_fixture):
    """Twenty levels of ten references each: 10**20 leaves in a small pickle. The walk stops at its node limit and
    says so."""
    sides = []
    for name, leaf in (("a", 1), ("b", 2)):
        save = copy_fixture("core016_tp1")
        save = save.rename(save.parent / name)
        common = open_checkpoint(save).common_state()
        node: object = [leaf]
        for _ in range(20):
            node = [node] * 10
        common["bomb"] = node
        (save / "iter_0000010" / "common.pt").write_bytes(dump_torch_zip(common))
        sides.append(save)
    item = _common_items(capsys, *sides, "--all")["bomb"]
    assert item["fields_complete"] is False and 0 < item["fields_count"] <= 10_000
    assert item["fields"][0] == {"path": "bomb" + "[0]" * 21, "change": "changed", "a": 1, "b": 2}
    rc, out = _diff(capsys, *sides)
    assert rc == 1 and "    ... bomb: not compared further (node or depth limit)" in out.splitlines()


def test_values_name_the_differing_fields_of_bytes_items(capsys):
    """``--values``: rng states of two runs differ; the report names the field by path under the key."""
    pytest.importorskip("torch")
    a, b = FIXTURES / "core019_tp1", FIXTURES / "core019_peft_full_tp1"
    rc, out = _diff(capsys, a, b, "--values", "--key", "rng_state", "--format", "json", "--jobs", "1")
    (rng,) = json.loads(out)["values"]["different_keys"]
    assert rng["key"] == "rng_state" and rng["fields_count"] == len(rng["fields"]) > 0
    for f in rng["fields"]:
        assert f["path"].startswith("rng_state[0].") and f["change"] == "changed"
        # the field is what `show --decode` shows under that path, on both sides
        shown_a, shown_b = (_shown_decoded(capsys, ckpt, "rng_state", f["path"]) for ckpt in (a, b))
        assert (shown_a, shown_b) == (f["a"], f["b"])
    rc, out = _diff(capsys, a, b, "--values", "--key", "rng_state", "--jobs", "1")
    assert rc == 1 and f"    {rng['fields'][0]['path']}: " in out


def _shown_decoded(capsys, ckpt, key: str, path: str):
    rc, out, err = run_main(capsys, "show", ckpt, key, "--decode", "--no-stats", "--format", "json")
    assert rc == 0, err
    value = json.loads(out)["decoded"]
    for step in re.findall(r"\.(\w+)|\[(\d+)\]", path.removeprefix(key)):
        value = value[step[0]] if step[0] else value[int(step[1])]
    return value
