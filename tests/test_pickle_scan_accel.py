"""The pre-pass in C (``ckptdoctor/pickle/_scan.c``) gives the Python walk's verdict, message included.

``scanner.scan`` trusts the C walk's verdict, so every pickle here goes through both walks and the
outcomes (accepted, or the exception type and its message with the byte position) must be identical: the
fixtures' real pickles, the hostile corpus, pickles of every protocol, and seeded mutations of all of them,
each under the default limits, tight limits (so that every limit is reached somewhere) and without the
``safe_hash`` callback.
"""

from __future__ import annotations

import os
import pickle
import random
import zipfile
from collections import OrderedDict
from pathlib import Path

import hostile_corpus
import pytest

from ckptdoctor.errors import PickleLimitError
from ckptdoctor.pickle import scanner
from ckptdoctor.pickle.limits import DEFAULT_LIMITS, PickleLimits
from ckptdoctor.pickle.policy import hash_safe_global

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TIGHT = PickleLimits(max_tuple_depth=2, max_string=12, max_hashed_keys=3, max_int_bytes=2)
LIMITS = (DEFAULT_LIMITS, TIGHT)

needs_c = pytest.mark.skipif(scanner._scan_c is None, reason="the C pre-pass was not built")


def _outcome(walk, data: bytes, limits: PickleLimits, safe_hash) -> tuple[str, str]:
    try:
        walk(data, limits, safe_hash)
    except (PickleLimitError, pickle.UnpicklingError) as exc:
        return type(exc).__name__, str(exc)
    return "accepted", ""


def _c_walk(data: bytes, limits: PickleLimits, safe_hash) -> None:
    """``scan`` with the C walk only: a pickle the C walk leaves to Python counts as its own outcome."""
    verdict = scanner._scan_c(
        data, limits.max_tuple_depth, limits.max_string, limits.max_int_bytes, limits.max_hashed_keys, safe_hash
    )
    if verdict == -1:
        raise _LeftToPython
    if verdict is not None:
        kind, message = verdict
        raise PickleLimitError(message) if kind == 1 else pickle.UnpicklingError(message)


class _LeftToPython(Exception):
    pass


def _compare(data: bytes) -> int:
    """Both walks on ``data`` under every limit set, with and without ``safe_hash``; the number compared."""
    compared = 0
    for limits in LIMITS:
        for safe_hash in (hash_safe_global, None):
            try:
                got = _outcome(_c_walk, data, limits, safe_hash)
            except _LeftToPython:
                continue
            want = _outcome(scanner.scan_python, data, limits, safe_hash)
            assert got == want, (data[:200], limits, safe_hash)
            compared += 1
    return compared


def _fixture_pickles() -> list[bytes]:
    """Every real pickle of the fixtures: ``.metadata`` files and the ``data.pkl`` of every archive."""
    pickles = [p.read_bytes() for p in sorted(FIXTURES.rglob(".metadata"))]
    for path in sorted(FIXTURES.rglob("*")):
        if path.suffix in (".pt", ".distcp") and path.is_file():
            with open(path, "rb") as f:
                head = f.read(4)
            if head != b"PK\x03\x04":
                continue
            with zipfile.ZipFile(path) as archive:
                pickles += [archive.read(n) for n in archive.namelist() if n.endswith("data.pkl")]
    return pickles


def _python_pickles() -> list[bytes]:
    """Pickles of plain data at every protocol: text opcodes (0, 1), memo PUT/GET, frames, sets, bytes."""
    value = {
        "ints": [0, 1, -1, 255, 256, 65535, 65536, 2**31, -(2**31), 2**64, -(2**70)],
        "floats": [0.5, -1e300, float("inf")],
        "nested": ((1, (2, (3, 4))), [(), (5,)], {(1, 2): "a"}),
        "text": ["", "x" * 300, "é", "\x00"],
        "bytes": [b"", b"\xff" * 300, bytearray(b"ab")],
        "sets": [{1, 2}, frozenset({3})],
        "ordered": OrderedDict(a=1),
        "shared": [[1, 2]] * 3,
        None: True,
    }
    return [pickle.dumps(value, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)]


