"""plain: fingerprint / same_value (equality of unpickled objects that never raises) and to_plain's bounds."""

from __future__ import annotations

from pathlib import Path

from ckptdoctor import plain, safe_pickle
from ckptdoctor.formats.torch_dist import record_attr

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_fingerprints_of_equal_metadata_are_equal_at_every_call():
    """Records digest a dict of their attributes made for the digest; memoized by its id, a later such dict that got
    the same id once the first was freed took the first's digest, so equal objects compared unequal (or unequal
    ones equal) from one call to the next (6 calls in 20 on this fixture). Now every call gives one digest."""
    data = next((FIXTURES / "core019_moe_ep2").glob("iter_*/.metadata")).read_bytes()
    first = safe_pickle.loads(data)
    again = safe_pickle.loads(safe_pickle.dumps(safe_pickle.loads(data)))  # written back: equal, shared otherwise
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

    from ckptdoctor.plain import ELIDED, MAX_NODES, to_plain

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
