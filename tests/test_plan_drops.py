"""Save plans left out of index-only reads (``drop_plans`` of ``pruned_reader``,
``ckptdoctor/_pickle_plans.c``).

megatron-core keeps every rank's ``SavePlan`` in ``.metadata``; an index-only read builds each plan part as the one
``DROPPED`` object, and with ``drop_plans`` the bytes of a part's state are not read at all, so that the memo does not
keep the chunk and properties records the plans read (the index can then replace them while the load goes on). What
is left out must change nothing but the memo: the same objects, or the same failure, as reading every byte. These
tests check that on the fixtures, on hand-made pickles at each rule of the recognizer (a part's entries read from code
that stays, chains of parts, objects made outside, failing opcodes, globals outside the known classes), and that a
hostile pickle cannot make the recognizer's work grow faster than the pickle. The seeded mutants of
``tests/test_memo_prune.py`` run the same differential with ``drop_plans`` on.
"""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_memo_prune import _outcome, _passes_scan, needs_c, prune_memo, pruned_reader

from ckptdoctor.errors import UnsafePickleError
from ckptdoctor.formats import torch_dist
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.index_records import DROPPED
from ckptdoctor.pickle.policy import PLAN_PARTS

pytestmark = needs_c

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
METADATA = sorted(FIXTURES.glob("*/iter_*/.metadata"))
PLANNER = "torch.distributed.checkpoint.planner"
DCP_METADATA = "torch.distributed.checkpoint.metadata"


class _Pickle:
    """A protocol 4 pickle written opcode by opcode, counting its memo entries."""

    def __init__(self) -> None:
        self.parts = [b"\x80\x04"]
        self.memo = 0

    def add(self, raw: bytes) -> _Pickle:
        self.parts.append(raw)
        return self

    def put(self) -> int:
        self.parts.append(b"\x94")
        self.memo += 1
        return self.memo - 1

    def string(self, text: str | bytes) -> int:
        raw = text.encode() if isinstance(text, str) else text
        self.parts.append(b"\x8c" + bytes([len(raw)]) + raw)
        return self.put()

    def get(self, entry: int) -> _Pickle:
        return self.add(b"h" + bytes([entry]) if entry < 256 else b"j" + struct.pack("<I", entry))

    def cls(self, module: str, name: str) -> int:
        self.string(module)
        self.string(name)
        self.add(b"\x93")
        return self.put()

    def open_list(self) -> int:
        """EMPTY_LIST, memoized, then MARK (its items follow); the list's memo entry."""
        self.add(b"]")
        entry = self.put()
        self.add(b"(")
        return entry

    def open_part(self, cls: int) -> int:
        """A plan part of class entry ``cls``: NEWOBJ, then its state dict opened (its pairs follow, then SETITEMS
        and BUILD, ``ub``), both memoized as Python's pickler does; the state dict's memo entry."""
        self.get(cls).add(b")\x81")
        self.put()
        self.add(b"}")
        state = self.put()
        self.add(b"(")
        return state

    def part(self, cls: int, *pairs: tuple[str, bytes]) -> int:
        """A whole plan part whose state holds the pairs (raw value opcodes); the state dict's memo entry."""
        state = self.open_part(cls)
        for key, value in pairs:
            self.string(key)
            self.add(value)
        self.add(b"ub")
        return state

    def bytes(self) -> bytes:
        return b"".join(self.parts) + b"."


def _alike(data: bytes) -> bytes:
    """The pickle with plan states left out (prune_memo with drop_plans), after checking that it
    reads as the original does in an index-only read, from both forms of the pruning."""
    assert _passes_scan(data)
    pruned = prune_memo(data, True)
    assert pruned is not None
    assert pruned_reader(data, False, True).read() == pruned
    assert _outcome(pruned, True) == _outcome(data, True)
    return pruned


