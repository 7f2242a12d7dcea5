"""Index-only records: what the DCP metadata dataclasses become when ``.metadata`` is read for its index only.

A command that only reads ``.metadata`` builds its index from these and then drops them, so they need not
pickle back: one list per record whose items are the states pickle's BUILD gave it (``list.append`` is the
``__setstate__``, so BUILD runs at C speed). Where the native module ``_native`` was built, the ``__setstate__``
is its ``compact_setstate`` (``_records.c``): a first BUILD with a dict of str keys (every record DCP writes)
leaves ``[CompactKeys(names), value, ...]`` and the state dict is not kept (with the pickle's unread memo entries
pruned, nothing else holds it: two thirds of a record's memory); any other state is appended as before. Same
names, same allowlist, same hashing (by identity) as the :class:`Record` they replace.
"""

from __future__ import annotations

import pickle
from typing import Any

from ckptdoctor.pickle.stand_ins import Record, TupleStateRecord, build_state, check_properties_state


class CompactKeys(tuple):
    """The field names of a compact index record (``record[0]``); made only by the native ``compact_setstate``
    (never by a pickle: not on the allowlist), one per distinct set of names."""

    __slots__ = ()


def _checked_append(record: list, state: Any) -> None:
    """BUILD of an index record without the native module: the state is refused where torch's BUILD refuses it (as
    ``compact_setstate`` refuses it, at the same opcode), else appended."""
    if isinstance(record, IndexTupleStateRecord) and not isinstance(state, dict):
        check_properties_state(state)
    else:
        build_state(state)
    list.append(record, state)


class IndexRecord(list):
    """Index-only stand-in of a DCP metadata record (see :func:`index_record_class`); read it with
    :func:`index_record_fields`."""

    __slots__ = ()
    __ckd_global__: tuple[str, str] = ("", "")
    __setstate__ = _checked_append
    __hash__ = object.__hash__  # type: ignore[assignment]
    __eq__ = object.__eq__  # type: ignore[assignment]
    __ne__ = object.__ne__  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # only reached if a pickle *calls* the class
        list.append(self, {"_ckd_args": args})

    def __repr__(self) -> str:
        return f"<{self.__ckd_global__[1]} index record>"


class IndexTupleStateRecord(IndexRecord):
    """:class:`IndexRecord` of a record whose state may be a tuple (``TensorProperties``)."""

    __slots__ = ()


class DroppedRecord:
    """What an index-only read builds for each part of megatron-core's ``all_local_plans`` (see
    ``policy.index_only``): always the one :data:`DROPPED` object, which keeps nothing it is given. Every rank's
    plan holds a write item, its tensor data and its index per chunk (about as many records as the index itself,
    built at the peak of the read), and the index reads none of them: each is let go at its BUILD."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> DroppedRecord:  # NEWOBJ, or a pickle calling the class
        return DROPPED

    def __setstate__(self, state: Any) -> None:
        """BUILD: the state is not kept, but refused where the real class's BUILD fails. The plan parts are frozen
        dataclasses without ``__setstate__``: torch's loader (a plain ``pickle.load``) accepts only a dict (or None)
        as their state and no slot state, so an index-only read (``check``) refuses what megatron-core could not
        read either. The records the state holds (a write item's index, its tensor data's chunk) are checked as
        torch's BUILD checks theirs: the index never reads them (the C extension checks them at their own BUILD;
        this covers a build without it)."""
        plain, slots = build_state(state)
        if slots:  # setattr on a frozen dataclass
            raise pickle.UnpicklingError("a save plan's record is a frozen dataclass: no slot state")
        for value in (plain or {}).values():
            if isinstance(value, IndexRecord):
                index_record_fields(value)

    def __reduce__(self) -> Any:
        raise TypeError("an index-only read's dropped plan records are never written back")

    def __repr__(self) -> str:
        return "<dropped plan record>"


DROPPED: DroppedRecord = object.__new__(DroppedRecord)

_compact_setstate: Any = None
try:
    from ckptdoctor.pickle import _native

    _compact_setstate = _native.records_setup(CompactKeys, IndexRecord, IndexTupleStateRecord, Record)
except ImportError:  # built without a compiler: list.append
    pass


def index_record_fields(record: IndexRecord) -> dict:
    """The attributes an :class:`IndexRecord` would have as a :class:`Record` (the states of its BUILDs
    applied in order, as the C unpickler applies them to a Record); raises ``pickle.UnpicklingError`` where
    a Record's BUILD would have (so a crafted ``.metadata`` is refused with the same message)."""
    if len(record) == 1 and type(record[0]) is dict:  # one BUILD with a dict (list.append)
        return record[0]
    if record and type(record[0]) is CompactKeys:  # the same, compact (see CompactKeys)
        return dict(zip(record[0], record[1:]))
    fields: dict = {}
    tuple_state = isinstance(record, IndexTupleStateRecord)
    for state in record:
        if tuple_state and not isinstance(state, dict):
            check_properties_state(state)
            fields["_ckd_state"] = state
        else:
            plain, slots = build_state(state)
            fields.update(plain or {})
            fields.update(slots or {})
    return fields


_INDEX_RECORD_CLASSES: dict[type, type[IndexRecord]] = {}


def index_record_class(record: type[Record]) -> type[IndexRecord]:
    """The (cached) index-only class standing in for the record class ``record``."""
    cls = _INDEX_RECORD_CLASSES.get(record)
    if cls is None:
        base = IndexTupleStateRecord if issubclass(record, TupleStateRecord) else IndexRecord
        module, name = record.__ckd_global__
        namespace = {"__slots__": (), "__ckd_global__": (module, name), "__module__": module}
        if _compact_setstate is not None:
            namespace["__setstate__"] = _compact_setstate
        cls = type(name, (base,), namespace)
        _INDEX_RECORD_CLASSES[record] = cls
    return cls
