"""``ckptdoctor check`` as ruff / pre-commit users expect (issue #11): recursive discovery, no false green,
missing paths, severity and fix per finding, --statistics, GitHub annotations, SARIF, strict config."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REPO, patch_record, run_cli, shipped_schema, unwrapped

from ckptdoctor.cli import main
from ckptdoctor.ops.check import CHECKPOINT_FILE_RE
from ckptdoctor.rules import FIX_COMMANDS, fix_command
from ckptdoctor.rules.registry import all_rules

ITER = "iter_0000010"
CONVERTED = FIXTURES / "core019_convert_tp4"  # CKD203, CKD210, CKD212: fixed by fix-args
SCHEMA = shipped_schema("check")


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys, *args: str) -> tuple[int, dict]:
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "json", *args)
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    return rc, report


def _runs(tmp_path: Path) -> Path:
    """runs/{a,b}/ save dirs, runs/nested/deeper/c an iteration dir, runs/.hidden/d (not searched)."""
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES / "core019_tp1", runs / "a")
    shutil.copytree(FIXTURES / "core016_tp2", runs / "b")
    shutil.copytree(FIXTURES / "core019_tp2" / ITER, runs / "nested" / "deeper" / "c")
    shutil.copytree(FIXTURES / "core019_convert_tp4", runs / ".hidden" / "d")  # would be findings
    shutil.copytree(FIXTURES / "core019_convert_tp4", runs / "a" / ITER / "extra" / "e")  # inside a checkpoint
    (runs / "notes").mkdir()
    (runs / "notes" / "README.md").write_text("x")
    return runs


# --- 1. recursive discovery -----------------------------------------------------------------------------------


def test_a_folder_of_save_dirs_is_searched_recursively(capsys, tmp_path):
    runs = _runs(tmp_path)
    rc, report = _json(capsys, str(runs))
    assert rc == 0, report
    assert report["checked"] == [str(runs / "a" / ITER), str(runs / "b" / ITER), str(runs / "nested/deeper/c")]
    rc, out, _ = _run(capsys, "check", "--isolated", str(runs))
    assert rc == 0 and out.strip() == "All checks passed (3 checkpoints)."


def test_no_recursive_and_a_folder_without_checkpoints(capsys, tmp_path):
    runs = _runs(tmp_path)
    rc, out, _ = _run(capsys, "check", "--isolated", "--no-recursive", str(runs))
    assert rc == 1 and f"{runs}: CKD100 [error] no tracker" in out
    rc, out, _ = _run(capsys, "check", "--isolated", str(runs / "notes"))
    assert rc == 1 and f"{runs / 'notes'}: CKD100 [error] no checkpoint found under it" in unwrapped(out)


# --- 2. zero checkpoints is no green ------------------------------------------------------------------------


def test_a_file_of_no_checkpoint_is_not_a_pass(capsys):
    rc, out, err = _run(capsys, "check", "--isolated", str(REPO / "README.md"))
    assert rc == 1 and "All checks passed" not in out
    assert err.strip() == f"ckptdoctor: no checkpoint found under {REPO / 'README.md'}"


def test_pre_commit_files_of_no_checkpoint_stay_quiet(capsys, tmp_path):
    """pre-commit passes files matching the hook's pattern; those that belong to no checkpoint pass."""
    hooks = (REPO / ".pre-commit-hooks.yaml").read_text()
    assert all(CHECKPOINT_FILE_RE.pattern in line for line in hooks.splitlines() if line.strip().startswith("files:"))
    stray = tmp_path / "configs" / "metadata.json"
    stray.parent.mkdir()
    stray.write_text('{"model": "gpt"}')
    rc, out, err = _run(capsys, "check", "--isolated", str(stray))
    assert rc == 0 and err == "" and "No checkpoint checked" in out


# --- 3. a missing path does not stop the others -------------------------------------------------------------


