"""Memo pruning (``pruned_reader`` in ``ckptdoctor/pickle/_prune.c``): the unpickler reads a pickle without the
MEMOIZE opcodes whose entries are never read. The pruned pickle must build the same object graph (same
types, values and sharing) or fail with the same exception, on the fixtures' pickles, the hostile corpus,
hand-made edge cases and seeded mutants of all of them; where pruning would not be certain to be exact it
leaves the bytes alone (None). Without the C extension nothing is pruned and reads are unchanged.
"""

from __future__ import annotations

import io
import mmap
import pickle
import pickletools
import random
import re
import struct
from typing import Any

import pytest
from test_pickle_scan_accel import _mutants, _seeds

from ckptdoctor.errors import PickleLimitError
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.index_records import CompactKeys, IndexRecord, IndexTupleStateRecord
from ckptdoctor.pickle.policy import hash_safe_global
from ckptdoctor.pickle.scanner import scan
from ckptdoctor.pickle.torch_stand_ins import StorageRef

pruned_reader: Any
try:
    from ckptdoctor.pickle._native import pruned_reader
except ImportError:
    pruned_reader = None

needs_c = pytest.mark.skipif(pruned_reader is None, reason="the C extension was not built")


def prune_memo(data: bytes, drop_plans: bool = False) -> bytes | None:
    """The pruned pickle whole, as the unpickler reads it (``pruned_reader``), or None where it is left alone."""
    reader = pruned_reader(data, False, drop_plans)
    return None if reader is None else reader.read()


_ATOMS = (int, float, complex, bytes, str, bool, type(None))
_ADDRESS = re.compile(r"at 0x[0-9a-f]+")


def _as_chunk(x: Any) -> tuple | None:
    """(offsets, sizes) of a chunk as the index reads it: a compact chunk record; else None."""
    if (
        isinstance(x, IndexRecord)
        and len(x) == 3
        and type(x[0]) is CompactKeys
        and sorted(x[0]) == ["offsets", "sizes"]
    ):
        fields = dict(zip(x[0], x[1:]))
        if type(fields["offsets"]) is tuple and type(fields["sizes"]) is tuple:
            return fields["offsets"], fields["sizes"]
    return None


def _dump(obj: Any, index_view: bool = False) -> list:
    """A structural dump of an object graph: types, values and which objects are shared (an object seen
    before is written as a reference to its first appearance). Iterative: hostile pickles nest deeply.

    ``index_view``: an index-only read replaces objects that only one record holds by equal ones (prebuild in
    ``pickle/_records.c``: chunk records by ChunkDims, properties records by the first equal one), which only the
    pruned read can do (the unpruned memo holds every record): chunks and one-state properties records are
    written by value, as the index reads them."""
    seen: dict[int, int] = {}
    keep: list[Any] = []  # keeps every visited object alive, so that ids are not reused during the dump
    out: list = []
    todo: list[Any] = [obj]
    while todo:
        x = todo.pop()
        if type(x) in _ATOMS:
            out.append((type(x).__name__, repr(x)))
            continue
        if index_view:
            chunk = _as_chunk(x)
            if chunk is not None:
                out.append(("chunk",))
                todo.extend(reversed(chunk))
                continue
            if isinstance(x, IndexTupleStateRecord) and len(x) == 1 and type(x[0]) is tuple:
                out.append(("properties", type(x).__qualname__))
                todo.append(x[0])
                continue
        if id(x) in seen:
            out.append(("ref", seen[id(x)]))
            continue
        seen[id(x)] = len(seen)
        keep.append(x)
        cls = type(x)
        out.append(("obj", cls.__module__, cls.__qualname__))
        children: list[Any] = []
        if isinstance(x, (str, bytes, bytearray, int, float)):  # a subclass (LayoutName, MemoryFormatCode, ...)
            out.append(repr(x))
        if isinstance(x, dict):
            out.append(("dict", len(x)))
            for k, v in x.items():
                children += (k, v)
        elif isinstance(x, (list, tuple)):
            out.append(("seq", len(x)))
            children += list(x)
        elif isinstance(x, (set, frozenset)):
            out.append(("set", sorted(_ADDRESS.sub("at 0x?", repr(v)) for v in x)))
        state = getattr(x, "__dict__", None)
        if isinstance(state, dict) and not isinstance(x, type):
            out.append(("attrs", len(state)))
            for k, v in state.items():
                children += (k, v)
        todo.extend(reversed(children))
    return out


def _persistent_load(pid: Any) -> StorageRef:
    return StorageRef(repr(pid)[:50], None, "cpu", 0)


