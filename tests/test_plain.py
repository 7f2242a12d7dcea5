"""plain: fingerprint / same_value (equality of unpickled objects that never raises) and to_plain's bounds."""

from __future__ import annotations

from pathlib import Path

from ckptdoctor.formats.torch_dist import record_attr
from ckptdoctor.pickle import plain, unpickler

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_fingerprints_of_equal_metadata_are_equal_at_every_call():
    """Records digest a dict of their attributes made for the digest; memoized by its id, a later such dict that got
    the same id once the first was freed took the first's digest, so equal objects compared unequal (or unequal
    ones equal) from one call to the next (6 calls in 20 on this fixture). Now every call gives one digest."""
    data = next((FIXTURES / "core019_moe_ep2").glob("iter_*/.metadata")).read_bytes()
    first = unpickler.loads(data)
    again = unpickler.loads(unpickler.dumps(unpickler.loads(data)))  # written back: equal, shared otherwise
    digests = {plain.fingerprint(first) for _ in range(10)} | {plain.fingerprint(again) for _ in range(10)}
    assert len(digests) == 1
    assert all(plain.same_value(first, again) for _ in range(10))
    key, tensor = next(iter(record_attr(again, "state_dict_metadata").items()))
    chunk = record_attr(tensor, "chunks")[0]
    chunk.__dict__["offsets"] = (*record_attr(chunk, "offsets")[:-1], 1)  # one value changed deep inside
    assert not any(plain.same_value(first, again) for _ in range(10)), key


def test_a_report_lists_every_row_and_bounds_a_bomb_in_one_field_only():
    """JSON of 30k report rows (a 30k-key inspect --keys) is whole; a shared-reference bomb read from a checkpoint
    is cut where it stands, and the fields after it are still there."""
    import dataclasses

    from ckptdoctor.pickle.plain import ELIDED, MAX_NODES, to_plain

    @dataclasses.dataclass
    class Row:
        key: str
        shape: tuple

    @dataclasses.dataclass
    class Report:
        rows: list
        args: dict
        after: list

    bomb: list = [1]
    for _ in range(40):  # 2**40 nodes expanded
        bomb = [bomb, bomb]
    plain = to_plain(Report([Row(f"k{i}", (4, 8)) for i in range(30_000)], {"x": bomb}, [1, 2, 3]))
    assert [r["key"] for r in plain["rows"]] == [f"k{i}" for i in range(30_000)]
    assert all(r["shape"] == [4, 8] for r in plain["rows"])
    assert plain["after"] == [1, 2, 3]
    assert ELIDED in repr(plain["args"]) and len(repr(plain["args"])) < 40 * MAX_NODES


def test_iter_json_writes_what_json_dumps_writes_of_to_plain():
    """The streamed JSON (what every command prints) is json.dumps(to_plain(x), indent=2) to the byte, under every
    budget."""
    import dataclasses
    import json
    import random

    from ckptdoctor.pickle.plain import iter_json, to_plain

    @dataclasses.dataclass
    class Row:
        a: object
        b: object

    def value(depth: int, rng: random.Random) -> object:
        c = rng.random()
        if depth <= 0 or c < 0.3:
            return rng.choice([1, -2, 3.5, 1e300, -0.0, "x", 'u\u00fc\n"\\', None, True, False, float("nan"), 10**30])
        if c < 0.5:
            return [value(depth - 1, rng) for _ in range(rng.randrange(4))]
        if c < 0.6:
            return tuple(value(depth - 1, rng) for _ in range(rng.randrange(3)))
        if c < 0.75:
            return {rng.choice(["k", 1, "1", 2.0, None, True]): value(depth - 1, rng) for _ in range(rng.randrange(4))}
        if c < 0.85:
            return Row(value(depth - 1, rng), value(depth - 1, rng))
        return {1, 2} if rng.random() < 0.5 else b"ab"

    for seed in range(1500):
        v = value(6, random.Random(seed))
        for budget, depth in ((10_000, 32), (5, 3), (2, 2)):
            assert "".join(iter_json(v, budget, depth)) == json.dumps(to_plain(v, budget, depth), indent=2), seed


_NO_GARBAGE = """
import dataclasses, gc
from ckptdoctor.pickle.plain import iter_json

@dataclasses.dataclass
class Row:
    a: object
    b: object

rows = [Row(f"k{i}", (4, [8, {"x": None}])) for i in range(2_000)]
gc.disable()
gc.collect()
assert sum(1 for _ in iter_json(rows)) > 2_000
print(gc.collect())
"""


def test_iter_json_leaves_no_garbage():
    """Streaming JSON makes no reference cycles: the CLI pauses the cyclic GC, so one per row of a 200k-key report
    (json.dumps with an indent makes them) was GBs. Counted in a child interpreter: in a test worker, a thread left
    by an earlier test (an S3 server's handler) can make cyclic garbage while the count runs."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_GARBAGE], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "0", out.stdout + out.stderr
