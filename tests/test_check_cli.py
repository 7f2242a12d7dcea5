"""``ckptdoctor check`` / ``rules`` as a command: paths, options, config, JSON, no torch, progress, pre-commit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REPO, run_cli, unwrapped

from ckptdoctor import arg_rules
from ckptdoctor.cli import main
from ckptdoctor.rules.registry import all_rules

ITER = "iter_0000010"
CONVERTED = FIXTURES / "core019_convert_tp4"  # real converter-style re-shard: inherited weight-shard args


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _codes(out: str) -> list[str]:
    return [f["code"] for f in json.loads(out)["findings"]]


# --- paths ----------------------------------------------------------------------------------------------


def test_files_map_to_their_checkpoint_once(capsys):
    """pre-commit passes file names: each maps to its iteration dir, checked once; other files are skipped."""
    it = FIXTURES / "core016_tp2" / ITER
    files = [str(p) for p in sorted(it.iterdir())] + [str(REPO / "README.md")]
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "json", *files)
    report = json.loads(out)
    assert rc == 0 and report["checked"] == [str(it)] and report["skipped"] == [str(REPO / "README.md")]


def test_tracker_file_checks_the_save_dir(capsys, copy_fixture):
    save = copy_fixture("core016_tp1")
    (save / "latest_checkpointed_iteration.txt").write_text("30")
    rc, out, _ = _run(capsys, "check", "--isolated", str(save / "latest_checkpointed_iteration.txt"))
    assert rc == 1 and f"{save / 'latest_checkpointed_iteration.txt'}: CKD121 [error] tracker says 30" in unwrapped(out)


def test_missing_path_is_a_usage_error(capsys):
    rc, out, err = _run(capsys, "check", "--isolated", str(FIXTURES / "nope"))
    assert rc == 2 and out == "" and err.startswith("ckptdoctor: error: ") and "no such file" in err


def test_all_iterations(capsys, copy_fixture):
    save = copy_fixture("core016_tp1")
    shutil.copytree(save / ITER, save / "iter_0000005")
    (save / "iter_0000005" / "metadata.json").unlink()
    rc, out, _ = _run(capsys, "check", "--isolated", str(save))
    assert rc == 0  # the tracker's iteration is fine
    rc, out, _ = _run(capsys, "check", "--isolated", "--all-iterations", "--format", "json", str(save))
    report = json.loads(out)
    assert rc == 1 and len(report["checked"]) == 2 and _codes(out) == ["CKD101", "CKD132"]  # a copy of iter 10
    assert report["findings"][0]["path"] == str(save / "iter_0000005")


# --- options --------------------------------------------------------------------------------------------


def test_select_and_ignore_codes_and_prefixes(capsys):
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "json", str(CONVERTED))
    assert rc == 1 and "CKD210" in _codes(out) and len(set(_codes(out))) > 1
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "json", "--select", "CKD210", str(CONVERTED))
    assert _codes(out) == ["CKD210"]
    rc, out, _ = _run(capsys, "check", "--isolated", "--ignore", "CKD2", str(CONVERTED))
    assert rc == 0
    rc, out, _ = _run(
        capsys,
        "check",
        "--isolated",
        "--format",
        "json",
        "--select",
        "CKD1,CKD21",
        "--ignore",
        "CKD212",
        str(CONVERTED),
    )
    assert _codes(out) == ["CKD210"]


def test_unknown_code_is_a_usage_error(capsys):
    rc, _, err = _run(capsys, "check", "--isolated", "--select", "CKD999", str(CONVERTED))
    assert rc == 2 and "'CKD999' matches no rule code" in err


def _write_config(directory: Path, body: str) -> None:
    (directory / "pyproject.toml").write_text(f"[project]\nname = 'x'\n\n[tool.ckptdoctor]\n{body}\n")


def test_config_from_pyproject_upward(tmp_path):
    _write_config(tmp_path, 'ignore = ["CKD203", "CKD212"]\nformat = "json"')
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    result = run_cli("check", str(CONVERTED), cwd=sub)
    assert result.returncode == 1 and _codes(result.stdout) == ["CKD210"]
    result = run_cli("check", "--ignore", "CKD21", str(CONVERTED), cwd=sub)  # the command line wins
    assert result.returncode == 1 and _codes(result.stdout) == ["CKD203"]
    result = run_cli("check", "--isolated", str(CONVERTED), cwd=sub)
    assert "CKD212" in result.stdout and not result.stdout.startswith("{")


def test_bad_config_is_a_usage_error(tmp_path):
    _write_config(tmp_path, "deep = 'yes'")
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 2 and "[tool.ckptdoctor] deep must be bool" in result.stderr
    _write_config(tmp_path, 'select = ["CKD9"]')
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 2 and "matches no rule code" in result.stderr


@pytest.mark.parametrize(
    "body, why",
    [
        ("x = " + "9" * 5000, "4300 digits"),  # tomllib raises a plain ValueError: was an internal error
        ("x = " + "[" * 50_000 + "]" * 50_000, "nested too deeply"),  # RecursionError
    ],
)
def test_hostile_pyproject_is_one_error_line(tmp_path, body, why):
    _write_config(tmp_path, body)
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    error = result.stderr.split("\n\nIMPORTED:")[0].strip()  # run_cli appends the modules the run imported
    assert result.returncode == 2 and len(error.splitlines()) == 1, result.stderr
    assert "pyproject.toml: not valid TOML" in error and why in error and "internal error" not in error


def test_json_report_shape(capsys):
    rc, out, _ = _run(capsys, "check", "--isolated", "--format", "json", str(CONVERTED))
    report = json.loads(out)
    jsonschema.validate(report, json.loads((REPO / "docs/check.schema.json").read_text()))
    assert report["schema"] == "ckptdoctor.check/1"
    assert set(report) == {
        "schema",
        "checked",
        "skipped",
        "findings",
        "counts",
        "missing",
        "safe_for_loaders",
        "gate",
        "config",
    }
    assert report["safe_for_loaders"] is True and report["config"] is None  # --isolated: no config looked for
    for f in report["findings"]:
        assert set(f) == {"code", "path", "message", "severity", "fix"} and f["severity"] in ("error", "warning")
    assert sum(report["counts"].values()) == len(report["findings"])


# --- rules ----------------------------------------------------------------------------------------------


def test_rules_registry():
    rules = all_rules()
    codes = [r.code for r in rules]
    assert len(codes) == len(set(codes))
    prefix = {"structure": "CKD1", "consistency": "CKD2", "integrity": "CKD3", "safety": "CKD4"}
    for rule in rules:
        assert rule.code.startswith(prefix[rule.family]) and rule.summary and rule.rationale
    # the fix-args rule table is listed, not re-implemented
    assert {r.code for r in arg_rules.RULES} | {"CKD204"} <= set(codes)


def test_rules_command(capsys):
    rc, out, _ = _run(capsys, "rules")
    assert rc == 0
    for rule in all_rules():
        assert f"{rule.code}  {rule.name}" in out
    rc, out, _ = _run(capsys, "rules", "--format", "json")
    listed = json.loads(out)["rules"]
    assert [r["code"] for r in listed] == [r.code for r in all_rules()]
    assert {"code", "name", "family", "severity", "summary", "rationale", "fix"} == set(listed[0])
    rc, out, _ = _run(capsys, "rules", "CKD4")
    assert out.startswith("CKD401") and "CKD1" not in out


# --- no torch, no megatron; progress bar ----------------------------------------------------------------


@pytest.mark.parametrize("deep", [False, True])
def test_check_without_torch_or_megatron(deep):
    args = [
        "check",
        "--isolated",
        *(["--deep"] if deep else []),
        str(FIXTURES / "core019_tp2"),
        str(FIXTURES / "core016_tp2"),
    ]
    result = run_cli(*args, block=("torch", "megatron"))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().endswith("IMPORTED:")


def _run_with_tty_stderr(*args: str) -> str:
    """Run the CLI with stderr on a pseudo-terminal; returns what was written there."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptdoctor", *args], stdout=subprocess.DEVNULL, stderr=slave, cwd=REPO
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_progress_bar_only_on_a_tty_and_not_quiet(capsys):
    target = str(FIXTURES / "core019_tp2")
    assert "100%" in _run_with_tty_stderr("check", "--isolated", "--deep", target)
    assert _run_with_tty_stderr("check", "--isolated", "--deep", "--quiet", target) == ""
    rc, _, err = _run(capsys, "check", "--isolated", "--deep", target)  # stderr captured: not a tty
    assert rc == 0 and err == ""