def _outcome(data: bytes | Any, index_only: bool) -> tuple:
    """What unpickling ``data`` (bytes, or a file to read them from) gives: a dump of the object, or the
    exception."""
    file = io.BytesIO(data) if isinstance(data, bytes) else data
    reader = unpickler.SafeUnpickler(file, _persistent_load, index_only)
    try:
        obj = reader.load()
    except RecursionError:
        return ("RecursionError",)
    except Exception as exc:  # noqa: BLE001 - the differential compares whatever the unpickler raises
        return (type(exc).__name__, _ADDRESS.sub("at 0x?", str(exc)))  # a repr in the message names an address
    return ("ok", _dump(obj, index_only), reader.unlisted)


def _passes_scan(data: bytes) -> bool:
    try:
        scan(data, None, hash_safe_global)
    except (PickleLimitError, pickle.UnpicklingError):
        return False
    return True


def _read_out(reader: Any, rng: random.Random) -> bytes:
    """All that ``reader`` gives, read in pieces of random sizes and lines."""
    pieces = []
    while True:
        piece = reader.readline() if rng.random() < 0.2 else reader.read(rng.choice((1, 2, 5, 9, 300, 1 << 16)))
        if not piece:
            return b"".join(pieces)
        pieces.append(piece)


def _differential(data: bytes) -> bool:
    """Pruned and unpruned read alike (index-only and faithful), the pruned pickle read from the reader that
    ``unpickler.loads`` uses; True where pruning changed the bytes. Only pickles the pre-pass accepts reach
    the unpickler (as in ``unpickler.loads``). With ``drop_plans`` (the states of save plan parts left out,
    ``ckptdoctor/_pickle_plans.c``), only index-only reads are compared: a faithful read would keep them."""
    if not _passes_scan(data):
        return False
    changed = False
    # drop_plans: plan states left out (index-only reads)
    for drop in (False, True):
        pruned = prune_memo(data, drop)
        if pruned is None:
            assert pruned_reader(data, False, drop) is None
            continue
        changed = True
        assert len(pruned) <= len(data)
        assert _read_out(pruned_reader(data, False, drop), random.Random(len(data))) == pruned
        for index_only in (True,) if drop else (False, True):
            outcome = _outcome(pruned_reader(data, False, drop), index_only)
            assert outcome == _outcome(data, index_only), (data[:120], index_only, drop)
    return changed


def _memo_ops(data: bytes) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op, _, _ in pickletools.genops(data):
        if op.name in ("MEMOIZE", "BINGET", "LONG_BINGET", "FRAME"):
            counts[op.name] = counts.get(op.name, 0) + 1
    return counts


@needs_c
def test_pruned_pickles_read_alike_on_fixtures_python_and_hostile_pickles():
    seeds = _seeds()
    pruned = sum(_differential(data) for data in seeds)
    assert pruned >= 10  # every .metadata fixture, the archives' data.pkl and most Python pickles


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_pruned_pickles_read_alike_on_mutants(seed):
    rng = random.Random(seed)
    seeds = [s for s in _seeds() if len(s) < 200_000 and prune_memo(s) is not None]
    pruned = 0
    for data in seeds:
        for mutant in _mutants(data, rng, 50):
            pruned += _differential(mutant)
    assert pruned > 80


_INSERTS = (b"\x94", b"\x94", b"(", b"0", b"1", b"2", b"N", b")", b"\x85", b"t", b"s", b"a", b"b", b"R", b"\x86", b"}")


def _opcodes(data: bytes) -> list[bytes]:
    """The opcodes of a pickle up to its STOP (each with its argument), FRAMEs left out."""
    ops = list(pickletools.genops(data))
    ends = [pos for _, _, pos in ops[1:]] + [len(data)]
    return [data[pos:end] for (op, _, pos), end in zip(ops, ends) if op.name != "FRAME"]


