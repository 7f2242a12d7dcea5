"""Stand-ins for the classes a checkpoint pickle names: inert, inspectable, and pickled back unchanged.

* :class:`StandIn`: any third-party global (megatron, transformer_engine, nemo, numpy, ...). Calling it only
  records the arguments; BUILD records the state.
* :class:`Record`: the DCP metadata dataclasses, built at C speed (one per chunk in a large checkpoint).
* torch objects live in :mod:`ckptdoctor.pickle.torch_stand_ins`; the lighter records of index-only reads in
  :mod:`ckptdoctor.pickle.index_records`.

Each is registered under an alias in a private module so that the C pickler can write it back
(``unpickler.dumps`` swaps the alias for the original global reference).
"""

from __future__ import annotations

import copyreg
import pickle
import re
import secrets
import sys
import types
from typing import Any

from ckptdoctor.errors import UnsafePickleError
from ckptdoctor.pickle.plain import fingerprint, short_repr

# --- stand-ins ---------------------------------------------------------------------------------------


class _FrozenClass(type):
    """Metaclass of the stand-in classes: they are cached for the whole process, so once made they are
    read-only (no pickle can change a stand-in class for a later read)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        if cls.__dict__.get("_ckd_frozen"):
            raise AttributeError(f"stand-in class {cls.__qualname__} is read-only")
        super().__setattr__(name, value)

    def __delattr__(cls, name: str) -> None:
        raise AttributeError(f"stand-in class {cls.__qualname__} is read-only")


def build_state(state: Any) -> tuple[dict | None, dict | None]:
    """The (state, slot state) that pickle's BUILD applies to an object without ``__setstate__`` (a dataclass),
    refused with the C unpickler's messages where it refuses them (``load_build``): a state that is not a dict (or
    None), or a (state, slot state) pair whose state is not a dict (or None) or whose slot state is not a dict
    (None included: torch's own loader refuses ``({}, None)`` for every DCP dataclass)."""
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
        if state is not None and not isinstance(state, dict):
            raise pickle.UnpicklingError("state is not a dictionary")
        if not isinstance(slots, dict):
            raise pickle.UnpicklingError("slot state is not a dictionary")
        return state, slots
    if state is not None and not isinstance(state, dict):
        raise pickle.UnpicklingError("state is not a dictionary")
    return state, None


# DCP dataclasses that reads keep as generic stand-ins (no __setstate__ in torch or megatron-core), -> frozen: their
# BUILD is checked as the C unpickler's load_build checks it (a frozen one takes no slot state: setattr fails), so
# that `check` refuses what torch's loader refuses. (The records of RECORD_BASES are checked by the C unpickler
# itself, or by index_records in index-only reads.)
BUILD_CHECKED: dict[tuple[str, str], bool] = {
    ("torch.distributed.checkpoint.metadata", "Metadata"): False,
    ("torch.distributed.checkpoint.metadata", "StorageMeta"): False,
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"): True,
}


class StandIn(metaclass=_FrozenClass):
    """Base of the inert stand-ins made for globals we do not import.

    ``Cls(*args)`` (pickle's REDUCE) and ``Cls.__new__(Cls, *args)`` (NEWOBJ) only record ``args``;
    ``__setstate__`` (BUILD) only records the state. Dict state becomes attributes for convenient reading.
    """

    __ckd_global__: tuple[str, str] = ("", "")
    __ckd_view__ = "stand-in"  # how ckptdoctor.pickle.plain's walks show it: args and state

    def __new__(cls, *args: Any, **kwargs: Any) -> StandIn:
        obj = object.__new__(cls)
        # Hot path (one call per object of a 20k-key .metadata): record only what is there; an absent
        # _ckd_via means "new" (pickle's NEWOBJ), __init__ marks REDUCE-style calls.
        if args or kwargs:
            obj.__dict__.update(_ckd_args=args, _ckd_kwargs=kwargs)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_ckd_via"] = "call"

    def __setstate__(self, state: Any) -> None:
        frozen = BUILD_CHECKED.get(self.__ckd_global__)
        if frozen is not None:
            slots = build_state(state)[1]  # refused where torch's BUILD refuses it
            if frozen and slots:
                raise pickle.UnpicklingError(f"{self.__ckd_global__[1]} is a frozen dataclass: no slot state")
        if isinstance(state, dict):
            self.__dict__.update(state)
            self.__dict__["_ckd_state_kind"] = "dict"
        elif (
            isinstance(state, tuple)
            and len(state) == 2
            and isinstance(state[0], (dict, type(None)))
            and isinstance(state[1], dict)
        ):
            self.__dict__.update(state[0] or {})
            self.__dict__.update(state[1])
            self.__dict__["_ckd_state_kind"] = "slots"
            self.__dict__["_ckd_slot_names"] = tuple(state[1])
        else:
            self.__dict__["_ckd_state"] = state
            self.__dict__["_ckd_state_kind"] = "raw"

    # Reading helpers ------------------------------------------------------------------------------

    @property
    def stand_in_args(self) -> tuple:
        return self.__dict__.get("_ckd_args", ())

    @property
    def stand_in_state(self) -> Any:
        kind = self.__dict__.get("_ckd_state_kind")
        if kind == "raw":
            return self.__dict__["_ckd_state"]
        if kind is None:
            return None
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_ckd_")}

    @classmethod
    def qualified_name(cls) -> str:
        module, name = cls.__ckd_global__
        return f"{module}.{name}"

    # Writing back ---------------------------------------------------------------------------------

    def __reduce__(self) -> tuple:
        kind = self.__dict__.get("_ckd_state_kind")
        if kind == "dict":
            state: Any = self.stand_in_state
        elif kind == "slots":
            slot_names = self.__dict__["_ckd_slot_names"]
            attrs = self.stand_in_state or {}
            plain = {k: v for k, v in attrs.items() if k not in slot_names}
            state = (plain or None, {k: attrs[k] for k in slot_names})
        elif kind == "raw":
            state = self.__dict__["_ckd_state"]
        else:
            state = None
        args = self.stand_in_args
        if self.__dict__.get("_ckd_via", "new") == "new":
            return (copyreg.__newobj__, (type(self), *args), state)  # type: ignore[attr-defined]
        return (type(self), args, state)

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return False
        return fingerprint(self) == fingerprint(other)

    def __hash__(self) -> int:
        # From a collision-resistant digest of the class, recorded args and state (shared references digested
        # once): a per-class constant made DCP's storage_data quadratic to load, and a hash of the args tuple
        # could be made to collide at will by a pickle (ints hash alike in every process: hash flooding).
        return int.from_bytes(fingerprint(self)[:8], "little", signed=True)

    def __repr__(self) -> str:
        return short_repr(self)  # bounded: pickled args can expand exponentially


# --- aliases for writing back ---------------------------------------------------------------------------
# The C pickler writes a class or named object as a GLOBAL only after importing its module and finding the
# very same object there, and megatron/torch are neither imported nor importable here. So every stand-in
# global is also registered under an alias in a private module of ours; ``dumps`` pickles with the fast C
# pickler and then swaps each aliased GLOBAL for the original reference. The alias module's name carries a
# random token, so it cannot occur by accident in pickled data.
ALIAS_MODULE = f"ckptdoctor._stand_in_globals_{secrets.token_hex(8)}"
_alias_module = types.ModuleType(ALIAS_MODULE)
sys.modules[ALIAS_MODULE] = _alias_module
ALIAS_TARGETS: dict[bytes, bytes] = {}  # alias name -> b"module\nname\n" of the original global


_DOTTED_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def valid_global_name(module: object, name: object) -> bool:
    """A module that is a dotted ASCII identifier and a name that is a plain one: the only globals ckptdoctor
    reads or writes. Anything else (a newline, a dot in the name) could smuggle a second global into a text
    GLOBAL opcode or resolve through attributes (``torch`` + ``os.system``)."""
    return (
        isinstance(module, str)
        and isinstance(name, str)
        and _DOTTED_RE.match(module) is not None
        and _IDENTIFIER_RE.match(name) is not None
    )


def register_alias(obj: Any, module: str, name: str) -> str:
    """Register ``obj`` as the stand-in for ``module.name``; returns its alias name in the private module.

    This is the one place a global reference becomes writable, so the name is validated here as well.
    """
    if not valid_global_name(module, name):
        raise ValueError(f"refusing to register the global {(module, name)!a}")
    alias = f"g{len(ALIAS_TARGETS)}"
    setattr(_alias_module, alias, obj)
    ALIAS_TARGETS[alias.encode()] = f"{module}\n{name}\n".encode()
    return alias


_STAND_IN_CLASSES: dict[tuple[str, str], type[StandIn]] = {}


# Globals that are data only in the form real checkpoints use: what the real object does with another use is
# refused where the stand-in sees it (before anything of the pickle's reaches a loader that trusts the name).
def _refuse_call(cls: type, *args: Any, **kwargs: Any) -> Any:
    module, name = cls.__ckd_global__  # type: ignore[attr-defined]
    detail = (
        "called or instantiated: numpy.ndarray(shape, object dtype, buffer) makes object pointers of the pickle's "
        "bytes (a loader crashes on the first access); real pickles only pass it to _reconstruct"
    )
    raise UnsafePickleError(module, name, detail=detail)


def _generator_state(self: StandIn, state: Any) -> None:
    """``torch._C.Generator.__setstate__`` reads three items of its state without checking what the state is (a
    list or a short tuple crashes the loader): only the (seed, offset, uint8 state tensor) torch writes is data."""
    tensor = state[2] if isinstance(state, tuple) and len(state) == 3 else None
    dtype = getattr(getattr(tensor, "dtype", None), "name", None)
    if (
        tensor is None
        or not isinstance(state[0], int)
        or not (state[1] is None or isinstance(state[1], int))
        or dtype != "uint8"
    ):
        detail = "with a state other than (seed, offset, uint8 state tensor), which torch's __setstate__ crashes on"
        raise UnsafePickleError("torch._C", "Generator", detail=detail)
    StandIn.__setstate__(self, state)


_GUARDS: dict[tuple[str, str], dict[str, Any]] = {
    ("numpy", "ndarray"): {"__new__": _refuse_call},
    ("torch._C", "Generator"): {"__setstate__": _generator_state},
}


def stand_in_class(module: str, name: str) -> type[StandIn]:
    """The (cached) inert stand-in class for the global ``module.name``."""
    key = (module, name)
    cls = _STAND_IN_CLASSES.get(key)
    if cls is None:
        short = name.rsplit(".", 1)[-1]
        namespace = {"__ckd_global__": key, "__module__": module, "__qualname__": name, **_GUARDS.get(key, {})}
        cls = type(short, (StandIn,), namespace)
        cls.__qualname__ = register_alias(cls, module, name)
        cls.__module__ = ALIAS_MODULE
        cls._ckd_frozen = True
        _STAND_IN_CLASSES[key] = cls
    return cls


class Record(metaclass=_FrozenClass):
    """Light stand-in for the plain-data records of DCP metadata (one per tensor chunk: ~100k in a large
    checkpoint). No Python-level ``__new__``, ``__setstate__`` or ``__hash__``, so the C unpickler builds
    them at C speed (NEWOBJ + BUILD update ``__dict__`` directly) and they hash by identity; they pickle
    back through the default ``__reduce_ex__`` (NEWOBJ + their ``__dict__``).
    """

    __ckd_global__: tuple[str, str] = ("", "")
    __ckd_view__ = "record"  # how ckptdoctor.pickle.plain's walks show it: its fields

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # only reached if a pickle *calls* the class
        self.__dict__["_ckd_args"] = args

    @property
    def stand_in_state(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_ckd_")}

    @classmethod
    def qualified_name(cls) -> str:
        module, name = cls.__ckd_global__
        return f"{module}.{name}"

    def __repr__(self) -> str:
        return short_repr(self)  # bounded, like StandIn


_NO_STATE = object()
PROPERTIES_NOT_FIVE = "TensorProperties state is not 5 values (dtype, layout, requires_grad, memory format, pin_memory)"


def check_properties_state(state: Any) -> None:
    """A ``TensorProperties`` state other than a dict, as torch's ``TensorProperties.__setstate__`` unpacks it: five
    values (a tuple, or a list); anything else fails there (ValueError, TypeError) and is refused here with
    ``pickle.UnpicklingError``, as ``compact_setstate`` in ``pickle/_records.c`` refuses it in index-only reads (and the
    C recognizer of plan parts sees it: a tuple of five). A ``_MEM_FORMAT_ENCODING`` of a value the enum lacks is
    refused where it is built (``torch_values.MemoryFormatCode``); not checked: that the fourth value is one at
    all (torch raises RuntimeError otherwise). A dict (an older torch's dataclass state) is left to the readers."""
    if not isinstance(state, (tuple, list)) or len(state) != 5:
        raise pickle.UnpicklingError(PROPERTIES_NOT_FIVE)


class TupleStateRecord(Record):
    """A record whose pickled state is a tuple (``TensorProperties``: dtype, layout, requires_grad, ...)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            check_properties_state(state)
            self.__dict__["_ckd_state"] = state

    def __reduce_ex__(self, protocol: Any) -> tuple:
        state = self.__dict__.get("_ckd_state", _NO_STATE)
        if state is _NO_STATE:  # a dict of the attributes only then (a default argument was built for each record)
            state = self.stand_in_state
        return (copyreg.__newobj__, (type(self),), state)  # type: ignore[attr-defined]


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
RECORD_BASES: dict[tuple[str, str], type[Record]] = {
    (_DCP_METADATA, "MetadataIndex"): Record,
    (_DCP_METADATA, "ChunkStorageMetadata"): Record,
    (_DCP_METADATA, "TensorStorageMetadata"): Record,
    (_DCP_METADATA, "BytesStorageMetadata"): Record,
    (_DCP_METADATA, "TensorProperties"): TupleStateRecord,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): Record,
    # the parts of megatron-core's all_local_plans (a rank's plan holds one write item per chunk it saved: as many
    # records as the index, pickled back at C speed with their own __dict__ as state, no copy per record)
    (_DCP_PLANNER, "SavePlan"): Record,
    (_DCP_PLANNER, "WriteItem"): Record,
    (_DCP_PLANNER, "TensorWriteData"): Record,
}
_RECORD_CLASSES: dict[tuple[str, str], type[Record]] = {}


def record_class(module: str, name: str) -> type[Record]:
    """The (cached) light record class standing in for one of the DCP metadata dataclasses."""
    key = (module, name)
    cls = _RECORD_CLASSES.get(key)
    if cls is None:
        # __slotnames__: what copyreg would compute for a class without slots, given up front. The default
        # __reduce_ex__ looks it up for every record pickled, and copyreg cannot cache it on a read-only class
        # (it was recomputed 4 times per key: a quarter of pickling a 200k-key .metadata).
        cls = type(name, (RECORD_BASES[key],), {"__ckd_global__": key, "__slotnames__": []})
        cls.__qualname__ = register_alias(cls, module, name)
        cls.__module__ = ALIAS_MODULE
        cls._ckd_frozen = True
        _RECORD_CLASSES[key] = cls
    return cls


STAND_IN_TYPES = (StandIn, Record)
