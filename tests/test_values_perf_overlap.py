"""``diff --values`` runs the structural comparison while its workers read (issue #16 §2): the caller's work
(``compare_values(meanwhile=...)``) runs exactly once whatever the worker count, the report does not change, and
its errors come first, as when it ran before the values were read."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import FIXTURES

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.logical_items import KIND_TENSOR, is_common_state_item, logical_items
from ckptdoctor.values.diff import compare_values

pytest.importorskip("torch")


def _pairs(a, b):
    items_a, items_b = logical_items(a), logical_items(b)
    keys = sorted(items_a.keys() & items_b.keys())
    return [(items_a[k], items_b[k]) for k in keys if not (is_common_state_item(k) and items_a[k].kind != KIND_TENSOR)]


def _plain(report) -> dict:
    out = dataclasses.asdict(report)
    for name in ("seconds", "workers", "peak_in_flight"):
        out.pop(name)
    return out


@pytest.mark.parametrize("workers", [1, 3])
def test_meanwhile_runs_once_and_changes_nothing(workers):
    a, b = open_checkpoint(FIXTURES / "core019_tp1"), open_checkpoint(FIXTURES / "core019_tp2")
    pairs = _pairs(a, b)
    calls = []
    with_work = compare_values(a, b, pairs, workers=workers, report=2, meanwhile=lambda: calls.append(1))
    assert calls == [1]
    alone = compare_values(a, b, pairs, workers=workers, report=2)
    assert _plain(with_work) == _plain(alone)
    assert alone.different > 0 and alone.equal > 0  # optimizer values differ between these two


def _structure_fails() -> None:
    raise CkptError("the structural comparison failed")


@pytest.mark.parametrize("workers", [1, 3])
def test_meanwhile_error_comes_first(copy_fixture, workers):
    a = open_checkpoint(FIXTURES / "core019_tp1")
    broken = copy_fixture("core019_tp2")
    b = open_checkpoint(broken)
    for data_file in sorted(b.iteration_dir.glob("*.distcp")):
        data_file.write_bytes(b"")  # every value read of B fails (truncated)
    pairs = _pairs(a, b)
    with pytest.raises(CkptError, match="truncated"):
        compare_values(a, b, pairs, workers=workers)
    with pytest.raises(CkptError, match="structural comparison failed"):
        compare_values(a, b, pairs, workers=workers, meanwhile=_structure_fails)
    whole = open_checkpoint(FIXTURES / "core019_tp2")
    with pytest.raises(CkptError, match="structural comparison failed"):  # the values alone would pass
        compare_values(a, whole, _pairs(a, whole), workers=workers, meanwhile=_structure_fails)


def test_a_meanwhile_error_does_not_end_the_workers_mid_run(monkeypatch):
    """The structural comparison's error is held until the workers' run returns, never raised out of ``done`` in
    the middle of it: that ended the pool (Pool.terminate) while a worker could be sending a result, and a worker
    ended holding the result queue's lock made terminate() wait forever (a CI run hung in diff --values)."""
    from ckptdoctor import parallel

    a, b = open_checkpoint(FIXTURES / "core019_tp1"), open_checkpoint(FIXTURES / "core019_tp2")
    pairs = _pairs(a, b)
    real = parallel.map_units
    seen = []

    def map_units(weights, task, jobs=None, done=None, threads=False):
        assert done is not None  # several workers: the structural comparison runs as results come back
        for index in range(len(weights)):
            done(index)  # must not raise mid-run
        seen.append("run finished")
        return real(weights, task, jobs, None, threads)

    monkeypatch.setattr(parallel, "map_units", map_units)
    with pytest.raises(CkptError, match="structural comparison failed"):
        compare_values(a, b, pairs, workers=3, meanwhile=_structure_fails)
    assert seen == ["run finished"]
