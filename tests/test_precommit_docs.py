"""The pre-commit snippets of the docs, run as written (issue #36 point 4): the remote one with only ``repo:`` and
``rev:`` replaced by a local clone and its HEAD, the ``repo: local`` one as it is, each on a repository holding a
real fixture, by real pre-commit. The snippets are read from README.md and docs/ (wherever they are)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO
from test_check_cli import _git, _pre_commit, _skip_without_hook_env, hook_repo, pre_commit_home  # noqa: F401

ITER = "iter_0000010"
_REPO_LINE = re.compile(r"^(?P<indent>\s*-\s*)repo:\s*(?P<value>\S+).*$", re.M)
_REV_LINE = re.compile(r"^(?P<indent>\s*)rev:\s*(?P<value>\S+).*$", re.M)


def _doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _snippet(local: bool) -> tuple[Path, str]:
    """The first ``.pre-commit-config.yaml`` block of the docs naming ckptdoctor's hooks: ``repo: local`` or not."""
    for path in _doc_files():
        for block in re.findall(r"^```ya?ml\n(.*?)^```", path.read_text(encoding="utf-8"), re.M | re.S):
            repo = _REPO_LINE.search(block)
            if "ckptdoctor-check" in block and repo is not None and (repo.group("value") == "local") == local:
                return path, block
    pytest.fail(f"no {'`repo: local`' if local else 'remote'} pre-commit snippet in README.md or docs/")


def _user_repo(root: Path, config: str) -> Path:
    user = root / "user-repo"
    user.mkdir()
    shutil.copytree(FIXTURES / "core019_tp2", user / "ckpt")
    (user / ".pre-commit-config.yaml").write_text(config)
    _git(user, "init", "-q")
    _git(user, "add", "-A")
    return user


def _run(pre_commit: str, user: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [pre_commit, "run", *args], cwd=user, capture_output=True, text=True, env=env, timeout=600, check=False
    )


def _passes_then_catches_a_deleted_file(pre_commit: str, user: Path, env: dict[str, str], *args: str) -> None:
    clean = _run(pre_commit, user, env, *args)
    _skip_without_hook_env(clean)
    assert clean.returncode == 0 and "Passed" in clean.stdout, clean.stdout + clean.stderr
    (user / "ckpt" / ITER / "__1_0.distcp").unlink()
    _git(user, "add", "-A")
    broken = _run(pre_commit, user, env, *args)
    assert broken.returncode == 1 and "Failed" in broken.stdout, broken.stdout + broken.stderr
    assert "CKD113 [error] __1_0.distcp missing" in broken.stdout


def test_the_remote_snippet_pins_a_full_commit_sha_and_no_placeholder_url():
    path, block = _snippet(local=False)
    rev = _REV_LINE.search(block)
    assert rev is not None and re.fullmatch(r"[0-9a-f]{40}", rev.group("value")), block
    assert "<org>" not in block and "github.com/<" not in path.read_text(encoding="utf-8")
    assert re.search(r"release tags?\b.*replace", path.read_text(encoding="utf-8"), re.S), "the note on tags"


@pytest.mark.network
@pytest.mark.mcore  # the slow tier: pre-commit builds a hook environment (~40 s)
def test_the_remote_snippet_runs_with_only_repo_and_rev_replaced(tmp_path, hook_repo, pre_commit_home):  # noqa: F811
    """pre-commit builds the hook's environment from the clone (pip: click and tabulate from PyPI)."""
    pre_commit = _pre_commit()
    _, block = _snippet(local=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=hook_repo, capture_output=True, text=True, check=True)
    config = _REPO_LINE.sub(lambda m: f"{m.group('indent')}repo: {hook_repo}", block, count=1)
    config = _REV_LINE.sub(lambda m: f"{m.group('indent')}rev: {head.stdout.strip()}", config, count=1)
    assert config.count("\n") == block.count("\n")  # the two lines replaced, nothing else
    user = _user_repo(tmp_path, config)
    env = {**os.environ, "PRE_COMMIT_HOME": str(pre_commit_home)}
    _passes_then_catches_a_deleted_file(pre_commit, user, env, "--all-files")


@pytest.mark.mcore  # the slow tier: two pre-commit runs (seconds each)
def test_the_local_snippet_runs_the_installed_ckptdoctor_as_written(tmp_path):
    pre_commit = _pre_commit()
    installed = shutil.which("ckptdoctor", path=str(Path(sys.executable).parent))
    if installed is None:
        pytest.skip("no ckptdoctor console script beside this interpreter (pip install -e .)")
    _, block = _snippet(local=True)
    user = _user_repo(tmp_path, block)
    env = {
        **os.environ,
        "PATH": f"{Path(installed).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
    }
    _passes_then_catches_a_deleted_file(pre_commit, user, env)
