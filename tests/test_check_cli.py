"""``ckptdoctor check`` / ``rules`` as a command: paths, options, config, JSON, no torch, progress, pre-commit."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REPO, run_cli, shipped_schema, unwrapped

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
    (tmp_path / "pyproject.toml").write_text("tool = 3\n")
    for command in (("check", str(CONVERTED)), ("diff", str(CONVERTED), str(CONVERTED))):
        result = run_cli(*command, cwd=tmp_path)
        assert result.returncode == 2 and "`tool` is not a table" in result.stderr, result.stderr
        assert "internal error" not in result.stderr
    _write_config(tmp_path, "all-iterations = true\nall_iterations = false")
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 2 and "one key, spelt two ways" in result.stderr, result.stderr
    _write_config(tmp_path, "[tool.ckptdoctor.health-rules]\n[tool.ckptdoctor.health_rules]")
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 2 and "one key, spelt two ways" in result.stderr, result.stderr
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
    jsonschema.validate(report, shipped_schema("check"))
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
    prefix = {"structure": "CKD1", "consistency": "CKD2", "integrity": "CKD3", "safety": "CKD4", "health": "CKD5"}
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


def _pre_commit() -> str:
    found = shutil.which("pre-commit", path=str(Path(sys.executable).parent)) or shutil.which("pre-commit")
    if found is None:
        pytest.skip("pre-commit not installed (pip install 'ckptdoctor[test]')")
    return found


@pytest.fixture(scope="module")
def hook_repo(tmp_path_factory) -> Path:
    """A committed copy of this repo (uncommitted work included): pre-commit installs hooks from a git repo."""
    hook_repo = tmp_path_factory.mktemp("hooks") / "hook-repo"
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
    return hook_repo


@pytest.fixture(scope="module")
def pre_commit_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pre-commit-home")


def _skip_without_hook_env(proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and "CKD" not in out and ("pip" in out or "Errno" in out):
        pytest.skip(f"pre-commit could not build the hook environment (no network?): {out[-400:]}")


@pytest.mark.network
def test_pre_commit_hook_for_real(tmp_path, hook_repo, pre_commit_home):
    """`pre-commit try-repo` installs the hook from a copy of this repo (uncommitted work included) into its
    own virtualenv (pip: click, tabulate from PyPI) and runs it on a repo holding a real fixture."""
    pre_commit = _pre_commit()
    user = tmp_path / "user-repo"
    user.mkdir()
    shutil.copytree(FIXTURES / "core019_tp2", user / "ckpt")
    _git(user, "init", "-q")
    _git(user, "add", "-A")
    env = {**os.environ, "PRE_COMMIT_HOME": str(pre_commit_home)}

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
    _skip_without_hook_env(clean)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "Passed" in clean.stdout
    (user / "ckpt" / ITER / "__1_0.distcp").unlink()
    _git(user, "add", "-A")
    broken = try_repo()
    assert broken.returncode == 1, broken.stdout
    assert "Failed" in broken.stdout and "CKD113 [error] __1_0.distcp missing" in broken.stdout


def _commit(repo: Path, env: dict[str, str], message: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-q", "-m", message],
        cwd=repo,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _docs_snippet(variant: str) -> str:
    """The ``.pre-commit-config.yaml`` of docs/pre-commit.md: ``"rev"`` the one installing from a repository (with a
    ``rev:``), ``"local"`` the ``repo: local`` one."""
    text = (REPO / "docs" / "pre-commit.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)
    (block,) = [b for b in blocks if ("- repo: local" in b) == (variant == "local")]
    return block


def _user_repo_with_hooks(root: Path, hook_repo: Path, pre_commit: str, env: dict[str, str]) -> None:
    """``root`` (holding a checkpoint) as a git repo whose commits run the hooks as docs/pre-commit.md says, with only
    ``repo:`` and ``rev:`` replaced by the clone under test and its HEAD."""
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=hook_repo, capture_output=True, text=True, check=True)
    config, repos = re.subn(r"^(\s*- repo: ).*$", rf"\g<1>{hook_repo}", _docs_snippet("rev"), flags=re.M)
    config, revs = re.subn(r"^(\s*rev: ).*$", rf"\g<1>{rev.stdout.strip()}", config, flags=re.M)
    assert repos == revs == 1 and re.search(r"^\s*rev: [0-9a-f]{40}\s", _docs_snippet("rev"), re.M)
    (root / ".pre-commit-config.yaml").write_text(config)
    _git(root, "init", "-q")
    subprocess.run([pre_commit, "install"], cwd=root, capture_output=True, check=True, env=env)


@pytest.mark.network
def test_pre_commit_staged_hook_catches_deletions(tmp_path, hook_repo, pre_commit_home):
    """Real pre-commit, real ``git commit`` (issue #35 point 2): deleting a data file, metadata.json or the tracker's
    iteration dir is refused by ckptdoctor-check-staged (ckptdoctor-check had "no files to check"); deleting a whole
    checkpoint, or committing no checkpoint path, passes; a pyproject.toml inside a checkpoint dir configures
    nothing, even where the repository is the checkpoint."""
    pre_commit = _pre_commit()
    env = {**os.environ, "PRE_COMMIT_HOME": str(pre_commit_home)}
    user = tmp_path / "user-repo"
    user.mkdir()
    shutil.copytree(FIXTURES / "core019_tp2", user / "ckpt")
    (user / "README.md").write_text("runs\n")
    _user_repo_with_hooks(user, hook_repo, pre_commit, env)
    _git(user, "add", "-A")
    first = _commit(user, env, "checkpoint")
    _skip_without_hook_env(first)
    assert first.returncode == 0, first.stdout + first.stderr

    refused = {
        f"ckpt/{ITER}/__1_0.distcp": "CKD113 [error] __1_0.distcp missing",
        f"ckpt/{ITER}/metadata.json": "CKD101 [error] metadata.json missing",
        f"ckpt/{ITER}": "CKD121 [error] tracker says 10 but iter_0000010 does not exist",
    }
    for deleted, expected in refused.items():
        _git(user, "rm", "-r", "-q", deleted)
        proc = _commit(user, env, f"delete {deleted}")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and expected in out, out
        assert re.search(r"ckptdoctor check \(Megatron.*\(no files to check\)Skipped", out), out  # the old hook
        assert re.search(r"ckptdoctor check --staged.*Failed", out), out
        _git(user, "reset", "-q", "--hard")

    (user / "README.md").write_text("runs, documented\n")
    _git(user, "add", "README.md")
    readme = _commit(user, env, "no checkpoint path")
    assert readme.returncode == 0, readme.stdout + readme.stderr
    _git(user, "rm", "-r", "-q", "ckpt")
    gone = _commit(user, env, "a whole checkpoint deleted")
    assert gone.returncode == 0, gone.stdout + gone.stderr

    # the repository is the save dir: its pyproject.toml is inside a checkpoint and is never read
    repo_ckpt = tmp_path / "ckpt-repo"
    shutil.copytree(FIXTURES / "core019_tp2", repo_ckpt)
    (repo_ckpt / "pyproject.toml").write_text('[tool.ckptdoctor]\nignore = ["CKD1"]\n')
    _user_repo_with_hooks(repo_ckpt, hook_repo, pre_commit, env)
    _git(repo_ckpt, "add", "-A")
    assert _commit(repo_ckpt, env, "checkpoint").returncode == 0
    _git(repo_ckpt, "rm", "-q", f"{ITER}/__0_0.distcp")
    proc = _commit(repo_ckpt, env, "delete a data file")
    assert proc.returncode == 1 and "CKD113 [error] __0_0.distcp missing" in proc.stdout + proc.stderr


def test_pre_commit_local_variant_from_docs(tmp_path, pre_commit_home):
    """docs/pre-commit.md's ``repo: local`` config, as written, with the ckptdoctor of this environment on PATH (no
    network): a commit of a checkpoint passes, a commit deleting one of its data files is refused."""
    pre_commit = _pre_commit()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "ckptdoctor"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m ckptdoctor "$@"\n')
    shim.chmod(0o755)
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ,
        "PRE_COMMIT_HOME": str(pre_commit_home),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": python_path,
    }
    user = tmp_path / "user-repo"
    user.mkdir()
    shutil.copytree(FIXTURES / "core019_tp2", user / "ckpt")
    (user / ".pre-commit-config.yaml").write_text(_docs_snippet("local"))
    _git(user, "init", "-q")
    subprocess.run([pre_commit, "install"], cwd=user, capture_output=True, check=True, env=env)
    _git(user, "add", "-A")
    first = _commit(user, env, "checkpoint")
    assert first.returncode == 0, first.stdout + first.stderr
    _git(user, "rm", "-q", f"ckpt/{ITER}/__1_0.distcp")
    refused = _commit(user, env, "delete a data file")
    out = refused.stdout + refused.stderr
    assert refused.returncode == 1 and "CKD113 [error] __1_0.distcp missing" in out, out


def test_check_staged_without_pre_commit(capsys, tmp_path, monkeypatch):
    """``check --staged`` itself (no network): what git has staged, deletions included; not in a git repo: exit 2."""
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "core016_tp1", repo / "runs" / "a")
    (repo / "notes.txt").write_text("x\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "init")
    monkeypatch.chdir(repo / "runs")  # paths are named from the working directory
    rc, out, err = _run(capsys, "check", "--staged", "--format", "json")
    assert rc == 0 and json.loads(out)["checked"] == [], err
    _git(repo, "rm", "-q", f"runs/a/{ITER}/common.pt", "notes.txt")
    rc, out, err = _run(capsys, "check", "--staged", "--format", "json")
    report = json.loads(out)
    assert rc == 1 and report["checked"] == [f"a/{ITER}"], err
    assert [f["code"] for f in report["findings"]] == ["CKD130"]
    rc, out, err = _run(capsys, "check", "--staged", "a")
    assert rc == 2 and "not both" in err
    rc, out, err = _run(capsys, "check")
    assert rc == 2 and "give PATHS" in err and "not both" not in err
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "check", "--staged")
    assert rc == 2 and "--staged: git rev-parse failed" in err and err.count("\n") == 1, err


def test_check_staged_reports_what_the_commit_holds_otherwise(capsys, tmp_path, monkeypatch):
    """check reads the working tree: a file there the commit leaves out (git rm --cached, untracked, ignored) or
    holds another version of is CKD160, always reported, and the gate vouches for nothing (a staged .metadata
    nobody read could run code)."""
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "core019_tp2", repo / "ck")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    monkeypatch.chdir(repo)
    rc, out, err = _run(capsys, "check", "--staged", "--format", "json")
    assert rc == 0 and json.loads(out)["checked"] == [f"ck/{ITER}"], err
    _git(repo, "rm", "-q", "--cached", f"ck/{ITER}/__1_0.distcp")
    rc, out, err = _run(capsys, "check", "--staged", "--ignore", "CKD1", "--format", "json")
    report = json.loads(out)
    jsonschema.validate(report, shipped_schema("check"))
    (found,) = report["findings"]
    assert rc == 1 and report["safe_for_loaders"] is False and found["code"] == "CKD160"
    assert found["path"] == f"ck/{ITER}" and "1 file not staged" in found["message"]
    assert "__1_0.distcp" in found["message"] and "leaves it out" in found["message"]
    _git(repo, "add", f"ck/{ITER}/__1_0.distcp")
    for junk in (".DS_Store", ".metadata.bak-20261207T000000", "Thumbs.db"):  # nobody's checkpoint: not counted
        (repo / "ck" / ITER / junk).write_bytes(b"x")
    rc, out, err = _run(capsys, "check", "--staged")
    assert rc == 0, out + err
    metadata = repo / "ck" / ITER / "metadata.json"
    metadata.write_text(metadata.read_text() + " ")  # the staged version is not what check reads
    rc, out, _ = _run(capsys, "check", "--staged")
    assert rc == 1 and "CKD160" in out and "1 file changed since staged: metadata.json" in out
    _git(repo, "add", "-A")
    rc, out, err = _run(capsys, "check", "--staged", "--format", "json")
    assert rc == 0 and json.loads(out)["safe_for_loaders"] is True, out + err


def test_a_folder_named_release_or_a_metadata_folder_is_no_checkpoint(capsys, tmp_path, monkeypatch):
    """A repository's release/ folder (no tracker beside it, no checkpoint files in it) is not Megatron's release
    iteration dir, an Eclipse workspace's .metadata/ folder is not a DCP index, and --staged looks no higher than
    the repository: none made a save dir of the repository (skipping its checkpoints, ignoring its config)."""
    workspace = tmp_path / "ws"
    (workspace / ".metadata").mkdir(parents=True)
    repo = workspace / "repo"
    (repo / "release").mkdir(parents=True)
    (repo / "release" / "notes.md").write_text("x\n")
    shutil.copytree(CONVERTED, repo / "ck")
    _write_config(repo, 'ignore = ["CKD212"]')
    monkeypatch.chdir(repo)
    rc, out, _ = _run(capsys, "check", ".", "--format", "json")
    report = json.loads(out)
    assert report["checked"] == [f"ck/{ITER}"] and report["config"]["path"] == str(repo / "pyproject.toml")
    assert rc == 1 and {f["code"] for f in report["findings"]} == {"CKD203", "CKD210"}
    _git(repo, "init", "-q")
    _git(repo, "add", "release/notes.md", "pyproject.toml")
    rc, out, err = _run(capsys, "check", "--staged")
    assert rc == 0 and "CKD1" not in out + err, out + err
    rc, out, err = _run(capsys, "check", "release/notes.md")  # a file of no checkpoint: skipped
    assert rc == 1 and "CKD1" not in out, out + err
    # beside a tracker, an (empty) release dir is the iteration dir the tracker names
    (repo / "ck2" / "release").mkdir(parents=True)
    (repo / "ck2" / "latest_checkpointed_iteration.txt").write_text("release")
    rc, out, _ = _run(capsys, "check", "ck2")
    assert rc == 1 and "ck2/release: CKD1" in out


def test_a_torchtitan_save_dir_never_configures_its_check(capsys, tmp_path, monkeypatch):
    save = tmp_path / "titan"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2_titan_ws2", save)
    (save / "step-10" / "__1_0.distcp").unlink()
    _write_config(save, 'ignore = ["ALL"]')
    monkeypatch.chdir(save)
    rc, out, _ = _run(capsys, "check", ".", "--format", "json")
    report = json.loads(out)
    assert rc == 1 and "CKD113" in {f["code"] for f in report["findings"]}
    assert report["config"]["path"] is None and report["config"]["not_read"] == [str(save / "pyproject.toml")]


def test_configured_json_format_in_any_case_and_for_errors_too(tmp_path):
    """format = "JSON" in the config was refused ("is not one of") where --format JSON works; with format = "json"
    configured an error printed no JSON on stdout (only --format json on the command line did)."""
    _write_config(tmp_path, 'format = "JSON"')
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 1 and json.loads(result.stdout)["schema"] == "ckptdoctor.check/1"
    _write_config(tmp_path, 'format = "json"\nte-version = "2.17"')
    result = run_cli("check", str(CONVERTED), cwd=tmp_path)
    error = json.loads(result.stdout)
    assert result.returncode == 2 and error["schema"] == "ckptdoctor.error/1" and "te-version" in error["error"]
    result = run_cli("check", "--isolated", "--te-version", "2.17", str(CONVERTED), cwd=tmp_path)
    assert result.returncode == 2 and not result.stdout  # --isolated: the config's format is not used