def test_every_fixture_reads_alike_with_its_plan_states_left_out():
    assert METADATA
    for path in METADATA:
        data = path.read_bytes()
        assert b"WriteItem" in data and b"all_local_plans" in data, path
        pruned = _alike(data)
        # only each rank's SavePlan (or MCoreSavePlan) class push, EMPTY_TUPLE and NEWOBJ stay
        assert b"WriteItem" not in pruned and b"TensorWriteData" not in pruned, path
        assert len(pruned) < 0.75 * len(prune_memo(data, False)), path


def test_the_index_of_every_fixture_is_the_same_with_and_without_left_out_plans(monkeypatch):
    for path in METADATA:
        with_drops = torch_dist.read_metadata(path)
        monkeypatch.setattr(unpickler, "_pruned_reader", lambda d, r, _drop: pruned_reader(d, r, False))
        without = torch_dist.read_metadata(path)
        monkeypatch.undo()
        assert with_drops == without, path


# A part's state of 40 bytes or more: shorter ones are not worth a region (one record each)
_STATE = b"\x8c\x2d" + b"state-of-a-part, long enough to be left out..."[:45]


@pytest.mark.parametrize("module,name", sorted(PLAN_PARTS))
def test_each_plan_class_is_left_out_and_no_other(module, name):
    """The C recognizer's classes are policy.PLAN_PARTS (what an index-only read builds as DROPPED)."""
    p = _Pickle()
    cls = p.cls(module, name)
    p.part(cls, ("marker", _STATE))
    pruned = _alike(p.bytes())
    assert b"state-of-a-part" not in pruned
    assert unpickler.loads(p.bytes(), index_only=True) is DROPPED

    other = _Pickle()
    cls = other.cls(DCP_METADATA, "Metadata")  # a record, not a plan part: its state is the index
    other.part(cls, ("marker", _STATE))
    assert b"state-of-a-part" in (prune_memo(other.bytes(), True) or other.bytes())


def _write_item(p: _Pickle, cls: int, marker: str) -> int:
    """A WriteItem whose state holds a MetadataIndex (a nested record) and a torch.Size built in the plan."""
    index_cls = p.cls(DCP_METADATA, "MetadataIndex")
    size_cls = p.cls("torch", "Size")
    state = p.open_part(cls)
    p.string("index")
    p.get(index_cls).add(b")\x81")
    p.put()
    p.add(b"}(")
    p.string("fqn")
    p.string(marker)
    p.string("offset")
    p.get(size_cls).add(b"K\x00K\x00\x86\x85R")
    p.add(b"ub")
    p.string("type")
    p.add(b"N")
    p.add(b"ub")
    return state


def test_a_part_whose_entry_code_that_stays_reads_is_kept():
    p = _Pickle()
    p.open_list()
    cls = p.cls(PLANNER, "WriteItem")
    state = _write_item(p, cls, "first-item-marker")
    _write_item(p, cls, "second-item-marker")
    p.add(b"e")
    plain = _alike(p.bytes())
    assert b"first-item-marker" not in plain and b"second-item-marker" not in plain

    p.get(state).add(b"a")  # the first item's state dict, read after the plans
    kept = _alike(p.bytes())
    assert b"first-item-marker" in kept and b"second-item-marker" not in kept


def test_parts_read_through_a_chain_of_parts_are_kept_only_if_the_chain_ends_in_code_that_stays():
    def chain(read_last: bool) -> bytes:
        p = _Pickle()
        p.open_list()
        cls = p.cls(PLANNER, "SavePlan")
        p.open_part(cls)
        p.string("a-key")
        first = p.string("written-in-part-A, long enough to be left out")
        p.add(b"ub")
        second = p.open_part(cls)
        p.string("b-key, and a long string to be left out")
        p.get(first)  # part B reads what part A wrote
        p.add(b"ub")
        p.add(b"e")
        if read_last:
            p.get(second).add(b"a")  # code that stays reads part B's state
        return p.bytes()

    dropped = _alike(chain(False))
    assert b"written-in-part-A" not in dropped and b"b-key" not in dropped
    kept = _alike(chain(True))
    assert b"written-in-part-A" in kept and b"b-key" in kept


