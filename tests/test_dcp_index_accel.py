"""The index loops in C (``ckptdoctor/formats/_dcp_index.c``) give the Python loops' result, or the same error.

``dcp_index.index_items`` runs the C loops where the extension was built, and a crafted ``.metadata`` reaches
them with whatever records the safe unpickler built: so every outcome here comes from both implementations
on separately unpickled copies of the same records and must be identical (the index, or the exception type
and message, and what the consuming read left in the dicts). Inputs: every fixture's ``.metadata``, read
index-only (consuming, as every read-only command does) and faithfully (as ``edit`` reads it), and seeded
mutants of those records: fields set to hostile values or removed, records of the wrong kind, states that
are not one dict, chunks listed twice, storage entries duplicated.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.formats import dcp_index
from ckptdoctor.formats.dcp_index import DcpItem
from ckptdoctor.formats.torch_dist import record_attr
from ckptdoctor.pickle import index_records, unpickler
from ckptdoctor.pickle.index_records import CompactKeys, IndexRecord, index_record_fields
from ckptdoctor.pickle.stand_ins import Record

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
METADATA = sorted(FIXTURES.glob("*/iter_*/.metadata"))

needs_c = pytest.mark.skipif(not dcp_index._use_c, reason="the C index loops were not built")


def _records(data: bytes, index_only: bool) -> tuple[dict, dict]:
    metadata = unpickler.loads(data, index_only=index_only)
    return record_attr(metadata, "state_dict_metadata"), record_attr(metadata, "storage_data")


def _outcome(monkeypatch, c: bool, state_dict_metadata: Any, storage_data: Any, consume: bool) -> tuple:
    monkeypatch.setattr(dcp_index, "_use_c", c)
    try:
        result: Any = dcp_index.index_items(state_dict_metadata, storage_data, DcpItem, consume)
    except Exception as exc:  # noqa: BLE001 - the point is which one
        result = (type(exc).__name__, str(exc))
    left = (len(state_dict_metadata), len(storage_data)) if consume else None
    return result, left


# --- mutations of unpickled records ----------------------------------------------------------------------


def _aliens() -> list[Any]:
    """Fresh hostile values (new objects per call: both copies get equal, not shared, values)."""
    return [
        None, -1, 0, 7, 2**63 - 1, 2**63, 2**64, True, 1.5, "x", "../up", "/abs", "a\\b", "nul\0", "", b"raw",
        [], [1, 2], (), (1, 2), (-1,), (2**63,), (2**62, 4), ((1,),), ("a",), (1.5,), ([1],), {"a": 1}, {"x"},
        (0, 0, 0), range(3), "12",
    ]  # fmt: skip


def _state(record: Any) -> dict | None:
    """The dict a mutation edits: an index record's first state or a faithful record's ``__dict__``."""
    if isinstance(record, IndexRecord):
        return record[0] if record and isinstance(record[0], dict) else None
    return getattr(record, "__dict__", None)


def _compact(record: Any) -> bool:
    return isinstance(record, IndexRecord) and bool(record) and type(record[0]) is CompactKeys


def _read(record: Any) -> dict:
    """A record's fields, whatever its form (a compact record's as a new dict of the same values)."""
    if _compact(record):
        return dict(zip(record[0], record[1:]))
    return _state(record) or {}


def _targets(state_dict_metadata: dict, storage_data: dict) -> list[tuple[str, Any]]:
    """Every record a mutation may touch, in a deterministic order: (kind, record)."""
    found: list[tuple[str, Any]] = []
    for index, info in storage_data.items():
        found += [("index", index), ("info", info)]
    for item in state_dict_metadata.values():
        found.append(("item", item))
        properties = _read(item).get("properties")
        if properties is not None:
            found.append(("properties", properties))
        chunks = _read(item).get("chunks")
        if isinstance(chunks, list):
            found += [("chunk", chunk) for chunk in chunks]
    return found


def _mutate(rng: random.Random, state_dict_metadata: dict, storage_data: dict) -> None:
    targets = _targets(state_dict_metadata, storage_data)
    kind, record = targets[rng.randrange(len(targets))]
    state = _state(record)
    op = rng.randrange(9)
    if kind == "properties" and isinstance(record, IndexRecord):  # TensorProperties' tuple state, or not
        aliens = _aliens()
        record[:] = rng.choice(
            [[()], [(aliens[rng.randrange(len(aliens))], "layout")], [{"dtype": aliens[rng.randrange(len(aliens))]}],
             [(record[0] if record else ()), {"dtype": None}], [], [None]]
        )  # fmt: skip
    elif op <= 4 and _compact(record) and len(record) > 1:  # the same on a compact record, in its own form
        i = rng.randrange(len(record) - 1)
        if op <= 3:
            aliens = _aliens()
            record[1 + i] = aliens[rng.randrange(len(aliens))]
        else:
            keys, values = list(record[0]), record[1:]
            del keys[i], values[i]
            record[:] = [CompactKeys(keys), *values]
    elif op <= 3 and state:  # a field set to a hostile value
        name = sorted(state)[rng.randrange(len(state))]
        aliens = _aliens()
        state[name] = aliens[rng.randrange(len(aliens))]
    elif op == 4 and state:  # a field removed
        del state[sorted(state)[rng.randrange(len(state))]]
    elif op == 5 and isinstance(record, IndexRecord):  # a state that is not one dict
        choice = rng.randrange(5)
        if choice == 0:
            record.clear()
        elif choice == 1:
            record.append({"fqn": "extra", "offsets": (0,)})
        elif choice == 2:
            record[:] = [({"fqn": "t"}, {"offset": None})]
        elif choice == 3:
            record[:] = [(1, 2)]
        else:
            record[:] = [None]
    elif op == 6 and kind == "chunk":  # a chunk listed twice
        chunks = _read(_owner(state_dict_metadata, record))["chunks"]
        chunks.append(record)
    elif op == 7 and kind in ("index", "info"):  # a storage entry repeated under another key record
        for index, info in list(storage_data.items()):
            if record is index or record is info:
                if isinstance(index, IndexRecord):
                    twin = type(index)()
                    twin.append(_read(index))
                elif isinstance(index, Record):  # a faithful record: a second one of its class, same state
                    twin = object.__new__(type(index))
                    twin.__dict__.update(_state(index) or {})
                else:  # already replaced by something else
                    break
                storage_data[twin] = info
                break
    else:  # a record replaced by something else
        replacement = [None, 3, "rec", (1,), {"fqn": "k"}, [{"offsets": (0,), "sizes": (1,)}]][rng.randrange(6)]
        _replace(state_dict_metadata, storage_data, record, replacement)


def _owner(state_dict_metadata: dict, chunk: Any) -> Any:
    for item in state_dict_metadata.values():
        chunks = _read(item).get("chunks")
        if isinstance(chunks, list) and any(c is chunk for c in chunks):
            return item
    raise AssertionError("chunk without an owner")


def _replace(state_dict_metadata: dict, storage_data: dict, record: Any, replacement: Any) -> None:
    for index, info in list(storage_data.items()):
        if info is record:
            storage_data[index] = replacement
            return
        if index is record:
            try:
                hash(replacement)
            except TypeError:
                return
            del storage_data[index]
            storage_data[replacement] = info
            return
    for key, item in state_dict_metadata.items():
        if item is record:
            state_dict_metadata[key] = replacement
            return
        chunks = _read(item).get("chunks")
        if isinstance(chunks, list):
            for i, chunk in enumerate(chunks):
                if chunk is record:
                    chunks[i] = replacement
                    return


# --- the comparisons -------------------------------------------------------------------------------------


@needs_c
@pytest.mark.parametrize("path", METADATA, ids=lambda p: p.parent.parent.name)
def test_fixture_indexes_are_identical(monkeypatch, path):
    data = path.read_bytes()
    for index_only, consume in ((True, True), (True, False), (False, False)):
        c = _outcome(monkeypatch, True, *_records(data, index_only), consume)
        python = _outcome(monkeypatch, False, *_records(data, index_only), consume)
        assert isinstance(c[0], dict) and c[0], c  # a real index, not an error
        assert c == python


@needs_c
@pytest.mark.parametrize("path", METADATA[::4], ids=lambda p: p.parent.parent.name)
@pytest.mark.parametrize("plans", ["plans", "no-plans"])
def test_mutants_give_identical_outcomes(monkeypatch, path, plans):
    data = path.read_bytes() if plans == "plans" else _without_plans(path)  # no-plans: chunks made while unpickling
    errors = 0
    for seed in range(150):
        for index_only, consume in ((True, True), (False, False)):
            outcomes = []
            for c in (True, False):
                state_dict_metadata, storage_data = _records(data, index_only)
                rng = random.Random(seed)
                for _ in range(1 + seed % 3):
                    _mutate(rng, state_dict_metadata, storage_data)
                outcomes.append(_outcome(monkeypatch, c, state_dict_metadata, storage_data, consume))
            assert outcomes[0] == outcomes[1], (seed, index_only)
            errors += not isinstance(outcomes[0][0], dict)
    assert errors > 100  # the mutants reach the error paths, not only the fast path


@needs_c
def test_storage_data_of_the_wrong_shape(monkeypatch):
    """A ``storage_data`` subclass or a chunks value that is not a list goes through the object protocol."""

    class Odd(dict):
        def items(self):  # noqa: D401 - what the non-consuming loop iterates
            return [("not", "a record")]

    for c in (True, False):
        assert _outcome(monkeypatch, c, {}, Odd(a=1), False)[0][0] == "AttributeError"
    state_dict_metadata, storage_data = _records(METADATA[0].read_bytes(), True)
    item = next(iter(state_dict_metadata.values()))
    fields = _read(item)
    item[:] = [{**fields, "chunks": tuple(fields["chunks"])}]
    outcome = _outcome(monkeypatch, True, state_dict_metadata, storage_data, True)
    assert outcome[0] == ("AttributeError", "'tuple' object has no attribute 'clear'")


@needs_c
@pytest.mark.parametrize("index_only", [True, False])
def test_the_c_loops_read_every_fixture_to_the_end(index_only):
    """The C loops stop at any record they do not read (the Python loops go on from there): on what DCP writes,
    index-only or faithfully read, they do the whole work, so the comparisons above compare C, not Python twice."""
    for path in METADATA:
        state_dict_metadata, storage_data = _records(path.read_bytes(), index_only)
        rows, stop, _ = dcp_index._c_items(state_dict_metadata, {}, {}, False)
        assert stop is None and len(rows) == len(state_dict_metadata), path
        assert dcp_index._c_attach(storage_data, rows, False, {}) is None, path


@needs_c
@pytest.mark.parametrize("consume", [True, False])
def test_where_the_c_loops_stop_the_python_loops_go_on(monkeypatch, consume):
    """A record C does not read (here a chunk's offsets as a list, which tuple() takes, and a storage entry's path
    as a str subclass) stops the C loop at that key or entry; the Python loop goes on from it: the same index."""

    class Name(str):
        __slots__ = ()

    def records() -> tuple[dict, dict]:
        state_dict_metadata, storage_data = _records(METADATA[0].read_bytes(), False)
        tensors = [key for key, item in state_dict_metadata.items() if item.__dict__.get("chunks")]
        chunk = state_dict_metadata[tensors[len(tensors) // 2]].__dict__["chunks"][0]
        chunk.__dict__["offsets"] = list(chunk.__dict__["offsets"])
        info = list(storage_data.values())[len(storage_data) // 2]
        info.__dict__["relative_path"] = Name(info.__dict__["relative_path"])
        return state_dict_metadata, storage_data

    state_dict_metadata, storage_data = records()
    rows, stop, _ = dcp_index._c_items(state_dict_metadata, {}, {}, False)
    assert stop is not None and 0 < stop < len(state_dict_metadata)
    rows, stop, _ = dcp_index._c_items(*records()[:1], {}, {}, False)
    assert dcp_index._c_attach(records()[1], {}, False, {})[0] > 0  # stops at the str subclass, past entries
    outcomes = [_outcome(monkeypatch, c, *records(), consume) for c in (True, False)]
    assert isinstance(outcomes[0][0], dict) and outcomes[0] == outcomes[1]


def test_the_c_loops_are_built_where_ci_requires_it():
    """CI (scripts/test.sh) builds the extensions and sets CKPTDOCTOR_REQUIRE_C_SCAN=1: a failed build there
    must fail the run, not skip the comparisons above."""
    if os.environ.get("CKPTDOCTOR_REQUIRE_C_SCAN") != "1":
        pytest.skip("CKPTDOCTOR_REQUIRE_C_SCAN is not set")
    assert dcp_index._use_c


def test_a_command_index_is_held_only_in_the_short_lived_process(monkeypatch):
    """``hold_until_exit``: in the console process (which ends with os._exit) a command's index is not freed
    object by object; a library caller's is freed as usual."""
    import weakref

    from ckptdoctor import gc_pause

    class Index:
        pass

    monkeypatch.setattr(gc_pause, "_HELD_UNTIL_EXIT", [])
    library = Index()
    ref = weakref.ref(library)
    gc_pause.hold_until_exit(library)
    del library
    assert ref() is None
    monkeypatch.setattr(gc_pause, "_short_lived", False)
    gc_pause.short_lived_process()
    console = Index()
    ref = weakref.ref(console)
    gc_pause.hold_until_exit(console)
    del console
    assert ref() is not None