def _hostile_pickles() -> list[bytes]:
    small = [v for v in hostile_corpus.RESOURCE_CASES.values() if len(v) < 300_000]
    return small + [
        hostile_corpus.DEEP_LISTS[:50_000] + b".",
        b"\x80\x02}" + b")" + b"\x85" * 5000 + b"Ns.",
        b"\x80\x04\x95" + b"\xff" * 8 + b"N.",  # a FRAME past the end
        b"\x80\x02N" + b"\x96" + b"\xff" * 8 + b".",  # a length past the end (int64 overflow in C)
        b"\x80\x02Nq\x05.",  # a memo index out of sequence
        b"\x80\x02Nr\x00\x00\x20\x00.",  # ... and far out of it
        b"(((((t\x85\x85\x85.",
        b"cos\nsystem\n(S'x'\ntR.",
        b"\x80\x02c\xff\n\xfe\n)R.",  # a global whose name is not UTF-8
    ]


_SEEDS = None


def _seeds() -> list[bytes]:
    global _SEEDS
    if _SEEDS is None:
        _SEEDS = _fixture_pickles() + _python_pickles() + _hostile_pickles()
    return _SEEDS


_OPCODE_BYTES = bytes(range(256))


def _mutants(data: bytes, rng: random.Random, n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        buf = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            if not buf:
                break
            at = rng.randrange(len(buf))
            action = rng.randrange(6)
            if action == 0:
                buf[at] ^= 1 << rng.randrange(8)
            elif action == 1:
                buf[at] = rng.choice(_OPCODE_BYTES)
            elif action == 2:
                del buf[at:]
            elif action == 3:
                buf[at:at] = bytes(rng.choice(_OPCODE_BYTES) for _ in range(rng.randrange(1, 6)))
            elif action == 4:
                end = min(len(buf), at + rng.randrange(1, 64))
                buf[at:at] = buf[at:end] * rng.randrange(1, 4)
            else:
                del buf[at : at + rng.randrange(1, 16)]
        out.append(bytes(buf))
    return out


@needs_c
def test_the_c_walk_gives_the_python_verdict_on_real_and_hostile_pickles():
    compared = sum(_compare(data) for data in _seeds())
    assert compared >= 3 * len(_seeds())  # only a protocol 0 memo opcode is left to the Python walk


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_the_c_walk_gives_the_python_verdict_on_mutants(seed):
    rng = random.Random(seed)
    seeds = [s for s in _seeds() if len(s) < 200_000]
    compared = 0
    outcomes: set[str] = set()
    for data in seeds:
        for mutant in _mutants(data, rng, 12):
            compared += _compare(mutant)
            outcomes.add(_outcome(scanner.scan_python, mutant, DEFAULT_LIMITS, hash_safe_global)[1][:12])
    assert compared > 1000
    assert len(outcomes) > 5  # the mutants reach accepted, limit and several kinds of damage


@needs_c
def test_scan_uses_the_c_walk_and_hands_protocol_0_memo_opcodes_to_python(monkeypatch):
    calls = []
    monkeypatch.setattr(scanner, "scan_python", lambda *a: calls.append(a))
    scanner.scan(pickle.dumps([1, 2], protocol=4))
    assert calls == []  # the C walk answered
    scanner.scan(pickle.dumps([[1], [1]], protocol=0))  # protocol 0 memo: PUT 'p' ... GET 'g'
    assert len(calls) == 1


def test_scan_refuses_alike_without_the_c_walk(monkeypatch):
    monkeypatch.setattr(scanner, "_scan_c", None)
    with pytest.raises(PickleLimitError, match="tuples nest deeper than 2"):
        scanner.scan(b"\x80\x02)\x85\x85\x85.", TIGHT)
    with pytest.raises(pickle.UnpicklingError, match="no STOP"):
        scanner.scan(b"\x80\x02N")
    scanner.scan(pickle.dumps({"a": (1, 2)}, protocol=2))


def test_the_c_walk_is_built_where_ci_requires_it():
    """CI (scripts/test.sh) builds the extension and sets CKPTDOCTOR_REQUIRE_C_SCAN=1: a failed build there
    must fail the run, not skip the tests above."""
    if os.environ.get("CKPTDOCTOR_REQUIRE_C_SCAN") != "1":
        pytest.skip("CKPTDOCTOR_REQUIRE_C_SCAN is not set")
    assert scanner._scan_c is not None


def test_the_native_opcode_header_is_generated_from_pickletools():
    """ckptdoctor/pickle/_opcodes.h (the opcodes and their argument widths for the native module) is what
    scripts/gen_opcodes.py makes of ``pickletools.opcodes``, the table ``ckptdoctor/pickle/opcodes.py`` reads."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("gen_opcodes", root / "scripts" / "gen_opcodes.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (root / "ckptdoctor" / "pickle" / "_opcodes.h").read_text() == gen.render()
