"""The JSON schemas shipped with the package (issue #36): one for every command with ``--format json`` (and the error
object), each output on the fixtures valid against it, ``ckptdoctor schema`` printing the shipped file, ``--help``
naming ``ckptdoctor schema NAME`` (never a repository path), and a top-level ``--help`` whose summaries fit."""

from __future__ import annotations

import json
import re

import click
import jsonschema
import pytest
import tomllib
from conftest import FIXTURES, REPO, fixture_names, run_main, shipped_schema

from ckptdoctor.cli import cli
from ckptdoctor.commands import COMMAND_MODULES, load_command
from ckptdoctor.commands.schema import schema_names

SCHEMAS = REPO / "ckptdoctor" / "schemas"
TP1 = FIXTURES / "core019_tp1"


def _json_commands() -> list[str]:
    """Commands whose --format offers json, read from the Click commands themselves."""
    names = []
    for name in COMMAND_MODULES:
        command = load_command(name)
        assert command is not None
        for param in command.params:
            if param.name == "output_format" and isinstance(param.type, click.Choice) and "json" in param.type.choices:
                names.append(name)
    return names


def _validate(doc: dict, name: str) -> None:
    jsonschema.Draft202012Validator(shipped_schema(name)).validate(doc)


def _run_json(capsys, *args: object, expect: str | None = None, codes: tuple[int, ...] = (0, 1)) -> dict:
    """Run a command with --format json; its output must be the JSON of ``expect`` (default: the command) and
    valid against that schema."""
    rc, out, err = run_main(capsys, *args, "--format", "json")
    assert rc in codes, (args, rc, err)
    doc = json.loads(out)
    name = expect or str(args[0])
    assert doc["schema"] == f"ckptdoctor.{name}/1", (args, doc.get("schema"))
    _validate(doc, name)
    return doc


# --- the schemas themselves ----------------------------------------------------------------------------------------


def test_every_json_command_and_the_error_object_have_a_shipped_schema():
    commands = _json_commands()
    assert len(commands) >= 12 and "schema" not in commands
    assert schema_names() == sorted([*commands, "error"])
    assert sorted(p.name for p in SCHEMAS.glob("*.schema.json")) == [f"{n}.schema.json" for n in schema_names()]


@pytest.mark.parametrize("name", sorted(p.name.removesuffix(".schema.json") for p in SCHEMAS.glob("*.schema.json")))
def test_each_schema_is_valid_and_names_its_output(name):
    schema = shipped_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"ckptdoctor.{name}/1"
    assert schema["properties"]["schema"] == {"const": f"ckptdoctor.{name}/1"}
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert "schema" in schema["required"]


def test_schemas_are_package_data():
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "schemas/*.schema.json" in package_data["ckptdoctor"]
    assert not list((REPO / "docs").glob("*.schema.json")), "one place for the schemas: ckptdoctor/schemas/"