def test_missing_path_reported_after_checking_the_others(capsys, copy_fixture):
    bad = copy_fixture("core019_tp2")
    (bad / ITER / "__1_0.distcp").unlink()
    good = FIXTURES / "core019_tp1"
    missing = str(bad.parent / "nonexistent")
    rc, out, err = _run(capsys, "check", "--isolated", str(good), str(bad), missing)
    assert rc == 2
    assert "CKD113 [error] __1_0.distcp missing" in unwrapped(out) and "in 2 checkpoints" in out
    assert err.splitlines() == [f"ckptdoctor: error: {missing}: no such file or directory"]
    rc, report = _json(capsys, str(good), missing)
    assert rc == 2 and report["missing"] == [missing] and report["checked"] == [str(good / ITER)]


# --- 4, 5. severity and fix per finding; `rules` names the fixer ---------------------------------------------


def test_text_shows_severity_and_fix(capsys):
    rc, out, _ = _run(capsys, "check", "--isolated", str(CONVERTED))
    lines = unwrapped(out).splitlines()  # each finding's continuation lines joined back to it
    assert rc == 1
    assert lines[0].startswith(f"{CONVERTED / ITER}: CKD203 [warning] ")
    assert lines[1] == f"    fix: ckptdoctor fix-args {CONVERTED / ITER} --in-place"
    assert f"{CONVERTED / ITER}: CKD210 [error] tensor_parallel_num_weight_shards=1" in lines[2]
    assert lines[-1] == "Found 3 problems (1 error, 2 warnings) in 1 checkpoint; 3 fixable (see the fix: lines)."


def test_fix_in_json_and_repair_hints(capsys, copy_fixture):
    rc, report = _json(capsys, str(CONVERTED))
    assert {f["fix"] for f in report["findings"]} == {f"ckptdoctor fix-args {CONVERTED / ITER} --in-place"}
    save = copy_fixture("core019_tp2")
    (save / ITER / "metadata.json").unlink()
    shutil.copy(save / ITER / "__0_0.distcp", save / ITER / "__5_0.distcp")
    (save / "latest_checkpointed_iteration.txt").write_text("30")
    rc, report = _json(capsys, "--all-iterations", str(save))
    fixes = {f["code"]: f["fix"] for f in report["findings"]}
    assert fixes["CKD101"] == fixes["CKD115"] == f"ckptdoctor repair {save / ITER} --in-place"
    # the tracker names iteration 30; the only iteration is broken until repaired, so repair run on the save dir
    # as printed would refuse to move the tracker: no fix line (tests/test_fix_lines.py has one that works)
    assert fixes["CKD121"] is None
    (save / ITER / "__0_0.distcp").write_bytes(b"x")
    rc, report = _json(capsys, str(save / ITER))
    assert {f["fix"] for f in report["findings"] if f["code"] == "CKD114"} == {None}  # nothing fixes lost data


def test_fix_table_is_the_one_source(capsys):
    for rule in all_rules():
        assert rule.fix == fix_command(rule.code)
    assert all(any(r.code.startswith(prefix) for r in all_rules()) for prefix in FIX_COMMANDS)
    assert fix_command("CKD210", "my ckpt") == "ckptdoctor fix-args 'my ckpt' --in-place"
    rc, out, _ = _run(capsys, "rules", "CKD210")
    assert rc == 0 and "fix: ckptdoctor fix-args CKPT --in-place" in out
    rc, out, _ = _run(capsys, "rules", "CKD113")
    assert "fix: none (no automatic fix)" in out
    rc, out, _ = _run(capsys, "rules", "--format", "json", "CKD12")
    assert {r["fix"] for r in json.loads(out)["rules"]} == {"ckptdoctor repair CKPT --in-place"}


# --- 6. --statistics, github, sarif ------------------------------------------------------------------------


def test_statistics(capsys):
    rc, out, _ = _run(
        capsys, "check", "--isolated", "--statistics", str(CONVERTED), str(FIXTURES / "core016_convert_tp4")
    )
    lines = out.splitlines()
    assert rc == 1 and len(lines) == 4
    assert re.match(
        r"^2  CKD203  arg-expert-tensor-parallel-size +\[warning\] +fix: ckptdoctor fix-args CKPT", lines[0]
    )
    assert re.match(r"^2  CKD210  arg-tensor-parallel-num-weight-shards +\[error\] ", lines[1])
    assert lines[-1].startswith("Found 6 problems (2 errors, 4 warnings) in 2 checkpoints")
    rc, report = _json(capsys, "--statistics", str(CONVERTED))
    assert [(s["code"], s["count"]) for s in report["statistics"]] == [("CKD203", 1), ("CKD210", 1), ("CKD212", 1)]
    rc, out, err = _run(capsys, "check", "--isolated", "--statistics", "--format", "sarif", str(CONVERTED))
    assert rc == 2 and "--statistics" in err


