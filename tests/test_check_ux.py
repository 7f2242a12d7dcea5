"""``ckptdoctor check`` as ruff / pre-commit users expect (issue #11): recursive discovery, no false green,
missing paths, severity and fix per finding, --statistics, GitHub annotations, SARIF, strict config."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
from conftest import FIXTURES, REPO, run_cli

from ckptdoctor.cli import main
from ckptdoctor.ops.check import CHECKPOINT_FILE_RE
from ckptdoctor.rules import FIX_COMMANDS, all_rules, fix_command

ITER = "iter_0000010"
CONVERTED = FIXTURES / "core019_convert_tp4"  # CKD203, CKD210, CKD212: fixed by fix-args
SCHEMA = json.loads((REPO / "docs/check.schema.json").read_text())


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
    assert rc == 1 and f"{runs / 'notes'}: CKD100 [error] no checkpoint found under it" in out


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
    assert "CKD113 [error] __1_0.distcp missing" in out and "in 2 checkpoints" in out
    assert err.splitlines() == [f"ckptdoctor: error: {missing}: no such file or directory"]
    rc, report = _json(capsys, str(good), missing)
    assert rc == 2 and report["missing"] == [missing] and report["checked"] == [str(good / ITER)]


# --- 4, 5. severity and fix per finding; `rules` names the fixer ---------------------------------------------


def test_text_shows_severity_and_fix(capsys):
    rc, out, _ = _run(capsys, "check", "--isolated", str(CONVERTED))
    lines = out.splitlines()
    assert rc == 1
    assert lines[0].startswith(f"{CONVERTED / ITER}: CKD203 [warning] ")
    assert lines[1] == f"    fix: ckptdoctor fix-args {CONVERTED / ITER} --write --in-place"
    assert f"{CONVERTED / ITER}: CKD210 [error] tensor_parallel_num_weight_shards=1" in out
    assert lines[-1] == "Found 3 problems (1 error, 2 warnings) in 1 checkpoint; 3 fixable (see the fix: lines)."


def test_fix_in_json_and_repair_hints(capsys, copy_fixture):
    rc, report = _json(capsys, str(CONVERTED))
    assert {f["fix"] for f in report["findings"]} == {f"ckptdoctor fix-args {CONVERTED / ITER} --write --in-place"}
    save = copy_fixture("core019_tp2")
    (save / ITER / "metadata.json").unlink()
    shutil.copy(save / ITER / "__0_0.distcp", save / ITER / "__5_0.distcp")
    (save / "latest_checkpointed_iteration.txt").write_text("30")
    rc, report = _json(capsys, "--all-iterations", str(save))
    fixes = {f["code"]: f["fix"] for f in report["findings"]}
    assert fixes["CKD101"] == fixes["CKD115"] == f"ckptdoctor repair {save / ITER} --write --in-place"
    assert fixes["CKD121"] == f"ckptdoctor repair {save} --write --in-place"  # the tracker: the save dir
    (save / ITER / "__0_0.distcp").write_bytes(b"x")
    rc, report = _json(capsys, str(save / ITER))
    assert {f["fix"] for f in report["findings"] if f["code"] == "CKD114"} == {None}  # nothing fixes lost data


def test_fix_table_is_the_one_source(capsys):
    for rule in all_rules():
        assert rule.fix == fix_command(rule.code)
    assert all(any(r.code.startswith(prefix) for r in all_rules()) for prefix in FIX_COMMANDS)
    assert fix_command("CKD210", "my ckpt") == "ckptdoctor fix-args 'my ckpt' --write --in-place"
    rc, out, _ = _run(capsys, "rules", "CKD210")
    assert rc == 0 and "fix: ckptdoctor fix-args CKPT --write --in-place" in out
    rc, out, _ = _run(capsys, "rules", "CKD113")
    assert "fix: none (no automatic fix)" in out
    rc, out, _ = _run(capsys, "rules", "--format", "json", "CKD12")
    assert {r["fix"] for r in json.loads(out)["rules"]} == {"ckptdoctor repair CKPT --write --in-place"}


# --- 6. --statistics, github, sarif ------------------------------------------------------------------------


def test_statistics(capsys):
    rc, out, _ = _run(capsys, "check", "--isolated", "--statistics", str(CONVERTED),
                      str(FIXTURES / "core016_convert_tp4"))
    lines = out.splitlines()
    assert rc == 1 and len(lines) == 4
    assert re.match(r"^2  CKD203  arg-expert-tensor-parallel-size +\[warning\] +fix: ckptdoctor fix-args CKPT",
                    lines[0])
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
    assert lines[1].endswith(f"(fix: ckptdoctor fix-args {CONVERTED / ITER} --write --in-place)")
    save = copy_fixture("core019_tp1")
    odd = save / ITER / "__7_0,x:%\nFAKE.distcp"  # reserved characters in a property and the message
    odd.write_bytes(b"")
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
        ("CKD203", "warning"), ("CKD210", "error"), ("CKD212", "warning")]
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
    assert result.returncode == 1 and "CKD203" not in result.stdout and "CKD210" in result.stdout


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
    _write_config(tmp_path, '[tool.ckptdoctor.per-path-ignores]\n"runs/converted/*" = ["CKD2"]\n'
                            '"*/other/iter_*" = "CKD203"')
    result = run_cli("check", "--format", "json", "runs", cwd=tmp_path)
    found = [(f["path"], f["code"]) for f in json.loads(result.stdout)["findings"]]
    assert result.returncode == 1
    assert found == [("runs/other/iter_0000010/common.pt", "CKD210"), ("runs/other/iter_0000010/common.pt", "CKD212")]
    result = run_cli("check", "--format", "json", str(runs), cwd=tmp_path)  # absolute paths: relative to the config
    assert len(json.loads(result.stdout)["findings"]) == 2