# --- pre-commit -----------------------------------------------------------------------------------------


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args], cwd=cwd, check=True, capture_output=True
    )


@pytest.mark.network
def test_pre_commit_hook_for_real(tmp_path):
    """`pre-commit try-repo` installs the hook from a copy of this repo (uncommitted work included) into its
    own virtualenv (pip: click, tabulate from PyPI) and runs it on a repo holding a real fixture."""
    pre_commit = shutil.which("pre-commit", path=str(Path(sys.executable).parent)) or shutil.which("pre-commit")
    if pre_commit is None:
        pytest.skip("pre-commit not installed (pip install 'ckptdoctor[test]')")
    # try-repo needs a git repo; commit the working tree in a scratch copy, never in this checkout.
    hook_repo = tmp_path / "hook-repo"
    shutil.copytree(
        REPO,
        hook_repo,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "bench", "fixtures", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", "build"
        ),
    )
    _git(hook_repo, "init", "-q")
    _git(hook_repo, "add", "-A")
    _git(hook_repo, "commit", "-q", "-m", "hook under test")
    user = tmp_path / "user-repo"
    user.mkdir()
    shutil.copytree(FIXTURES / "core019_tp2", user / "ckpt")
    _git(user, "init", "-q")
    _git(user, "add", "-A")
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")}

    def try_repo() -> subprocess.CompletedProcess:
        return subprocess.run(
            [pre_commit, "try-repo", str(hook_repo), "ckptdoctor-check", "--all-files"],
            cwd=user,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )

    clean = try_repo()
    if clean.returncode != 0 and "CKD" not in clean.stdout and ("pip" in clean.stdout or "Errno" in clean.stdout):
        pytest.skip(f"pre-commit could not build the hook environment (no network?): {clean.stdout[-400:]}")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "Passed" in clean.stdout
    (user / "ckpt" / ITER / "__1_0.distcp").unlink()
    _git(user, "add", "-A")
    broken = try_repo()
    assert broken.returncode == 1, broken.stdout
    assert "Failed" in broken.stdout and "CKD113 [error] __1_0.distcp missing" in broken.stdout
