"""Megatron-Bridge checkpoints save no args; their resume reads run_config.yaml's model section (TP and PP decide
whether the RNG state is loaded). check and fix-args take that section where no args are saved: the converter
problem of Megatron-LM's args (a TP=4 re-shard keeping the source's TP=1 config) is found and fixed there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import FIXTURES, file_digests, run_main, shipped_schema

from ckptdoctor.formats.run_config import model_config
from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip
from ckptdoctor.ops.check import check_paths

ITER = "iter_0000010"
RUN_CONFIG = """\
model:
  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider
  tensor_model_parallel_size: 1   # the TP=1 source's
  pipeline_model_parallel_size: 1
  tensor_parallel_num_weight_shards: 1
  num_layers: 2
  layer_spec:
    tensor_model_parallel_size: 1
checkpoint:
  save_rng: true
  tensor_model_parallel_size: 1
"""


def _bridge_converted(tmp_path: Path) -> Path:
    """The TP=4 converter fixture as Megatron-Bridge would hold it: no args in common.pt, a run_config.yaml."""
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "core016_convert_tp4", save)
    common = save / ITER / "common.pt"
    state = dict(load_torch_zip(common, str(common)))
    del state["args"]
    common.write_bytes(dump_torch_zip(state))
    (save / ITER / "run_config.yaml").write_text(RUN_CONFIG)
    return save


def test_check_reads_the_run_config_where_no_args_are_saved(tmp_path):
    save = _bridge_converted(tmp_path)
    findings = {f.code: f for f in check_paths([str(save)]).findings}
    assert sorted(findings) == ["CKD201", "CKD210"]
    assert findings["CKD201"].path == str(save / ITER / "run_config.yaml")
    assert "Megatron-Bridge's config" in findings["CKD201"].message and "correct value: 4" in findings["CKD201"].message


def test_fix_args_rewrites_only_the_run_config(capsys, tmp_path):
    save = _bridge_converted(tmp_path)
    before = file_digests(save / ITER)
    rc, out, _ = run_main(capsys, "fix-args", save, "--format", "json")
    report = json.loads(out)
    jsonschema.validate(report, shipped_schema("fix-args"))
    assert rc == 1 and report["config_source"] == "run_config.yaml"
    rc, out, err = run_main(capsys, "fix-args", save, "--in-place")
    assert rc == 0, out + err
    after = file_digests(save / ITER)
    changed = {name for name in before if before[name] != after.get(name)}
    assert changed == {"run_config.yaml"}  # common.pt, .metadata and the data untouched
    (backup,) = (save / ITER).glob("run_config.yaml.bak-*")
    assert backup.read_text() == RUN_CONFIG
    text = (save / ITER / "run_config.yaml").read_text()
    loaded = yaml.safe_load(text)  # as Bridge's read_run_config loads it
    assert loaded["model"]["tensor_model_parallel_size"] == 4
    assert loaded["model"]["tensor_parallel_num_weight_shards"] == 4
    assert loaded["model"]["layer_spec"]["tensor_model_parallel_size"] == 1  # a nested mapping's field: another thing
    assert loaded["checkpoint"] == {"save_rng": True, "tensor_model_parallel_size": 1}  # another section: untouched
    assert "# the TP=1 source's" in text  # comments and layout kept
    assert [f.code for f in check_paths([str(save)]).findings] == []


def test_set_refuses_a_name_the_run_config_lacks(capsys, tmp_path):
    save = _bridge_converted(tmp_path)
    rc, _, err = run_main(capsys, "fix-args", save, "--set", "foo=3", "--force", "--in-place")
    assert rc == 2 and "run_config.yaml's model section has no 'foo'" in err
    assert (save / ITER / "run_config.yaml").read_text() == RUN_CONFIG


def test_args_win_over_a_run_config(tmp_path):
    """A checkpoint with saved args is checked by them, whatever a run_config.yaml beside says."""
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "core019_tp2", save)
    (save / ITER / "run_config.yaml").write_text(RUN_CONFIG)
    assert [f.code for f in check_paths([str(save)]).findings] == []


def test_model_config_reads_only_the_model_sections_scalars():
    text = RUN_CONFIG + "model_x:\n  tensor_model_parallel_size: 9\n  - 1\n"
    assert model_config(text) == {
        "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "tensor_parallel_num_weight_shards": 1,
        "num_layers": 2,
    }
    assert model_config('model:\n  a: "x # y"\n  b: null\n  c: 1.5e-4\n  d: True\n  e: [1, 2]\n') == {
        "a": "x # y",
        "b": None,
        "c": 1.5e-4,
        "d": True,
        "e": "[1, 2]",
    }


@pytest.mark.parametrize(
    ("hostile", "expected"),
    [
        ("model:\n" + "  " * 200_000 + "x: 1\n", {"x": 1}),  # one line of deep indentation
        ("model:\n  tensor_model_parallel_size: " + "9" * 1_000_000 + "\n", None),  # past Python's int digit limit
        ("model:\n" + "  a: 1\n" * 300_000, {"a": 1}),  # many lines
        ("model:\n  x: " + "[" * 500_000 + "\n", {"x": "[" * 500_000}),  # a flow value a YAML loader recurses into
    ],
)
def test_model_config_of_hostile_text(hostile, expected):
    """A line scan: no YAML loader's recursion, and digits beyond 30 stay text (no int() past the digit limit)."""
    config = model_config(hostile)
    if expected is None:
        assert config == {"tensor_model_parallel_size": "9" * 1_000_000}
    else:
        assert config == expected


def test_inspect_shows_the_run_config_in_place_of_args(capsys, tmp_path):
    save = _bridge_converted(tmp_path)
    rc, out, _ = run_main(capsys, "inspect", save)
    assert rc == 0 and "args            (none saved; Megatron-Bridge's run_config.yaml, model section)" in out
    assert "CKD201 [warning] tensor_model_parallel_size=1 (should be 4)" in out
    rc, out, _ = run_main(capsys, "inspect", save, "--format", "json")
    report = json.loads(out)
    jsonschema.validate(report, shipped_schema("inspect"))
    assert report["args_source"] == "run_config.yaml"
    assert report["args"]["parallelism"] == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    assert [f["code"] for f in report["arg_findings"]] == ["CKD201", "CKD210"]


def test_diff_compares_run_configs_where_no_args_are_saved(capsys, tmp_path):
    stale = _bridge_converted(tmp_path / "a")
    fixed = _bridge_converted(tmp_path / "b")
    assert run_main(capsys, "fix-args", fixed, "--in-place")[0] == 0
    rc, out, _ = run_main(capsys, "diff", fixed, stale, "--format", "json")
    report = json.loads(out)
    changes = {d["name"]: (d["a"], d["b"]) for group in report["args"]["groups"].values() for d in group}
    assert changes == {"tensor_model_parallel_size": (4, 1), "tensor_parallel_num_weight_shards": (4, 1)}
    assert {(f["side"], f["code"]) for f in report["args"]["flags"]} == {("b", "CKD201"), ("b", "CKD210")}