def test_parts_that_would_change_objects_made_outside_them_are_kept_and_records_made_inside_are_not():
    p = _Pickle()
    outside = p.open_list()
    cls = p.cls(PLANNER, "WriteItem")
    p.get(cls).add(b")\x81}(")
    p.string("appends-outside")
    p.get(outside).add(b"N").add(b"a")  # APPEND to the list made outside the part: the value stays None
    p.add(b"ub")
    p.add(b"e")
    kept = _alike(p.bytes())
    assert b"appends-outside" in kept

    record = _Pickle()
    record.open_list()
    chunk_cls = record.cls(DCP_METADATA, "ChunkStorageMetadata")
    cls = record.cls(PLANNER, "TensorWriteData")
    record.get(cls).add(b")\x81}(")
    record.string("chunk")
    record.get(chunk_cls).add(b")\x81}(")
    record.string("chunks")  # an index record BUILT in the part changes nothing outside it
    record.add(b"]")
    record.string("properties")
    record.add(b"N")
    record.add(b"ub")  # the record's BUILD
    record.add(b"ub")
    record.add(b"e")
    assert b"chunks" not in _alike(record.bytes())  # left out, and read alike


@pytest.mark.parametrize(
    "value",
    [
        b"\x8c\x02\xff\xfe",  # not UTF-8: the original fails at this string
        b"\x8c\x04\xc3\xa9ab",  # UTF-8 but not ASCII: not left out (kept as it is, reads alike)
        b"(K\x01K\x02u",  # SETITEMS on no dict
        b"}(K\x01u",  # odd number of items
        b"](]\x94K\x01se",  # SETITEM on a list
    ],
)
def test_parts_with_an_opcode_that_can_fail_are_kept_and_fail_alike(value):
    p = _Pickle()
    cls = p.cls(PLANNER, "WriteItem")
    p.part(cls, ("may-fail-marker", value))
    data = p.bytes()
    if not _passes_scan(data):
        return
    pruned = _alike(data)
    assert b"may-fail-marker" in pruned


def test_a_size_called_with_three_arguments_is_kept_and_fails_alike():
    p = _Pickle()
    size_cls = p.cls("torch", "Size")
    cls = p.cls(PLANNER, "WriteItem")
    p.get(cls).add(b")\x81}(")
    p.string("size-marker")
    p.get(size_cls).add(b"K\x00K\x00K\x00\x87R")  # Size(0, 0, 0): a TypeError in the original
    p.add(b"ub")
    data = p.bytes()
    assert _outcome(data, True)[0] == "TypeError"
    assert b"size-marker" in _alike(data)


@pytest.mark.parametrize(
    "module,name",
    [
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),  # only outermost
        ("megatron.core.some_module", "Unlisted"),  # tolerated, unlisted: reported (CKD402)
        ("collections", "OrderedDict"),
        ("os", "system"),
    ],
)
def test_a_part_holding_a_global_outside_the_known_classes_is_kept(module, name):
    p = _Pickle()
    cls = p.cls(PLANNER, "SavePlan")
    p.get(cls).add(b")\x81}(")
    p.string("global-marker")
    p.cls(module, name)
    p.add(b"ub")
    data = p.bytes()
    if not _passes_scan(data):
        return
    assert b"global-marker" in _alike(data)
    unlisted: list = []
    try:
        unpickler.loads(data, index_only=True, unlisted=unlisted)
    except (pickle.UnpicklingError, UnsafePickleError):
        assert name == "system"
        return
    assert [u.name for u in unlisted] == (["megatron.core.some_module.Unlisted"] if name == "Unlisted" else [])