def _opcode_mutant(ops: list[bytes], rng: random.Random) -> bytes:
    """Opcodes dropped, repeated, swapped or inserted (memo writes and reads of random entries, marks,
    pops, tuples, item assignments), then framed at random opcode boundaries (or not at all)."""
    ops = list(ops)
    for _ in range(rng.choice((1, 1, 2, 3))):
        at = rng.randrange(1, len(ops))
        action = rng.randrange(5)
        if action == 0:
            del ops[at]
        elif action == 1:
            ops.insert(at, ops[at])
        elif action == 2:
            other = rng.randrange(1, len(ops))
            ops[at], ops[other] = ops[other], ops[at]
        elif action == 3:
            ops.insert(at, rng.choice(_INSERTS))
        else:
            index = rng.randrange(300)
            short, long = rng.choice((b"hj", b"qr"))  # a memo read or write (BINPUT) of a random entry
            ops.insert(at, bytes([short, index]) if index < 256 else bytes([long]) + struct.pack("<I", index))
    if rng.random() < 0.25:
        return b"".join(ops)
    out, chunk = [ops[0]], []
    for op in ops[1:]:
        chunk.append(op)
        if rng.random() < 0.1 or op == b".":
            body = b"".join(chunk)
            out.append(b"\x95" + struct.pack("<Q", len(body)) + body)
            chunk = []
    return b"".join(out) + b"".join(chunk)


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_pruned_pickles_read_alike_on_opcode_mutants(seed):
    rng = random.Random(seed)
    seeds = [s for s in _seeds() if len(s) < 40_000 and prune_memo(s) is not None]
    seeds.append(pickle.dumps(_shared_value(), protocol=4))
    pruned = 0
    outcomes = set()
    for data in seeds:
        ops = _opcodes(data)
        for _ in range(25):
            mutant = _opcode_mutant(ops, rng)
            if _differential(mutant):
                pruned += 1
                outcomes.add(_outcome(mutant, False)[0])
    assert pruned > 200
    assert {"ok", "UnpicklingError", "TypeError"} <= outcomes  # reads that succeed and several failures


@needs_c
def test_a_dcp_metadata_keeps_only_the_entries_it_reads():
    data = _seeds()[0]  # a fixture's .metadata (DCP pickles with protocol 4: MEMOIZE after every object)
    before, after = _memo_ops(data), _memo_ops(prune_memo(data))
    assert before["MEMOIZE"] > 5 * after["MEMOIZE"]
    assert after["MEMOIZE"] <= before["BINGET"] + before.get("LONG_BINGET", 0)
    assert after["FRAME"] == before["FRAME"]  # frames keep their place, with their new lengths
    pickletools.dis(prune_memo(data), out=io.StringIO())  # well formed: frames end where their opcodes do


def _shared_value() -> Any:
    inner = ("x", 1)
    return {"a": [inner, inner, "s" * 300], "b": (inner,) * 300, "c": [[i] for i in range(400)]}


@needs_c
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_sharing_survives_and_reads_past_256_entries_are_renumbered(protocol):
    value = _shared_value()
    data = pickle.dumps(value, protocol=protocol)
    pruned = prune_memo(data)
    assert pruned is not None and len(pruned) < len(data)
    back = pickle.loads(pruned)
    assert back == value
    assert back["a"][0] is back["a"][1] is back["b"][299]


def _framed(body: bytes) -> bytes:
    return b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body


@needs_c
@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x04N\x94\x94.",  # nothing is read: both MEMOIZEs go
        _framed(b"N\x94)\x94h\x01\x86."),
        _framed(b"]\x94N\x94a."),
        b"\x80\x04]\x94(N\x94N\x94e.",
        pickle.dumps([[1], [2]], protocol=2),  # protocol 2: BINPUT of each next index, as Python writes it
        b"\x80\x02Nq\x00)\x94r\x02\x00\x00\x00h\x01h\x02\x87.",  # BINPUT, MEMOIZE and LONG_BINPUT in sequence
    ],
)
def test_unread_entries_are_dropped_and_the_result_is_the_same(data):
    pruned = prune_memo(data)
    assert pruned is not None and len(pruned) < len(data)
    assert pickle.loads(pruned) == pickle.loads(data)


@needs_c
@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x04\x94N.",  # a MEMOIZE on an empty stack fails: kept (nothing else to drop: None)
        b"\x80\x04N(\x94t.",  # ... at a MARK: kept
        b"\x80\x04N0\x94N.",  # after a POP
        b"\x80\x02(q\x00Nq\x01t.",  # a BINPUT at a MARK
        b"\x80\x02r\x00\x00\x00\x00N.",  # a LONG_BINPUT on an empty stack
    ],
)
def test_a_memoize_that_fails_is_kept(data):
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(data)
    pruned = prune_memo(data)
    if pruned is not None:
        with pytest.raises(pickle.UnpicklingError):
            pickle.loads(pruned)