def test_github_annotations(capsys, copy_fixture):
    rc, out, _ = _run(capsys, "check", "--isolated", "--output-format", "github", str(CONVERTED))
    lines = out.splitlines()
    assert rc == 1 and len(lines) == 3
    assert lines[0].startswith(f"::warning file={CONVERTED / ITER},title=CKD203::CKD203 no experts")
    assert lines[1].startswith(f"::error file={CONVERTED / ITER},title=CKD210::CKD210 ")
    assert lines[1].endswith(f"(fix: ckptdoctor fix-args {CONVERTED / ITER} --in-place)")
    save = copy_fixture("core019_tp1")
    odd = save / ITER / "__7_0,x:%\nFAKE.distcp"  # reserved characters in a property and the message
    odd.write_bytes(b"x")  # an empty unreferenced file is no finding
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "github", str(save))
    (line,) = out.splitlines()
    assert line.startswith("::warning file=") and "__7_0%2Cx%3A%25\\nFAKE.distcp,title=CKD115::" in line
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "github", str(FIXTURES / "core019_tp1"))
    assert rc == 0 and out == ""


def test_sarif(capsys):
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "sarif", str(CONVERTED))
    log = json.loads(out)
    assert rc == 1 and log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json")
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "ckptdoctor" and [r["id"] for r in driver["rules"]] == [r.code for r in all_rules()]
    assert [(r["ruleId"], r["level"]) for r in run["results"]] == [
        ("CKD203", "warning"),
        ("CKD210", "error"),
        ("CKD212", "warning"),
    ]
    for result in run["results"]:
        assert driver["rules"][result["ruleIndex"]]["id"] == result["ruleId"] and result["message"]["text"]
        uri = result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
        assert uri == (CONVERTED / ITER).as_uri()
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "sarif", str(FIXTURES / "core019_tp1"))
    assert rc == 0 and json.loads(out)["runs"][0]["results"] == []


# --- 7. config: unknown keys, codes blamed on the file, per-path-ignores ------------------------------------


def _write_config(directory: Path, body: str) -> Path:
    path = directory / "pyproject.toml"
    path.write_text(f"[project]\nname = 'x'\n\n[tool.ckptdoctor]\n{body}\n")
    return path


def test_misspelled_config_key(tmp_path):
    path = _write_config(tmp_path, 'ignor = ["CKD210"]')
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 2
    assert f"{path}: [tool.ckptdoctor] unknown key 'ignor' (did you mean 'ignore'?" in result.stderr
    _write_config(tmp_path, 'ignore = ["CKD203"]\n\n[tool.ckptdoctor.diff]\nignore-layout = true')  # other tables
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 1 and ": CKD203" not in result.stdout and ": CKD210" in result.stdout
    assert f'Config: {path} [tool.ckptdoctor] set ignore=["CKD203"].' in unwrapped(result.stdout)  # what it changed


def test_unknown_code_in_config_is_blamed_on_the_file(tmp_path):
    path = _write_config(tmp_path, 'ignore = ["CKD999"]')
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 2 and "--ignore" not in result.stderr
    assert f"{path}: [tool.ckptdoctor] ignore: 'CKD999' matches no rule code" in result.stderr
    path = _write_config(tmp_path, '[tool.ckptdoctor.per-path-ignores]\n"x/*" = ["CKD998"]')
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 2 and f"{path}: [tool.ckptdoctor] per-path-ignores 'x/*'" in result.stderr
    _write_config(tmp_path, "per-path-ignores = [1]")
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 2 and "per-path-ignores must be a table" in result.stderr


