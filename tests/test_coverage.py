"""check's coverage rule (CKD220): whether a tensor's chunks tile its global shape exactly once, decided once per
layout (``coverage_problems``: the identities of the index's shared tuples) and per entry (``coverage_problem``)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptdoctor import coverage
from ckptdoctor.checkpoint import Entry, open_checkpoint
from ckptdoctor.cli import cli
from ckptdoctor.formats.dcp_index import DcpChunk

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _verdict(entry: Entry) -> object:
    try:
        return coverage.coverage_problem(entry)
    except Exception as exc:  # noqa: BLE001 - hostile values may make the rule raise: compared too
        return (type(exc).__name__, str(exc))


def test_coverage_decided_once_per_layout_is_each_entrys_own_verdict():
    """On random layouts (tilings, overlaps, gaps, chunks spanning cells, duplicates; hostile values: negative, past
    int64, zero sizes, wrong dims, not ints), entries that share a layout's tuples (as the index shares them) and
    entries with equal but separate tuples get each their own verdict: the one ``coverage_problem`` gives."""
    rng = random.Random(11)
    hostile = [-1, 0, 2**63, 2**64 + 3, 1.0, True, "1", None]

    def layouts():
        for _ in range(4000):
            shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
            cuts = [sorted({0, d, *rng.sample(range(1, d + 1), rng.randint(0, d - 1))}) for d in shape]
            grid = [[(a[i], a[i + 1] - a[i]) for i in range(len(a) - 1)] for a in cuts]
            chunks = [tuple(tuple(x) for x in zip(*cell)) for cell in itertools.product(*grid)]
            rng.shuffle(chunks)
            for _ in range(rng.choice((0, 0, 1, 2, 3))):
                i = rng.randrange(len(chunks))
                offsets, sizes = chunks[i]
                kind = rng.randrange(7)
                if kind == 0 and len(chunks) > 1:
                    chunks.pop(i)
                elif kind == 1:
                    chunks.append(chunks[i])
                elif kind == 2:
                    chunks[i] = (offsets, tuple(s + 1 if type(s) is int else s for s in sizes))
                elif kind == 3:
                    chunks[i] = (tuple(max(0, o - 1) if type(o) is int else o for o in offsets), sizes)
                elif kind == 4 and offsets and len(offsets) == len(sizes):  # a hostile value in one place
                    axis = rng.randrange(len(offsets))
                    field = list(rng.choice((offsets, sizes)))
                    field[axis] = rng.choice(hostile)
                    chunks[i] = (tuple(field), sizes) if rng.random() < 0.5 else (offsets, tuple(field))
                elif kind == 5 and offsets:  # a chunk of other dims
                    chunks[i] = (offsets + (0,), sizes + (1,)) if rng.random() < 0.5 else (offsets[:-1], sizes[:-1])
                elif all(type(s) is int for s in sizes):  # a chunk halved: a gap in its cell
                    chunks[i] = (offsets, tuple(max(1, s // 2) for s in sizes))
            yield shape, chunks

    entries = []
    for shape, chunks in layouts():
        shared = [DcpChunk(o, s, None) for o, s in chunks]
        entries.append(Entry("a", "tensor", "torch.float32", shape, shared))
        entries.append(
            Entry("b", "tensor", "torch.float32", shape, [DcpChunk(c.offsets, c.sizes, None) for c in shared])
        )
        copied = [DcpChunk(tuple(c.offsets), tuple(c.sizes), None) for c in shared]  # equal values, other tuples
        entries.append(Entry("c", "tensor", "torch.float32", tuple(shape), copied))
    expected = {id(entry): _verdict(entry) for entry in entries}
    failing = [entry for entry in entries if isinstance(expected[id(entry)], tuple)]
    clean = [entry for entry in entries if not isinstance(expected[id(entry)], tuple)]
    found = {id(entry): problem for entry, problem in coverage.coverage_problems(clean)}
    assert found == {id(e): expected[id(e)] for e in clean if expected[id(e)] is not None}
    assert len(found) > 1000 and len(clean) - len(found) > 800
    for entry in failing:  # a value the rule cannot take raises from the memoized walk alike
        with pytest.raises(Exception) as raised:
            list(coverage.coverage_problems([entry]))
        assert (type(raised.value).__name__, str(raised.value)) == expected[id(entry)]


def test_a_layout_seen_before_does_not_hide_a_different_one():
    """Two keys share the shape and the first chunk's tuples; the second's last chunk differs (a gap): only it is
    reported, though its layout's first identities are those of a layout already decided."""
    shape, full, half = (4, 4), (0, 0), (2, 4)
    top, bottom = DcpChunk(full, half, None), DcpChunk((2, 0), half, None)
    good = Entry("good", "tensor", "torch.float32", shape, [top, bottom])
    gap = Entry("gap", "tensor", "torch.float32", shape, [top, DcpChunk((2, 0), (1, 4), None)])
    assert [(entry.key, problem) for entry, problem in coverage.coverage_problems([good, gap, good])] == [
        ("gap", coverage.coverage_problem(gap))
    ]
    assert "gap" in coverage.coverage_problem(gap)


@pytest.mark.parametrize("fixture", ["core019_tp2", "core019_moe_ep2", "core019_pp2_vpp2"])
def test_every_fixture_tiles_once_in_either_form(fixture):
    checkpoint = open_checkpoint(FIXTURES / fixture)
    tensors = [e for e in checkpoint.entries.values() if e.kind == "tensor" and e.shape is not None]
    assert list(coverage.coverage_problems(tensors)) == []
    assert all(coverage.coverage_problem(e) is None for e in tensors)
    result = CliRunner().invoke(cli, ["check", str(FIXTURES / fixture), "--select", "CKD220"])
    assert result.exit_code == 0, result.output