@needs_c
@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x04N\x94h\x01.",  # a read of an entry not yet made
        b"\x80\x04N\x94Nq\x05h\x00.",  # an explicit index (BINPUT) besides MEMOIZE
        b"\x80\x04N\x94Nr\x00\x00\x00\x00\x94.",  # LONG_BINPUT
        b"\x80\x04N\x94Np0\n.",  # protocol 0 PUT
        b"\x80\x04N\x94g0\n.",  # protocol 0 GET
        b"\x80\x04N\x94N",  # no STOP
        _framed(b"N\x94N")[:-1] + b"\x8c\x02ab\x94.",  # a string that straddles the end of its frame
        b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00N\x94.ABC",  # a STOP inside a frame that goes on
        b"\x80\x04\x95\x40\x00\x00\x00\x00\x00\x00\x00N\x94.",  # a frame past the end
        _framed(b"N\x94\x95\x02\x00\x00\x00\x00\x00\x00\x00N.") + b"",  # a frame inside a frame
        b"\x80\x04N\x94\x82\x01.",  # an opcode pruning does not know (EXT1)
        b"\x80\x04N\x94T\xff\xff\xff\xff.",  # a negative BINSTRING length
        b"\x80\x02Nq\x01.",  # a BINPUT of an index other than the next one
        b"\x80\x02Nq\x00Nq\x00.",  # ... of one already made
        b"\x80\x02Nr\x00\x00\x00\x01.",  # LONG_BINPUT, far out of sequence
    ],
)
def test_pickles_pruning_is_not_certain_about_are_left_alone(data):
    assert prune_memo(data) is None


@needs_c
def test_loads_reads_the_pruned_pickle(monkeypatch):
    data = pickle.dumps(_shared_value(), protocol=4)
    readers = []
    monkeypatch.setattr(
        unpickler,
        "_pruned_reader",
        lambda b, release, drop: readers.append(pruned_reader(b, release, drop)) or readers[-1],
    )
    assert unpickler.loads(data) == _shared_value()
    assert len(readers) == 1 and readers[0] is not None and readers[0].read() == b""  # read to the STOP
    readers.clear()
    assert unpickler.loads_prefix(data + b"trailing")[1] == len(data)  # where the pickle ends: not pruned
    assert readers == []


def test_without_the_c_extension_nothing_is_pruned(monkeypatch):
    monkeypatch.setattr(unpickler, "_pruned_reader", None)
    data = pickle.dumps(_shared_value(), protocol=4)
    seen = []
    real_bytes_io = io.BytesIO
    monkeypatch.setattr(unpickler.io, "BytesIO", lambda b: seen.append(bytes(b)) or real_bytes_io(b))
    assert unpickler.loads(data) == _shared_value()
    assert seen == [data]


def _mapped(data: bytes) -> mmap.mmap:
    mapped = mmap.mmap(-1, len(data), flags=mmap.MAP_PRIVATE)  # as files.read_releasable maps
    mapped[:] = data
    return mapped


@needs_c
def test_release_gives_back_the_pages_already_translated():
    """``pruned_reader(data, release=True)`` (data: an anonymous map of the caller's own, as
    ``files.read_releasable`` makes for a large ``.metadata``) gives back the pages below its translation point
    every 4 MiB: the same objects come out, and the start of the map reads as zeros afterwards (an anonymous page
    given back is a fresh zero page), which it does not without ``release``."""
    value = [(f"key.{i}", i, (i, i + 1)) for i in range(500_000)]  # ~15 MB at protocol 4, every entry unread
    data = pickle.dumps(value, protocol=4)
    assert len(data) > 9 << 20
    for release in (True, False):
        mapped = _mapped(data)
        reader = pruned_reader(mapped, release)
        assert reader is not None
        assert unpickler.SafeUnpickler(reader).load() == value
        head = mapped[: 1 << 20]
        assert (head == bytes(len(head))) is release, release
        assert mapped[-(1 << 20) :] == data[-(1 << 20) :]  # the part read last (less than a step) is kept
        del reader
        mapped.close()


def test_a_large_file_is_read_into_a_map_of_its_own(tmp_path, monkeypatch):
    from ckptdoctor.storage import files

    path = tmp_path / "big"
    payload = bytes(range(256)) * 4096  # 1 MiB
    path.write_bytes(payload)
    monkeypatch.setattr(files, "RELEASABLE_MIN_BYTES", 1 << 20)
    with files.open_regular(path) as f:
        mapped = files.read_releasable(f, 64 << 20)
    assert isinstance(mapped, mmap.mmap) and mapped[:] == payload
    with files.open_regular(path) as f:  # over the limit: refused on its size, nothing read
        with pytest.raises(files.TooLarge):
            files.read_releasable(f, 1000)
        assert f.tell() == 0
    path.write_bytes(payload[:1000])  # small: bytes
    with files.open_regular(path) as f:
        assert files.read_releasable(f, 64 << 20) == payload[:1000]
    (tmp_path / "empty").write_bytes(b"")
    monkeypatch.setattr(files, "RELEASABLE_MIN_BYTES", 0)
    with files.open_regular(tmp_path / "empty") as f:
        assert files.read_releasable(f, 64 << 20) == b""