def test_per_path_ignores(tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(CONVERTED, runs / "converted")
    shutil.copytree(FIXTURES / "core016_convert_tp4", runs / "other")
    _write_config(
        tmp_path, '[tool.ckptdoctor.per-path-ignores]\n"runs/converted/*" = ["CKD2"]\n"*/other/iter_*" = "CKD203"'
    )
    result = run_cli("check", "--format", "json", "runs", cwd=tmp_path)
    found = [(f["path"], f["code"]) for f in json.loads(result.stdout)["findings"]]
    assert result.returncode == 1
    assert found == [("runs/other/iter_0000010/common.pt", "CKD210"), ("runs/other/iter_0000010/common.pt", "CKD212")]
    result = run_cli("check", "--format", "json", str(runs), cwd=tmp_path)  # absolute paths: relative to the config
    assert len(json.loads(result.stdout)["findings"]) == 2


# --- 8. --deep: NaN/Inf in model and optimizer tensors (CKD313, with torch) ---------------------------------


def _poison(save: Path, key: str, floats: list[float], chunk_index: int = 0) -> None:
    """Overwrite the first values of one chunk's storage record in place, its CRC-32 with them (as a save of those
    values writes it: only CKD313 is found, not CKD314)."""
    import struct

    from ckptdoctor.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(save)
    location = checkpoint.entries[key].chunks[chunk_index].storage
    assert location is not None
    patch_record(
        checkpoint.iteration_dir / location.relative_path, location, 0, struct.pack(f"<{len(floats)}f", *floats)
    )


def test_deep_flags_non_finite_values(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    nan, inf = float("nan"), float("inf")
    _poison(save, "decoder.layers.mlp.linear_fc1.weight", [nan, inf, -inf])
    _poison(save, "decoder.layers.mlp.linear_fc1.weight", [nan], 3)
    _poison(save, "optimizer.state.exp_avg_sq.output_layer.weight", [nan] * 5)
    rc, out, _ = _run(capsys, "check", "--isolated", str(save))
    assert rc == 0  # metadata only: values are not read
    rc, out, err = _run(capsys, "check", "--isolated", "--deep", str(save))
    data = save / ITER / "__0_0.distcp"
    assert rc == 1 and err == "", err
    assert unwrapped(out).splitlines() == [
        f"{data}: CKD313 [error] decoder.layers.mlp.linear_fc1.weight: 2 NaN and 2 Inf value(s) in 2 of 8 chunk(s) "
        "(first: chunk at [0, 0, 0])",
        f"{data}: CKD313 [error] optimizer.state.exp_avg_sq.output_layer.weight: 5 NaN and 0 Inf value(s) in 1 of 2 "
        "chunk(s) (first: chunk at [0, 0])",
        "Found 2 problems (2 errors, 0 warnings) in 1 checkpoint.",
    ]
    rc, out, _ = _run(capsys, "check", "--isolated", "--deep", "--ignore", "CKD313", str(save))
    assert rc == 0
    result = run_cli("check", "--isolated", "--deep", "--format", "json", str(save), block=("torch", "numpy"))
    assert result.returncode == 1 and result.stderr.strip().endswith("IMPORTED:")  # no torch needed
    assert [f["code"] for f in json.loads(result.stdout)["findings"]] == ["CKD313", "CKD313"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_count_non_finite_matches_torch(dtype):
    torch = pytest.importorskip("torch")
    from ckptdoctor.rules.non_finite import count_non_finite

    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(4099, generator=generator) * 1000).to(getattr(torch, dtype))
    index = torch.randperm(4099, generator=generator)
    values[index[:7]] = float("nan")
    values[index[7:12]] = float("inf")
    values[index[12:14]] = float("-inf")
    raw = values.view(torch.int16 if values.element_size() == 2 else values.dtype).numpy().tobytes()
    expected = (int(torch.isnan(values).sum()), int(torch.isinf(values).sum()))
    assert count_non_finite(raw, f"torch.{dtype}") == expected and expected[0] == 7
    assert count_non_finite(raw, "torch.int64") is None


def test_nothing_left_after_ignore_is_no_pass(capsys, tmp_path):
    rc, out, err = _run(capsys, "check", "--isolated", "--ignore", "CKD100", str(tmp_path))
    assert rc == 1 and err.strip() == f"ckptdoctor: no checkpoint found under {tmp_path}"
