"""Stand-ins for the classes a checkpoint pickle names: inert, inspectable, and pickled back unchanged.

* :class:`StandIn`: any third-party global (megatron, transformer_engine, nemo, numpy, ...). Calling it only
  records the arguments; BUILD records the state.
* :class:`Record`: the DCP metadata dataclasses, built at C speed (one per chunk in a large checkpoint).
* torch: :class:`DtypeRef`, :class:`Size`, :class:`StorageTypeRef`, :class:`StorageRef`, :class:`TensorRef`,
  so metadata and ``torch.save`` archives read without importing torch.

Each is registered under an alias in a private module so that the C pickler can write it back
(``safe_pickle.dumps`` swaps the alias for the original global reference).
"""

from __future__ import annotations

import collections
import copyreg
import secrets
import sys
import types
from collections.abc import Callable
from typing import Any

# --- stand-ins ---------------------------------------------------------------------------------------


class StandIn:
    """Base of the inert stand-ins made for globals we do not import.

    ``Cls(*args)`` (pickle's REDUCE) and ``Cls.__new__(Cls, *args)`` (NEWOBJ) only record ``args``;
    ``__setstate__`` (BUILD) only records the state. Dict state becomes attributes for convenient reading.
    """

    __ckd_global__: tuple[str, str] = ("", "")

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
            return (copyreg.__newobj__, (type(self), *args), state)
        return (type(self), args, state)

    def __eq__(self, other: object) -> bool:
        return (
            type(self) is type(other)
            and self.stand_in_args == other.stand_in_args  # type: ignore[attr-defined]
            and self.stand_in_state == other.stand_in_state  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        # Consistent with __eq__ and spread over the recorded values: DCP's storage_data is a dict keyed by
        # MetadataIndex stand-ins, and a per-class constant hash made loading it quadratic (minutes at 20k keys).
        # Hashes the recorded args and dict state (a raw state is left out: fewer fields, still consistent).
        attrs = self.__dict__
        try:
            state = frozenset(kv for kv in attrs.items() if not kv[0].startswith("_ckd_"))
            return hash((type(self).__ckd_global__, attrs.get("_ckd_args", ()), state))
        except TypeError:  # unhashable args or state (lists, dicts): fall back to the class
            return hash(type(self).__ckd_global__)

    def __repr__(self) -> str:
        name = type(self).__ckd_global__[1]
        parts = [repr(a) for a in self.stand_in_args]
        state = self.stand_in_state
        if state is not None:
            parts.append(f"state={state!r}")
        return f"{name}({', '.join(parts)})"


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


def _register_alias(obj: Any, module: str, name: str) -> str:
    """Register ``obj`` as the stand-in for ``module.name``; returns its alias name in the private module."""
    alias = f"g{len(ALIAS_TARGETS)}"
    setattr(_alias_module, alias, obj)
    ALIAS_TARGETS[alias.encode()] = f"{module}\n{name}\n".encode()
    return alias


_STAND_IN_CLASSES: dict[tuple[str, str], type[StandIn]] = {}


def stand_in_class(module: str, name: str) -> type[StandIn]:
    """The (cached) inert stand-in class for the global ``module.name``."""
    key = (module, name)
    cls = _STAND_IN_CLASSES.get(key)
    if cls is None:
        short = name.rsplit(".", 1)[-1]
        cls = type(short, (StandIn,), {"__ckd_global__": key, "__module__": module, "__qualname__": name})
        cls.__qualname__ = _register_alias(cls, module, name)
        cls.__module__ = ALIAS_MODULE
        _STAND_IN_CLASSES[key] = cls
    return cls


class Record:
    """Light stand-in for the plain-data records of DCP metadata (one per tensor chunk: ~100k in a large
    checkpoint). No Python-level ``__new__``, ``__setstate__`` or ``__hash__``, so the C unpickler builds
    them at C speed (NEWOBJ + BUILD update ``__dict__`` directly) and they hash by identity; they pickle
    back through the default ``__reduce_ex__`` (NEWOBJ + their ``__dict__``).
    """

    __ckd_global__: tuple[str, str] = ("", "")

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
        fields = ", ".join(f"{k}={v!r}" for k, v in self.stand_in_state.items())
        return f"{type(self).__ckd_global__[1]}({fields})"


class TupleStateRecord(Record):
    """A record whose pickled state is a tuple (``TensorProperties``: dtype, layout, requires_grad, ...)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_ckd_state"] = state

    def __reduce_ex__(self, protocol: Any) -> tuple:
        state = self.__dict__.get("_ckd_state", self.stand_in_state)
        return (copyreg.__newobj__, (type(self),), state)


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
RECORD_BASES: dict[tuple[str, str], type[Record]] = {
    (_DCP_METADATA, "MetadataIndex"): Record,
    (_DCP_METADATA, "ChunkStorageMetadata"): Record,
    (_DCP_METADATA, "TensorStorageMetadata"): Record,
    (_DCP_METADATA, "BytesStorageMetadata"): Record,
    (_DCP_METADATA, "TensorProperties"): TupleStateRecord,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): Record,
}
_RECORD_CLASSES: dict[tuple[str, str], type[Record]] = {}


def record_class(module: str, name: str) -> type[Record]:
    """The (cached) light record class standing in for one of the DCP metadata dataclasses."""
    key = (module, name)
    cls = _RECORD_CLASSES.get(key)
    if cls is None:
        cls = type(name, (RECORD_BASES[key],), {"__ckd_global__": key})
        cls.__qualname__ = _register_alias(cls, module, name)
        cls.__module__ = ALIAS_MODULE
        _RECORD_CLASSES[key] = cls
    return cls


STAND_IN_TYPES = (StandIn, Record)


def is_stand_in(obj: object) -> bool:
    return isinstance(obj, STAND_IN_TYPES)


# --- torch stand-ins ---------------------------------------------------------------------------------

# torch dtype name -> (itemsize in bytes, legacy typed-storage class name)
TORCH_DTYPES: dict[str, tuple[int, str | None]] = {
    "float32": (4, "FloatStorage"),
    "float64": (8, "DoubleStorage"),
    "float16": (2, "HalfStorage"),
    "bfloat16": (2, "BFloat16Storage"),
    "int64": (8, "LongStorage"),
    "int32": (4, "IntStorage"),
    "int16": (2, "ShortStorage"),
    "int8": (1, "CharStorage"),
    "uint8": (1, "ByteStorage"),
    "bool": (1, "BoolStorage"),
    "complex64": (8, "ComplexFloatStorage"),
    "complex128": (16, "ComplexDoubleStorage"),
    "float8_e4m3fn": (1, None),
    "float8_e5m2": (1, None),
    "float8_e4m3fnuz": (1, None),
    "float8_e5m2fnuz": (1, None),
    "uint16": (2, None),
    "uint32": (4, None),
    "uint64": (8, None),
}
DTYPE_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cfloat": "complex64",
    "cdouble": "complex128",
}
_STORAGE_TO_DTYPE = {storage: dtype for dtype, (_, storage) in TORCH_DTYPES.items() if storage}


class DtypeRef:
    """Stand-in for a ``torch.dtype``; pickles back to the global ``torch.<name>``."""

    _cache: dict[str, DtypeRef] = {}

    def __init__(self, name: str) -> None:
        self.name = name
        self.__module__ = ALIAS_MODULE
        self._alias = _register_alias(self, "torch", name)

    @classmethod
    def get(cls, name: str) -> DtypeRef:
        name = DTYPE_ALIASES.get(name, name)
        ref = cls._cache.get(name)
        if ref is None:
            ref = cls._cache[name] = DtypeRef(name)
        return ref

    @property
    def itemsize(self) -> int | None:
        info = TORCH_DTYPES.get(self.name)
        return info[0] if info else None

    def __reduce__(self) -> str:
        return self._alias

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


class StorageTypeRef:
    """Stand-in for a typed-storage class such as ``torch.FloatStorage``."""

    _cache: dict[str, StorageTypeRef] = {}

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name
        dtype = _STORAGE_TO_DTYPE.get(name)
        self.dtype = DtypeRef.get(dtype) if dtype else None
        self.__module__ = ALIAS_MODULE
        self._alias = _register_alias(self, module, name)

    @classmethod
    def get(cls, module: str, name: str) -> StorageTypeRef:
        ref = cls._cache.get(f"{module}.{name}")
        if ref is None:
            ref = cls._cache[f"{module}.{name}"] = StorageTypeRef(module, name)
        return ref

    @classmethod
    def for_dtype(cls, dtype: DtypeRef) -> StorageTypeRef:
        storage = TORCH_DTYPES.get(dtype.name, (0, None))[1]
        if storage is None:
            raise ValueError(f"no legacy storage class for torch.{dtype.name}")
        return cls.get("torch", storage)

    def __reduce__(self) -> str:
        return self._alias

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class Size(tuple):
    """Stand-in for ``torch.Size``: a tuple that pickles back to ``torch.Size``."""

    __ckd_global__ = ("torch", "Size")

    def __reduce__(self) -> tuple:
        return (Size, (tuple(self),))


Size.__qualname__ = _register_alias(Size, "torch", "Size")
Size.__module__ = ALIAS_MODULE


class StorageRef:
    """A storage record of a ``torch.save`` zip: its key, dtype, element count and a way to read bytes."""

    def __init__(self, key: str, dtype: DtypeRef | None, location: str, numel: int,
                 read: Callable[[], bytes] | None = None) -> None:
        self.key = key
        self.dtype = dtype
        self.location = location
        self.numel = numel
        self._read = read
        self._data: bytes | None = None

    def data(self) -> bytes:
        if self._data is None:
            if self._read is None:
                raise ValueError(f"storage {self.key} has no data source")
            self._data = self._read()
        return self._data

    def set_data(self, data: bytes) -> None:
        self._data = data


class TensorRef:
    """Stand-in for a ``torch.Tensor`` inside a pickle: storage, offset, size and stride; no torch needed."""

    def __init__(self, storage: StorageRef, storage_offset: int, size: tuple, stride: tuple,
                 requires_grad: bool = False, parameter: bool = False) -> None:
        self.storage = storage
        self.storage_offset = storage_offset
        self.size = tuple(size)
        self.stride = tuple(stride)
        self.requires_grad = requires_grad
        self.parameter = parameter

    @property
    def dtype(self) -> DtypeRef | None:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.size:
            n *= d
        return n

    def __reduce__(self) -> tuple:
        args = (self.storage, self.storage_offset, Size(self.size), tuple(self.stride),
                self.requires_grad, collections.OrderedDict())
        tensor = (_rebuild_tensor_v2_ref, args)
        if self.parameter:
            return (_rebuild_parameter_ref, (_Rebuilt(*tensor), self.requires_grad, collections.OrderedDict()))
        return tensor

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorRef):
            return NotImplemented
        return (self.dtype is other.dtype and self.size == other.size and self.stride == other.stride
                and self.storage_offset == other.storage_offset and self.storage.data() == other.storage.data())

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"tensor({self.dtype}, shape={list(self.size)})"


class _Rebuilt:
    """A (callable, args) pair that pickles as REDUCE: used to nest a tensor inside a parameter."""

    def __init__(self, func: Any, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return (self.func, self.args)


class GlobalFunc:
    """A named torch function we never import; pickles back to its global reference."""

    def __init__(self, module: str, name: str, impl: Callable[..., Any]) -> None:
        self.module, self.name, self.impl = module, name, impl
        self.__module__ = ALIAS_MODULE
        self._alias = _register_alias(self, module, name)

    def __call__(self, *args: Any) -> Any:
        return self.impl(*args)

    def __reduce__(self) -> str:
        return self._alias


def _rebuild_tensor_v2(storage: StorageRef, storage_offset: int, size: tuple, stride: tuple,
                       requires_grad: bool = False, backward_hooks: Any = None, metadata: Any = None) -> TensorRef:
    return TensorRef(storage, storage_offset, size, stride, requires_grad)


def _rebuild_tensor(storage: StorageRef, storage_offset: int, size: tuple, stride: tuple) -> TensorRef:
    return TensorRef(storage, storage_offset, size, stride)


def _rebuild_parameter(data: TensorRef, requires_grad: bool, backward_hooks: Any = None,
                       state: Any = None) -> TensorRef:
    data.requires_grad = requires_grad
    data.parameter = True
    return data


_rebuild_tensor_v2_ref = GlobalFunc("torch._utils", "_rebuild_tensor_v2", _rebuild_tensor_v2)
_rebuild_parameter_ref = GlobalFunc("torch._utils", "_rebuild_parameter", _rebuild_parameter)
TORCH_FUNCS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2_ref,
    ("torch._utils", "_rebuild_tensor"): GlobalFunc("torch._utils", "_rebuild_tensor", _rebuild_tensor),
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter_ref,
    ("torch._utils", "_rebuild_parameter_with_state"): GlobalFunc(
        "torch._utils", "_rebuild_parameter_with_state", _rebuild_parameter),
}


class LayoutName(str):
    """``torch.serialization._get_layout("torch.strided")`` as pickled once per tensor in DCP metadata.

    A ``str`` subclass, so the unpickler builds it at C speed; it pickles back to the same call.
    """

    def __reduce__(self) -> tuple:
        return (LayoutName, (str(self),))


class MemoryFormatCode(int):
    """DCP's ``_MEM_FORMAT_ENCODING(n)`` enum value (once per tensor); pickles back to the same call."""

    def __reduce__(self) -> tuple:
        return (MemoryFormatCode, (int(self),))


for _cls, _module, _name in (
    (LayoutName, "torch.serialization", "_get_layout"),
    (MemoryFormatCode, "torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
):
    _cls.__qualname__ = _register_alias(_cls, _module, _name)
    _cls.__module__ = ALIAS_MODULE
# torch names that resolve to the C-speed value classes above
TORCH_VALUE_CLASSES: dict[tuple[str, str], type] = {
    ("torch.serialization", "_get_layout"): LayoutName,
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): MemoryFormatCode,
}
