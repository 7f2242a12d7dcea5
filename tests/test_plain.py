"""plain.fingerprint / same_value: equality of unpickled objects (records, stand-ins) that never raises."""

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