def test_hostile_nested_parts_keep_the_recognizer_linear():
    """A million plan parts with no BUILD, each an attempt that would run until the stack limit (50 s here without
    a bound, 0.15 s with it): the recognizer's budget (the pickle's size in opcodes) keeps the whole plan linear.
    Run in a child with a time limit, as a guard against a hang, not a speed target."""
    code = (
        "from ckptdoctor.pickle._native import pruned_reader\n"
        "p = bytearray(b'\\x80\\x04\\x8c$torch.distributed.checkpoint.planner\\x94\\x8c\\tWriteItem\\x94\\x93\\x94')\n"
        "p += b'h\\x02)\\x81}' + b'h\\x02)\\x81}' * 1_000_000 + b'.'\n"
        "pruned_reader(bytes(p), False, True).read()\n"
        "print('done')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert result.stdout.strip() == "done", result.stderr


def test_faithful_reads_keep_the_plans():
    """Rewrites (edit, strip-frozen) read faithfully: safe_pickle asks for drop_plans only in index-only reads."""
    data = METADATA[0].read_bytes()
    faithful = unpickler.loads(data)
    plans = torch_dist.record_attr(faithful, "all_local_plans")
    assert plans and all(type(plan) is not type(DROPPED) for plan in plans)
    index_only = unpickler.loads(data, index_only=True)
    assert all(plan is DROPPED for plan in torch_dist.record_attr(index_only, "all_local_plans"))


def test_the_plan_memory_stays_under_the_input_size():
    """Hostile shapes for the plan's own memory: a part shorter than a region's record (40 bytes) gets none, and
    parts that read each other's entries without end make every part kept once their edges would pass half the
    input's size. Either way the read is the same; only what is left out changes."""
    tiny = _Pickle()
    cls = tiny.cls(PLANNER, "WriteItem")
    tiny.add(b"0")  # the class, memoized, off the stack
    tiny.open_list()
    for _ in range(100_000):
        tiny.get(cls).add(b")\x81}b")  # a part whose state is an empty dict: 2 bytes
        if _ % 1000 == 999:
            tiny.add(b"e(")
    tiny.add(b"e")
    data = tiny.bytes()
    assert len(_alike(data)) == len(prune_memo(data, False) or data)  # nothing left out

    def readers(n_reads: int) -> bytes:
        p = _Pickle()
        cls = p.cls(PLANNER, "WriteItem")
        p.add(b"0")
        p.open_list()
        entries = []
        for name in ("first-part-state, long enough", "second-part-state, long enough"):
            p.get(cls).add(b")\x81}(")
            p.string("key")
            entries.append(p.string(name))
            p.add(b"ub")
        p.get(cls).add(b")\x81}(")
        p.string("reads")
        p.add(b"](")
        for i in range(n_reads):  # alternate: no two reads in a row of the same part (each an edge)
            p.get(entries[i % 2])
            if i % 1000 == 999:
                p.add(b"e(")
        p.add(b"eub")
        p.add(b"e")
        return p.bytes()

    few = readers(1_000)
    assert b"first-part-state" not in _alike(few)  # under the bound: every part left out
    many = readers(200_000)
    assert b"first-part-state" in _alike(many) and len(_alike(many)) > len(many) // 2  # every part kept


@pytest.mark.parametrize(
    "state,error",
    [
        (b"](K\x01K\x02e", "state is not a dictionary"),  # a list
        (b"K\x07", "state is not a dictionary"),  # an int
        (b"N}(\x8c\x01aK\x01u\x86", "no slot state"),  # (None, {"a": 1}): setattr on a frozen dataclass
        (b"NK\x01\x86", "slot state is not a dictionary"),  # (None, 1)
        (b"}N\x86", "slot state is not a dictionary"),  # ({}, None): torch's load_build wants a dict there too
    ],
)
def test_a_plan_part_built_with_a_state_torch_refuses_is_kept_and_refused(state, error):
    """torch's loader (pickle.load) refuses a BUILD of its frozen plan dataclasses with anything but a dict: the part
    is not left out, and DROPPED refuses the state too, so check does not pass what megatron-core cannot read."""
    p = _Pickle()
    cls = p.cls(PLANNER, "WriteItem")
    p.get(cls).add(b")\x81")
    p.put()
    p.string("state-marker")
    p.add(b"0" + state + b"b")  # POP the marker (it is kept only to find the part), then BUILD with the state
    data = p.bytes()
    assert _passes_scan(data)
    pruned = _alike(data)
    assert b"state-marker" in pruned
    outcome = _outcome(data, True)
    assert outcome[0] == "UnpicklingError" and error in outcome[1], outcome
    for good in (b"}", b"N", b"N}\x86"):  # a dict, None, (None, {}): as torch accepts
        ok = _Pickle()
        ok_cls = ok.cls(PLANNER, "WriteItem")
        ok.get(ok_cls).add(b")\x81")
        ok.put()
        ok.add(good + b"b")
        assert _outcome(ok.bytes(), True)[0] == "ok"


_REFUSED_STATES = [
    (b"](K\x01K\x02e", "state is not a dictionary"),  # a list
    (b"K\x07", "state is not a dictionary"),  # an int
    (b"NK\x01\x86", "slot state is not a dictionary"),  # (None, 1)
    (b"}N\x86", "slot state is not a dictionary"),  # ({}, None)
    (b"(K\x01K\x02K\x03t", "state is not a dictionary"),  # a 3-tuple
]


def _part_holding_record(record: str, state: bytes) -> bytes:
    """A write item whose state holds (under "index") a record of class ``record`` built with ``state``; memo entry
    3 holds ``_MEM_FORMAT_ENCODING(0)``, made before the part (as a plan's properties are made before it)."""
    p = _Pickle()
    code_cls = p.cls(DCP_METADATA, "_MEM_FORMAT_ENCODING")
    p.get(code_cls).add(b"K\x00\x85R")
    assert p.put() == 3
    part = p.cls(PLANNER, "WriteItem")
    cls = p.cls(DCP_METADATA, record)
    p.open_part(part)
    p.string("index")
    p.get(cls).add(b")\x81")
    p.put()
    p.add(state + b"b")
    p.string("marker")
    p.add(_STATE)  # long enough for the part to be worth leaving out
    p.add(b"ub")
    return p.bytes()


@pytest.mark.parametrize("record", ["MetadataIndex", "ChunkStorageMetadata", "BytesStorageMetadata"])
@pytest.mark.parametrize("state,error", _REFUSED_STATES)
def test_a_record_inside_a_plan_part_built_with_a_state_torch_refuses_is_refused(record, state, error):
    """The index never reads the records inside a plan part, but torch's loader builds them and refuses a BUILD with
    anything but a dict (the messages are torch's own, tests/test_interop.py): an index-only read (check) refuses
    them too, and the recognizer does not leave such a part out unread."""
    data = _part_holding_record(record, state)
    assert _passes_scan(data)
    assert b"state-of-a-part" in _alike(data)  # kept
    assert _outcome(data, True)[:2] == ("UnpicklingError", error)
    assert _outcome(data, False)[:2] == ("UnpicklingError", error)  # a faithful read: the C unpickler's own BUILD


def test_records_inside_a_plan_part_with_states_torch_takes_are_left_out():
    """A dict for the dataclass records, a tuple for TensorProperties (its class has a __setstate__): the part is
    still left out unread, so reading megatron-core's plans costs nothing."""
    properties = b"(NN\x89h\x03\x89t"  # (dtype, layout, requires_grad, _MEM_FORMAT_ENCODING(0), pin_memory)
    for record, state in [("MetadataIndex", b"}"), ("ChunkStorageMetadata", b"}"), ("TensorProperties", properties)]:
        data = _part_holding_record(record, state)
        assert b"state-of-a-part" not in _alike(data), record
        assert _outcome(data, True)[0] == "ok"


@pytest.mark.parametrize(
    "state,error",
    [
        (b"(K\x01t", "is not 5 values"),  # a 1-tuple: torch's __setstate__ cannot unpack it (ValueError)
        (b"K\x07", "is not 5 values"),  # an int (TypeError there)
        (b"}N\x86", "is not 5 values"),  # a (dict, None) pair
        (b"(NN\x89h\x03t", "is not 5 values"),  # four values (ValueError there)
    ],
)
def test_a_tensor_properties_state_torch_cannot_take_is_refused(state, error):
    """TensorProperties.__setstate__ unpacks five values: any other state fails torch's load, and is refused by both
    reads, inside a plan part or not (the C recognizer does not leave such a part out)."""
    data = _part_holding_record("TensorProperties", state)
    assert _passes_scan(data)
    for index_only in (True, False):
        outcome = _outcome(data, index_only)
        assert outcome[0] == "UnpicklingError" and error in outcome[1], (index_only, outcome)


@pytest.mark.parametrize(
    "module,name,state,error",
    [
        (DCP_METADATA, "Metadata", b"](K\x01e", "state is not a dictionary"),
        (DCP_METADATA, "StorageMeta", b"}N\x86", "slot state is not a dictionary"),
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan", b"N}(\x8c\x01aK\x01u\x86", "frozen"),
    ],
)
def test_dataclasses_read_as_stand_ins_refuse_what_torch_refuses(module, name, state, error):
    """Metadata, StorageMeta and megatron-core's MCoreSavePlan are generic stand-ins in a faithful read (and the first
    two in an index-only one): their BUILD is checked as torch's is (a frozen dataclass takes no slot state)."""
    p = _Pickle()
    cls = p.cls(module, name)
    p.get(cls).add(b")\x81")
    p.put()
    p.add(state + b"b")
    outcome = _outcome(p.bytes(), False)
    assert outcome[0] == "UnpicklingError" and error in outcome[1], outcome
    good = _Pickle()
    good_cls = good.cls(module, name)
    good.get(good_cls).add(b")\x81")
    good.put()
    good.add(b"}(\x8c\x01aK\x01ub")
    assert _outcome(good.bytes(), False)[0] == "ok"


def _part_reducing(module: str, name: str, field: str, args: bytes) -> bytes:
    """A write item whose state holds, under ``field``, a REDUCE of ``module.name`` with the argument tuple ``args``
    (raw opcodes), and a long marker (so that the part is worth leaving out)."""
    p = _Pickle()
    cls = p.cls(module, name)
    part = p.cls(PLANNER, "WriteItem")
    p.open_part(part)
    p.string(field)
    p.get(cls).add(args + b"R")
    p.string("marker")
    p.add(_STATE)
    p.add(b"ub")
    return p.bytes()


def _reads_alike(data: bytes, kept: bool, error: tuple[str, str] | None) -> None:
    """The part is kept (or left out) as said, and both reads end alike: ok, or the error (type, text in it)."""
    assert (b"state-of-a-part" in _alike(data)) == kept
    for index_only in (True, False):
        outcome = _outcome(data, index_only)
        if error is None:
            assert outcome[0] == "ok", outcome
        else:
            assert outcome[0] == error[0] and error[1] in outcome[1], outcome


@pytest.mark.parametrize("value,kept", [(b"K\x01", False), (b"K\x03", False), (b"K\x04", True), (b"K\x00", True)])
def test_a_write_item_type_is_left_out_only_where_torch_takes_its_value(value, kept):
    """WriteItemType(n) (1..3: TENSOR, SHARD, BYTE_IO) is built as torch_values.WriteItemTypeCode, which refuses
    any other value as torch's enum does; the recognizer leaves a part holding it out unread only where it is one of
    them, so a read refuses a bad one inside a plan part too."""
    data = _part_reducing(PLANNER, "WriteItemType", "type", value + b"\x85")
    _reads_alike(data, kept, ("ValueError", "is not a valid WriteItemType") if kept else None)


@pytest.mark.parametrize(
    "dims,kept,error",
    [
        (b"K\x00K\x04\x86", False, None),  # ints: left out unread
        (b"(K\x01K\x02K\x03K\x04t", False, None),
        (b"K\x00G?\xf8" + bytes(6) + b"\x86", True, "item 1 is 'float'"),  # torch.Size refuses a float
        (b"\x8c\x01a\x85", True, "item 0 is 'str'"),
    ],
)
def test_a_size_inside_a_plan_part_is_left_out_only_where_torch_takes_its_items(dims, kept, error):
    """torch.Size takes ints only: a size of anything else inside a plan part keeps the part, and both reads refuse
    it with torch's message; a size of ints is left out unread as before."""
    data = _part_reducing("torch", "Size", "size", dims + b"\x85")
    _reads_alike(data, kept, None if error is None else ("TypeError", error))