# --- ckptdoctor schema -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", schema_names())
def test_schema_command_prints_exactly_the_shipped_file(capsys, name):
    rc, out, err = run_main(capsys, "schema", name)
    assert rc == 0 and err == ""
    assert out == (SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8")


def test_schema_list_and_refusals(capsys):
    rc, out, _ = run_main(capsys, "schema", "--list")
    assert rc == 0 and out.splitlines() == schema_names()
    rc, out, err = run_main(capsys, "schema", "no-such-command")
    assert rc == 2 and out == "" and "no schema for 'no-such-command'" in err and "can-load" in err
    rc, out, err = run_main(capsys, "schema")
    assert rc == 2 and out == "" and "--list" in err
    rc, out, err = run_main(capsys, "schema", "diff", "--list")
    assert rc == 2 and out == ""


# --- --help ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(COMMAND_MODULES))
def test_help_names_the_schema_command_not_a_repository_path(capsys, name):
    rc, out, _ = run_main(capsys, name, "--help")
    assert rc == 0
    out = " ".join(out.split())  # click wraps help text at 80 columns
    assert not re.search(r"docs/|\.schema\.json|in the README", out), out
    if name in _json_commands():
        assert f"`ckptdoctor schema {name}`" in out


def test_top_level_help_summaries_are_whole_phrases_that_fit(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, _ = run_main(capsys, "--help")
    assert rc == 0
    lines = out.split("Commands:\n", 1)[1].splitlines()
    ctx = click.Context(cli)
    summaries = {}
    for line in lines:
        if not line.strip():
            continue
        name, _, summary = line.strip().partition(" ")
        assert name in COMMAND_MODULES, f"a summary wraps onto a second line: {line!r}"
        summaries[name] = summary.strip()
    assert list(summaries) == list(COMMAND_MODULES)
    for name, summary in summaries.items():
        command = cli.get_command(ctx, name)
        assert command is not None and command.short_help, f"{name}: no short_help (click would cut its docstring)"
        assert summary == command.short_help
        assert not summary.endswith(("...", "…", ",", ":", ";")), summary
        assert summary[0].isupper() and summary.endswith("."), summary


# --- every JSON output, on the fixtures, against its schema -------------------------------------------------------


@pytest.mark.parametrize("fixture", fixture_names())
def test_read_only_outputs_validate_on_every_fixture(capsys, fixture):
    path = FIXTURES / fixture
    _run_json(capsys, "inspect", path)
    _run_json(capsys, "check", "--isolated", path)
    _run_json(capsys, "check", "--isolated", "--statistics", path)
    _run_json(capsys, "check", "--isolated", "--health", path)
    _run_json(capsys, "latest-good", path)
    _run_json(capsys, "history", path, "--jobs", "1")
    _run_json(capsys, "repair", path)
    _run_json(capsys, "fix-args", path)
    for target in ("tp=1", "tp=2,pp=2"):
        _run_json(capsys, "can-load", path, "--target", target)
    _run_json(capsys, "can-load", path, "--suggest")


@pytest.mark.parametrize(
    "args",
    [
        (TP1, "decoder.final_layernorm.weight"),
        (TP1, "rng_state"),
        (TP1, "common_state/shard_0_1"),
        (FIXTURES / "core019_tp2", "decoder.layers.mlp.linear_fc1.weight", "--no-stats"),
        (FIXTURES / "core019_moe_ep2", "optimizer.state.exp_avg.decoder.final_layernorm.weight", "--no-stats"),
        (FIXTURES / "core014_zarr_tp2", "decoder.final_layernorm.weight", "--no-stats"),
        (TP1, "args"),
        (FIXTURES / "core016_tp1", "args.lr"),
        (TP1, "common.optimizer.param_groups[0]"),
        (TP1, "common"),
        (TP1, "rng_state", "--decode", "--no-stats"),
        (TP1, "common_state/shard_0_1", "--decode"),
    ],
)
def test_show_validates(capsys, args):
    _run_json(capsys, "show", *args)


def test_show_values_validate(capsys, tmp_path):
    pytest.importorskip("torch")
    key = "decoder.layers.self_attention.linear_qkv.weight"
    doc = _run_json(capsys, "show", FIXTURES / "core019_tp2", key, "--slice", "0,:3")
    assert doc["stats"] is not None and doc["slice"]["spec"] == "0,:3" and doc["slice"]["values"]
    doc = _run_json(capsys, "show", TP1, key, "--save", tmp_path / "qkv.npy")
    assert doc["saved"] == str(tmp_path / "qkv.npy")


@pytest.mark.parametrize(
    "a, b",
    [
        ("core019_tp1", "core019_tp2"),
        ("core019_convert_src_tp1", "core019_convert_tp4"),
        ("core019_peft_full_tp1", "core019_peft_trainable_tp1"),
        ("core016_tp1", "core019_tp1"),
        ("core019_tp1", "core019_tp1"),
    ],
)
def test_diff_validates(capsys, a, b):
    _run_json(capsys, "diff", FIXTURES / a, FIXTURES / b)


def test_diff_fields_validate(capsys):
    """The common state's and a bytes item's differing fields by path (issue #37 point 2)."""
    doc = _run_json(capsys, "diff", TP1, FIXTURES / "core019_moe_ep2", "--limit", "2")
    assert any(item["fields"] for item in doc["common"]["items"])
    pytest.importorskip("torch")
    doc = _run_json(capsys, "diff", TP1, FIXTURES / "core019_peft_full_tp1", "--values", "--key", "rng_state")
    assert doc["values"]["different_keys"][0]["fields"]


def test_diff_stats_validate(capsys):
    """Per-key and per-slice statistics side by side (issue #38 point 2), with a changed slice."""
    pytest.importorskip("numpy")
    doc = _run_json(
        capsys, "diff", FIXTURES / "core019_moe_ep2", FIXTURES / "core019_moe_zero_expert_ep2", "--values", "--stats"
    )
    assert doc["stats"]["changed"] and any(row["slice"] for row in doc["stats"]["rows"])


def test_rules_validate(capsys):
    assert len(_run_json(capsys, "rules")["rules"]) > 40
    assert {r["family"] for r in _run_json(capsys, "rules", "CKD4")["rules"]} == {"safety"}


def test_strip_frozen_validates(capsys, tmp_path):
    _run_json(capsys, "strip-frozen", FIXTURES / "core019_peft_full_tp2")
    _run_json(capsys, "strip-frozen", FIXTURES / "core019_peft_full_tp1", "--preset", "lora", "--keys")
    doc = _run_json(capsys, "strip-frozen", FIXTURES / "core016_peft_full_tp1", "-o", tmp_path / "out")
    assert doc["result"]["files"] and doc["result"]["args_changed"]
    doc = _run_json(capsys, "strip-frozen", FIXTURES / "core019_peft_trainable_tp1")
    assert doc["nothing_frozen"] is True and doc["result"] is None


def test_edit_validates(capsys, tmp_path, copy_fixture):
    tp2 = FIXTURES / "core019_tp2"
    _run_json(capsys, "edit", tp2, "--remove", r"^optimizer\.", "--keys")
    doc = _run_json(capsys, "edit", tp2, "--drop-section", "optimizer", "-o", tmp_path / "linked")
    assert doc["linked_files"] > 0 and doc["plan"]["load_flags"] == ["--no-load-optim"]
    doc = _run_json(capsys, "edit", tp2, "--drop-section", "rng", "--compact", "-o", tmp_path / "compact")
    assert doc["copied_files"] > 0 and doc["plan"]["common_changes"]
    doc = _run_json(
        capsys, "edit", copy_fixture("core019_tp1"), "--rename", r"^decoder\.final_layernorm", "x", "--in-place"
    )
    assert doc["plan"]["renamed"] and doc["result"]["backup"]


def test_convert_validates(capsys, tmp_path):
    doc = _run_json(capsys, "convert", FIXTURES / "core019_tp2", "--to", "fsdp_dtensor")
    assert doc["dry_run"] and doc["result"] is None and doc["plan"]["mappings"]
    doc = _run_json(capsys, "convert", TP1, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp")
    assert doc["result"]["chunks"] > 0 and doc["plan"]["not_carried"]
    doc = _run_json(capsys, "convert", tmp_path / "fsdp", "--to", "torch_dist", "-o", tmp_path / "back")
    assert doc["plan"]["source_format"] == "fsdp_dtensor" and doc["result"]["objects"] > 0


def test_seal_validates(capsys, copy_fixture):
    save_dir = copy_fixture("core019_tp1")
    assert _run_json(capsys, "seal", save_dir)["unchanged"] is False
    assert _run_json(capsys, "seal", save_dir)["unchanged"] is True
    assert _run_json(capsys, "seal", save_dir, "--force")["replaced"] is True
    _run_json(capsys, "check", "--isolated", save_dir)


def test_repair_and_latest_good_validate_on_broken_copies(capsys, tmp_path, copy_fixture):
    missing_json = copy_fixture("core019_tp1")
    (missing_json / "iter_0000010" / "metadata.json").unlink()
    assert _run_json(capsys, "repair", missing_json)["actions"][0]["kind"] == "metadata-json"
    assert _run_json(capsys, "repair", missing_json, "--in-place")["written"]["mode"] == "in-place"

    bad_tracker = copy_fixture("core019_tp2")
    (bad_tracker / "latest_checkpointed_iteration.txt").write_text("20")
    assert _run_json(capsys, "repair", bad_tracker)["actions"][0]["kind"] == "tracker"
    doc = _run_json(capsys, "repair", bad_tracker, "-o", tmp_path / "repaired")
    assert doc["written"]["mode"] == "output" and doc["remaining"] == []

    truncated = copy_fixture("core016_tp1")
    data = sorted((truncated / "iter_0000010").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    doc = _run_json(capsys, "repair", truncated)
    assert doc["unrepairable"] and doc["refused"] and doc["way_out"]
    doc = _run_json(capsys, "latest-good", truncated)
    assert doc["iteration_dir"] is None and doc["skipped"][0]["errors"]
    _run_json(capsys, "check", "--isolated", truncated)

    args = copy_fixture("core019_convert_tp4")
    assert _run_json(capsys, "repair", args)["actions"][0]["kind"] == "fix-args"
    assert _run_json(capsys, "repair", args, "--in-place")["written"]["backups"]
    doc = _run_json(capsys, "fix-args", FIXTURES / "core016_convert_tp4", "-o", tmp_path / "fixed")
    assert doc["written"] is not None


ERROR_CASES = {
    "inspect": ("inspect", "{missing}"),
    "show": ("show", TP1, "no.such.key"),
    "diff": ("diff", TP1, "{missing}"),
    "fix-args": ("fix-args", FIXTURES / "bridge_train_state"),
    "repair": ("repair", "{missing}"),
    "latest-good": ("latest-good", FIXTURES / "bridge_train_state"),
    "history": ("history", "{missing}"),
    "seal": ("seal", "{missing}"),
    "strip-frozen": ("strip-frozen", TP1, "--trainable", "("),
    "edit": ("edit", TP1),
    "convert": ("convert", "{missing}", "--to", "fsdp_dtensor"),
    "can-load": ("can-load", TP1, "--target", "tp=0"),
    "rules": ("rules", "CKD001"),
    "usage": ("inspect", TP1, "--no-such-option"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_in_json_mode_validate_against_the_error_schema(capsys, tmp_path, case):
    args = [str(tmp_path / "missing") if a == "{missing}" else a for a in ERROR_CASES[case]]
    doc = _run_json(capsys, *args, expect="error", codes=(2,))
    assert doc["command"] == args[0] and doc["exit_code"] == 2


def test_check_reports_missing_paths_in_its_own_schema(capsys, tmp_path):
    doc = _run_json(capsys, "check", "--isolated", tmp_path / "missing", codes=(2,))
    assert doc["missing"] == [str(tmp_path / "missing")]


def test_the_error_object_names_the_command_after_the_group_options(capsys, tmp_path):
    from ckptdoctor.cli import _GROUP_OPTIONS_WITH_VALUE

    valued = {name for p in cli.params if isinstance(p, click.Option) and not p.is_flag for name in p.opts}
    assert valued == set(_GROUP_OPTIONS_WITH_VALUE)  # every option of the group that takes a value is skipped
    doc = _run_json(capsys, "--max-pickle-bytes", "4GiB", "inspect", tmp_path / "missing", expect="error", codes=(2,))
    assert doc["command"] == "inspect"
