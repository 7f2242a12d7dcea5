"""scripts/fuzz_semantic.py: a few structure-aware mutants per target run clean, and the harness reports a command
that fails (its own check)."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import fuzz_semantic  # noqa: E402


@pytest.mark.parametrize("target", ["metadata", "rewrite", "values", "args", "data", "tree", "bridge"])
def test_a_few_mutants_of_each_target_end_cleanly(target):
    tally, failures = fuzz_semantic.fuzz(target, seed=7, count=3)
    assert not failures, failures
    assert sum(tally.values()) >= 3 * len(fuzz_semantic._commands(target, REPO, REPO, REPO))


def test_the_harness_reports_an_internal_error(monkeypatch):
    from ckptdoctor import parallelism

    def broken(checkpoint):
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(parallelism, "infer_layout", broken)
    monkeypatch.setattr("ckptdoctor.ops.inspect.infer_layout", broken)
    _, failures = fuzz_semantic.fuzz("metadata", seed=7, count=1)
    assert any(f[2].startswith("inspect") and "internal error: IndexError" in f[4] for f in failures), failures