@needs_c
def test_compact_records_read_as_the_states_they_were_built_from():
    """A compact record (the native ``compact_setstate``) reads as the list of states ``list.append`` keeps would:
    for every sequence of BUILD states (dicts of str keys, empty, of other keys, too many keys; tuples, None,
    (state, slots) pairs), ``index_record_fields`` gives the same fields or the same error (which the compact
    record's own BUILD raises where a state is one torch's BUILD refuses)."""
    import pickle

    from ckptdoctor.pickle.index_records import IndexTupleStateRecord, index_record_fields

    rng = random.Random(5)
    compact_plain = type("Plain", (IndexRecord,), {"__slots__": (), "__setstate__": index_records._compact_setstate})
    compact_tuple = type(
        "Props", (IndexTupleStateRecord,), {"__slots__": (), "__setstate__": index_records._compact_setstate}
    )
    loose_plain = type("Plain", (IndexRecord,), {"__slots__": ()})
    loose_tuple = type("Props", (IndexTupleStateRecord,), {"__slots__": ()})

    def states():
        return [
            {"offsets": (0, 4), "sizes": (2, 2)},
            {"fqn": "k", "offset": None, "index": 3},
            {},
            {1: "int key"},
            {f"f{i}": i for i in range(20)},
            (("dtype",), None),
            ({"relative_path": "__0_0.distcp"}, {"length": 5}),
            ({"a": 1}, None),
            (None, {"b": 2}),
            ("x", None),
            None,
            "text",
            (1, 2, 3),
            ("dtype",),
        ]

    compared = 0
    for _ in range(3000):
        sequence = [rng.randrange(len(states())) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
        for compact_cls, loose_cls in ((compact_plain, loose_plain), (compact_tuple, loose_tuple)):
            outcomes = []
            for cls in (compact_cls, loose_cls):
                record = cls()
                try:  # compact_setstate refuses at the BUILD what index_record_fields refuses later, alike
                    for i in sequence:
                        record.__setstate__(states()[i])
                    outcomes.append(index_record_fields(record))
                except pickle.UnpicklingError as exc:
                    outcomes.append(("UnpicklingError", str(exc)))
            assert outcomes[0] == outcomes[1], sequence
            compared += 1
    assert compared == 6000


@needs_c
@pytest.mark.parametrize("path", METADATA[::3], ids=lambda p: p.parent.parent.name)
def test_fixture_indexes_with_and_without_compact_records(monkeypatch, path):
    """The index read from compact records is the index read from records that keep their state dicts."""
    data = path.read_bytes()
    compact = _outcome(monkeypatch, True, *_records(data, True), True)
    # the records DCP writes are read compact (a save's first record may be a bytes item's, which has no fields)
    assert any(_compact(record) for record in _records(data, True)[0].values())
    monkeypatch.setattr(index_records, "_compact_setstate", None)
    monkeypatch.setattr(index_records, "_INDEX_RECORD_CLASSES", {})
    records = _records(data, True)
    assert not _compact(next(iter(records[0].values())))
    assert _outcome(monkeypatch, True, *records, True) == compact


@needs_c
def test_index_sizes_are_shared_within_a_load_and_otherwise_what_the_tuple_add_makes():
    """torch.Size in an index-only read (``pickle._native.index_size``): one object per equal tuple of ints within a
    load, the table emptied after it; items torch.Size refuses (not ints, outside int64) refused with its errors;
    anything else exactly what the Python fallback (``().__add__``, items checked) makes of it."""
    from ckptdoctor.pickle import policy
    from ckptdoctor.pickle.torch_stand_ins import INDEX_SIZE

    index_size = policy.index_size
    from ckptdoctor.pickle import _native

    assert index_size.func is _native.index_size  # a partial in both builds (see policy)
    a, b = (4096, 11008), tuple([4096, 11008])
    assert a is not b and index_size(a) is a and index_size(b) is a  # the first one seen
    policy.forget_index_sizes()
    assert index_size(b) is b  # a new load starts a new table
    flags = (True, 2)
    assert index_size(flags) is flags and index_size(()) == ()  # bools are ints to torch.Size: kept as they are
    with pytest.raises(TypeError, match=r"takes an iterable of 'int' \(item 1 is 'str'\)"):
        index_size((1, "x"))
    with pytest.raises(TypeError, match="item 0 is 'IndexRecord'"):
        index_size((IndexRecord(),))  # never hashed
    with pytest.raises(ValueError, match="item 1 is an int of 64 bits, not an int64"):
        index_size((1, 2**63))
    long_dims = tuple(range(70))  # more dims than the table keys: checked all the same
    assert index_size(long_dims) is long_dims
    with pytest.raises(TypeError):
        index_size((*long_dims, 0.5))
    for args in ([1, 2], ("a",), (), ((1,), (2,)), (None,), (-(2**63), 2**63 - 1), (1.0,), (2**64,)):
        try:
            expected: Any = ("value", INDEX_SIZE(*args))
        except Exception as exc:  # noqa: BLE001 - the point is which one
            expected = (type(exc).__name__, str(exc))
        try:
            got: Any = ("value", index_size(*args))
        except Exception as exc:  # noqa: BLE001
            got = (type(exc).__name__, str(exc))
        assert got == expected, args
    policy.forget_index_sizes()


@needs_c
def test_an_index_only_load_shares_equal_sizes_and_forgets_them(monkeypatch):
    from ckptdoctor.pickle import policy

    data = METADATA[0].read_bytes()
    state_dict_metadata, _ = _records(data, True)
    shapes = [record_attr(meta, "size") for meta in state_dict_metadata.values() if record_attr(meta, "chunks")]
    by_value: dict[tuple, set[int]] = {}
    for shape in shapes:
        by_value.setdefault(tuple(shape), set()).add(id(shape))
    assert len(shapes) > len(by_value) and all(len(ids) == 1 for ids in by_value.values())
    seen: list[int] = []
    monkeypatch.setattr(policy, "forget_index_sizes", lambda: seen.append(1))
    monkeypatch.setattr(unpickler, "forget_index_sizes", lambda: seen.append(1))
    unpickler.loads(data, index_only=True)
    assert seen == [1, 1]  # before the index-only load and after it
    unpickler.loads(data)  # a faithful read shares its sizes too (test_a_faithful_load_shares_...)
    assert seen == [1, 1, 1, 1]
    monkeypatch.undo()
    # a load never shares with another, however it is started (here an unpickler of its own)
    first = unpickler.SafeUnpickler(io.BytesIO(data), index_only=True).load()
    second = unpickler.SafeUnpickler(io.BytesIO(data), index_only=True).load()
    first_shapes = [record_attr(m, "size") for m in record_attr(first, "state_dict_metadata").values()]
    second_shapes = [record_attr(m, "size") for m in record_attr(second, "state_dict_metadata").values()]
    assert first_shapes == second_shapes
    shared = {id(s) for s in first_shapes if s} & {id(s) for s in second_shapes if s}  # () is one object anyway
    assert not shared
    # the same index with sharing and without it
    monkeypatch.setattr(policy, "index_size", ().__add__)
    plain = dcp_index.index_items(*_records(data, True), DcpItem, True)
    monkeypatch.undo()
    assert dcp_index.index_items(*_records(data, True), DcpItem, True) == plain


@needs_c
def test_a_faithful_load_shares_equal_sizes_as_torch_sizes_and_pickles_each_once():
    from ckptdoctor.pickle.torch_stand_ins import Size

    data = METADATA[0].read_bytes()
    state_dict_metadata, storage_data = _records(data, False)
    sizes = [record_attr(meta, "size") for meta in state_dict_metadata.values() if record_attr(meta, "chunks")]
    sizes += [record_attr(index, "offset") for index in storage_data]
    assert sizes and all(type(size) is Size for size in sizes if size is not None)
    by_value: dict[tuple, set[int]] = {}
    for size in filter(None, sizes):
        by_value.setdefault(tuple(size), set()).add(id(size))
    assert len(sizes) > len(by_value) and all(len(ids) == 1 for ids in by_value.values())
    # no two loads share one
    again = [record_attr(index, "offset") for index in _records(data, False)[1]]
    assert again == sizes[-len(again) :] and not {id(s) for s in again if s} & {id(s) for s in sizes if s}
    # a size of bools (ints to torch.Size) is built as it is, unshared; one torch.Size refuses is refused alike
    odd = [Size((True, 2)), Size((True, 2)), Size((1, 2))]
    made = unpickler.loads(unpickler.dumps(odd))
    assert made == odd and [type(s) for s in made] == [Size] * 3
    assert len({id(s) for s in made}) == 3 and type(made[0][0]) is bool
    with pytest.raises(TypeError):  # of a list
        unpickler.loads(unpickler.dumps([Size((1,))]).replace(b"K\x01\x85", b"]K\x01a"))
    with pytest.raises(TypeError, match="item 0 is 'float'"):
        unpickler.loads(unpickler.dumps([Size((1,))]).replace(b"K\x01\x85", b"G?\xf8" + bytes(6) + b"\x85"))
    # written back, each distinct size is pickled once: the same values in a smaller pickle than unshared sizes
    written = unpickler.dumps(unpickler.loads(data))
    unshared = [Size(tuple(s)) for s in sizes if s is not None]
    # the same index (keys, dtypes, shapes, chunks, locations; real torch reads equal objects: tests/test_interop.py)
    assert dcp_index.index_items(*_records(written, True), DcpItem, True) == dcp_index.index_items(
        *_records(data, True), DcpItem, True
    )
    assert len(unpickler.dumps(unshared)) > len(unpickler.dumps([s for s in sizes if s is not None]))


@needs_c
def test_compact_records_hold_their_items_at_their_exact_number():
    state_dict_metadata, storage_data = _records(METADATA[0].read_bytes(), True)
    records = [r for pair in storage_data.items() for r in pair] + list(state_dict_metadata.values())
    compact = [r for r in records if isinstance(r, IndexRecord) and r and type(r[0]) is CompactKeys]
    assert compact
    for record in compact:  # as a list built at its length, not one grown by appends or a slice (2x room)
        assert record.__sizeof__() == [].__sizeof__() + 8 * len(record) and len(record) == 1 + len(record[0])


def _many_chunk_records(n: int) -> tuple[dict, dict]:
    """Index-only records of a real DCP ``Metadata``: key ``big`` of ``n`` chunks (one listed twice), ``small`` of
    three, a bytes item, storage entries in shuffled order, and entries no chunk names (another key, a tensor entry
    without offsets, a bytes entry with offsets)."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def tensor(rows: int, listed_twice: int | None = None) -> TensorStorageMetadata:
        chunks = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 4])) for i in range(rows)]
        if listed_twice is not None:
            chunks.append(ChunkStorageMetadata(torch.Size([listed_twice, 0]), torch.Size([1, 4])))
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows, 4]), chunks)

    state_dict_metadata = {"big": tensor(n, listed_twice=n // 2), "small": tensor(3), "blob": BytesStorageMetadata()}
    entries = [
        (MetadataIndex("big", torch.Size([i, 0])), _StorageInfo(f"__{i % 3}_0.distcp", 16 * i, 16)) for i in range(n)
    ]
    entries += [
        (MetadataIndex("small", torch.Size([i, 0])), _StorageInfo("__0_0.distcp", 9000 + i, 16)) for i in range(3)
    ]
    entries += [
        (MetadataIndex("blob"), _StorageInfo("__1_0.distcp", 7, 3)),
        (MetadataIndex("gone", torch.Size([0, 0])), _StorageInfo("__1_0.distcp", 0, 1)),
        (MetadataIndex("small"), _StorageInfo("__1_0.distcp", 0, 1)),
        (MetadataIndex("blob", torch.Size([0])), _StorageInfo("__1_0.distcp", 0, 1)),
    ]
    random.Random(n).shuffle(entries)
    metadata = Metadata(state_dict_metadata=state_dict_metadata, storage_data=dict(entries))
    return _records(pickle.dumps(metadata, protocol=2), True)


@needs_c
@pytest.mark.parametrize("n", [4, 32, 33, 200])
@pytest.mark.parametrize("consume", [True, False])
def test_storage_entries_reach_the_chunks_they_name_at_any_chunk_count(monkeypatch, n, consume):
    """The storage pass finds a key's chunks by a search (in C up to 32 chunks) or a table (beyond): the same
    locations either way, in C and in Python; a chunk listed twice gets the same one; an entry stored twice keeps
    the last (a record copied into a second dict key); entries no chunk names change nothing."""
    outcomes = []
    for c in (True, False):
        state_dict_metadata, storage_data = _many_chunk_records(n)
        fields = {k: index_record_fields(k) for k in storage_data}
        index = next(k for k, f in fields.items() if f["fqn"] == "small" and f.get("offset") is not None)
        again = list.__new__(type(index))  # a second record of the same entry: a second dict key
        again.extend(index)
        late = list.__new__(type(storage_data[index]))
        late.append({"relative_path": "late", "offset": 1, "length": 2})
        storage_data[again] = late
        outcomes.append(_outcome(monkeypatch, c, state_dict_metadata, storage_data, consume))
    assert outcomes[0] == outcomes[1]
    items = outcomes[0][0]
    assert isinstance(items, dict), items
    big = items["big"].chunks
    assert len(big) == n + 1 and all(chunk.storage is not None for chunk in big)
    for chunk in big:
        row = chunk.offsets[0]
        assert chunk.storage == (f"__{row % 3}_0.distcp", 16 * row, 16)
    assert big[-1].storage is big[n // 2].storage  # listed twice: the same location
    small = {chunk.offsets[0]: chunk.storage for chunk in items["small"].chunks}
    moved = [row for row, location in small.items() if location == ("late", 1, 2)]
    assert len(moved) == 1 and all(small[row] == ("__0_0.distcp", 9000 + row, 16) for row in small if row not in moved)
    assert items["blob"].chunks[0].storage == ("__1_0.distcp", 7, 3)


@needs_c
@pytest.mark.parametrize("c", [True, False])
def test_a_consuming_build_lets_each_key_records_go_as_soon_as_its_item_exists(c):
    """consume: each state_dict_metadata value is set to None once its item is built (no key added or removed), so
    the index reuses the records' memory during the loop instead of after it; without consume nothing changes."""
    state_dict_metadata, storage_data = _records(METADATA[0].read_bytes(), True)
    released_before: list[int] = []

    class Seen(DcpItem):
        __slots__ = ()

        def __init__(self, *args: Any) -> None:
            released_before.append(sum(value is None for value in state_dict_metadata.values()))
            super().__init__(*args)

    if c:  # the C loop sets them as it makes each key's row (its items are made from the rows after it)
        rows, stop, _ = dcp_index._c_items(state_dict_metadata, {}, {}, True)
        assert stop is None and len(rows) == len(state_dict_metadata) > 1
        assert all(value is None for value in state_dict_metadata.values())
        state_dict_metadata, _ = _records(METADATA[0].read_bytes(), True)
        dcp_index._c_items(state_dict_metadata, {}, {}, False)
        assert all(value is not None for value in state_dict_metadata.values())
        return
    index = dcp_index._items_py(state_dict_metadata, {}, {}, Seen, True, {})
    assert len(index) == len(state_dict_metadata) > 1
    assert released_before == list(range(len(index)))
    assert all(value is None for value in state_dict_metadata.values())
    state_dict_metadata, _ = _records(METADATA[0].read_bytes(), True)
    released_before.clear()
    dcp_index._items_py(state_dict_metadata, {}, {}, Seen, False, {})
    assert set(released_before) == {0} and all(value is not None for value in state_dict_metadata.values())


# --- a chunk record BUILT again after its tensor record's BUILD ----------------------------------------------------

_DCP = "torch.distributed.checkpoint.metadata"


def _hand_made_metadata(rebuild_chunk: bool) -> bytes:
    """A one-key ``.metadata`` (protocol 4, by hand) whose chunk record is memoized; with ``rebuild_chunk`` the pickle
    fetches that record again after its tensor record's BUILD and BUILDs it a second time (sizes 8 -> 4)."""
    from hostile_corpus import stack_global, su

    def record(module: str, name: str, *fields: bytes) -> bytes:  # cls() NEWOBJ, then BUILD with {fields}
        return stack_global(module, name) + b")\x81" + b"}(" + b"".join(fields) + b"ub"

    def dims(*values: int) -> bytes:
        return b"(" + b"".join(b"K" + bytes([v]) for v in values) + b"t"

    chunk = stack_global(_DCP, "ChunkStorageMetadata") + b")\x81\x94" + b"}(" + su("offsets") + dims(0)
    chunk += su("sizes") + dims(8) + b"ub"
    tensor = record(_DCP, "TensorStorageMetadata", su("properties"), b"N", su("size"), dims(8), su("chunks"),
                    b"]" + chunk + b"a")  # fmt: skip
    again = b"h\x00}(" + su("offsets") + dims(0) + su("sizes") + dims(4) + b"ub0" if rebuild_chunk else b""
    index = record(_DCP, "MetadataIndex", su("fqn"), su("w"), su("offset"), dims(0), su("index"), b"K\x00")
    info = record("torch.distributed.checkpoint.filesystem", "_StorageInfo", su("relative_path"),
                  su("__0_0.distcp"), su("offset"), b"K\x00", su("length"), b"K\x10")  # fmt: skip
    metadata = su("state_dict_metadata") + b"}(" + su("w") + tensor + b"u" + again
    metadata += su("storage_data") + b"}(" + index + info + b"u"
    return b"\x80\x04" + stack_global(_DCP, "Metadata") + b")\x81}(" + metadata + b"ub."


def _without_plans(path: Path) -> bytes:
    """A fixture's ``.metadata`` as plain DCP writes it: without megatron-core's ``all_local_plans``, whose write
    items hold (memo references to) the same chunk and properties records as ``state_dict_metadata``."""
    metadata = unpickler.loads(path.read_bytes())
    assert metadata.__dict__.pop("all_local_plans", None)
    return unpickler.dumps(metadata)


@needs_c
@pytest.mark.parametrize("c", [True, False])
def test_a_chunk_record_the_pickle_can_reach_again_is_left_as_a_record(monkeypatch, c):
    """A chunk record the memo holds may be BUILT again later in the pickle: the index has its last state, as the
    Python loops over plain records give it."""
    for rebuild, sizes in ((False, (8,)), (True, (4,))):
        metadata = unpickler.loads(_hand_made_metadata(rebuild), index_only=True)
        state_dict_metadata, storage_data = (
            record_attr(metadata, "state_dict_metadata"),
            record_attr(metadata, "storage_data"),
        )
        (result, _) = _outcome(monkeypatch, c, state_dict_metadata, storage_data, True)
        (made,) = result["w"].chunks
        assert (made.offsets, made.sizes, made.storage) == ((0,), sizes, ("__0_0.distcp", 0, 16))


@pytest.mark.parametrize(
    "path", [p for p in METADATA if b"WriteItem" in p.read_bytes()][:3], ids=lambda p: p.parent.parent.name
)
def test_an_index_only_read_drops_megatron_plans_and_indexes_the_same(path):
    """megatron-core keeps every rank's SavePlan in ``.metadata`` (a write item, its tensor data and its index per
    chunk); an index-only read builds each of those parts as the one DROPPED object, keeping nothing they held, and
    the index is the one the faithful read (every plan record built) gives."""
    from hostile_corpus import call

    from ckptdoctor.pickle.index_records import DROPPED

    data = path.read_bytes()
    metadata = unpickler.loads(data, index_only=True)
    plans = record_attr(metadata, "all_local_plans")
    assert plans and all(plan is DROPPED for plan in plans)
    faithful = unpickler.loads(data)
    assert all(len(record_attr(plan, "items")) > 1 for plan in record_attr(faithful, "all_local_plans"))
    index = dcp_index.index_items(
        record_attr(metadata, "state_dict_metadata"), record_attr(metadata, "storage_data"), DcpItem, True
    )
    assert index == dcp_index.index_items(
        record_attr(faithful, "state_dict_metadata"), record_attr(faithful, "storage_data"), DcpItem, False
    )
    # called with arguments, given any state: still the one object, holding nothing; never pickled back
    called = unpickler.loads(call("torch.distributed.checkpoint.planner", "WriteItem", "x", "y"), index_only=True)
    assert called is DROPPED and not hasattr(DROPPED, "__dict__")
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(DROPPED)


@pytest.mark.parametrize("c", [True, False] if dcp_index._use_c else [False])
def test_a_plan_record_where_a_metadata_record_belongs_is_named(monkeypatch, c):
    """A crafted ``.metadata`` may put a plan part (built as DROPPED by an index-only read) where a tensor record or
    a storage entry belongs: the index refuses it with a message that says so, in C as in Python."""
    from ckptdoctor.pickle.index_records import DROPPED, DroppedRecord

    other = object.__new__(DroppedRecord)  # what copyreg._reconstructor would make of the class
    for state_dict_metadata, storage_data in (({"k": DROPPED}, {}), ({}, {DROPPED: DROPPED}), ({"k": other}, {})):
        (result, _) = _outcome(monkeypatch, c, dict(state_dict_metadata), dict(storage_data), True)
        assert result[0] == "IndexValueError" and "save plan's record" in result[1], result
