"""Regressions found by the randomized interrupt campaign (SIGKILL / SIGINT / SIGTERM at random instants of
every write command, in place and with --output): each reproduced deterministically at a fault point.
Fast: no torch or megatron-core is needed (the children run the CLI)."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import run_ckptdoctor

from ckptdoctor.atomic import FAULT_ENV, FAULT_EXIT_CODE, FAULT_MODE_ENV
from ckptdoctor.ops.check import check_paths


def _fault_env(step: str, mode: str = "exit") -> dict:
    return dict(os.environ, **{FAULT_ENV: step, FAULT_MODE_ENV: mode})


def _leftovers(path: Path) -> list[str]:
    return sorted(Path(f.path).name for f in check_paths([str(path)]).findings if f.code == "CKD151")


def test_check_of_an_output_save_dir_names_the_staging_dir_of_an_interrupted_write(copy_fixture, tmp_path):
    """A killed ``strip-frozen --output`` leaves its staging dir beside the output; the rerun succeeds and does
    not touch it. ``check`` on the output save dir must name it (it only did when the output was missing or
    when the parent dir was checked), or the unfinished copy stays behind unreported."""
    save = copy_fixture("core019_peft_full_tp1")
    out = tmp_path / "out"
    killed = run_ckptdoctor("strip-frozen", save, "--output", out, env=_fault_env("strip-frozen:data-written"))
    assert killed.returncode == FAULT_EXIT_CODE, killed.stderr
    staging = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.ckptdoctor-tmp-")]
    assert len(staging) == 1
    assert _leftovers(out) == staging  # the output is missing: reported (as before)

    rerun = run_ckptdoctor("strip-frozen", save, "--output", out)
    assert rerun.returncode == 0, rerun.stderr
    assert _leftovers(out) == staging  # the output exists now: still reported, with its rm command
    assert _leftovers(out / "iter_0000010") == []  # an iteration dir's own leftovers are its siblings only
    assert _leftovers(tmp_path) == staging  # once, however it is reached
