"""Light stand-ins for the torch objects inside checkpoint pickles, so nothing needs torch to read them.

dtypes (:class:`DtypeRef`), ``torch.Size`` (:class:`Size`), typed-storage classes (:class:`StorageTypeRef`),
storages of ``torch.save`` archives (:class:`StorageRef`), tensors (:class:`TensorRef`), the tensor rebuild
functions. Each pickles back to its torch global (DCP's enum and layout values: :mod:`ckptdoctor.pickle.torch_values`).
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Callable
from typing import Any

from ckptdoctor.pickle.stand_ins import ALIAS_MODULE, register_alias

# --- torch stand-ins ---------------------------------------------------------------------------------


class _Frozen:
    """Base of the shared stand-ins (one object per dtype, storage type or function for the whole process):
    immutable once built, so no pickle can change what a later read sees (a BUILD opcode on one of them
    fails instead of replacing its attributes)."""

    __slots__ = ()

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"{type(self).__name__} stand-ins are read-only")
        object.__setattr__(self, name, value)

    def __setstate__(self, state: Any) -> None:
        raise TypeError(f"{type(self).__name__} stand-ins take no pickled state")


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


class DtypeRef(_Frozen):
    """Stand-in for a ``torch.dtype``; pickles back to the global ``torch.<name>``."""

    __ckd_view__ = "dtype"  # ckptdoctor.pickle.plain shows its repr, and its str in JSON

    _cache: dict[str, DtypeRef] = {}

    def __init__(self, name: str) -> None:
        self.name = name
        self.__module__ = ALIAS_MODULE
        self._alias = register_alias(self, "torch", name)
        self._freeze()

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


class StorageTypeRef(_Frozen):
    """Stand-in for a typed-storage class such as ``torch.FloatStorage``."""

    __ckd_view__ = "repr"  # short, and nothing of the pickle's inside: ckptdoctor.pickle.plain shows it as is

    _cache: dict[str, StorageTypeRef] = {}

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name
        dtype = _STORAGE_TO_DTYPE.get(name)
        self.dtype = DtypeRef.get(dtype) if dtype else None
        self.__module__ = ALIAS_MODULE
        self._alias = register_alias(self, module, name)
        self._freeze()

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
    """Stand-in for ``torch.Size``: a tuple that pickles back to ``torch.Size``.

    Built only from a tuple (as torch pickles it): a tuple built from a list would hide the nesting of what
    the list holds from the pre-pass, which bounds tuple nesting by the tuples it sees (a ``Size`` of a list
    holding a ``Size`` of a list ..., 1.2 MB of pickle, crashed the interpreter when hashed).
    """

    __slots__ = ()
    __ckd_global__ = ("torch", "Size")

    def __new__(cls, dims: tuple = ()) -> Size:
        if not isinstance(dims, tuple):
            raise TypeError(f"torch.Size of a {type(dims).__name__}, not a tuple")
        check_size_items(dims)
        return tuple.__new__(cls, dims)

    def __reduce__(self) -> tuple:
        return (Size, (tuple(self),))


Size.__qualname__ = register_alias(Size, "torch", "Size")
Size.__module__ = ALIAS_MODULE


def check_size_items(dims: tuple) -> None:
    """Refuse what ``torch.Size(dims)`` refuses, with its messages: an item that is not an int (bools are), or
    one outside int64 (torch's loader fails on such a ``.metadata``; so does a read, and ``check`` says so). The
    C extension's ``index_size`` and ``faithful_size`` check alike."""
    for i, item in enumerate(dims):
        if not isinstance(item, int):
            raise TypeError(f"torch.Size() takes an iterable of 'int' (item {i} is '{type(item).__name__}')")
        if not -(2**63) <= item < 2**63:  # torch: "Overflow when unpacking long long"
            raise ValueError(f"torch.Size item {i} is an int of {item.bit_length()} bits, not an int64")


def _index_size_py(*args: Any) -> tuple:
    """What ``torch.Size`` builds when ``.metadata`` is read for its index only (never written back), without the
    C extension: the argument tuple itself, as ``().__add__`` gives it (the same result or the same error), its
    items checked as torch checks them."""
    if len(args) == 1 and isinstance(args[0], tuple):
        check_size_items(args[0])
    return ().__add__(*args)


INDEX_SIZE = _index_size_py

_MAX_SIZES_SEEN = 1 << 20  # as pickle/_records.c: MAX_SIZES_SEEN, MAX_SIZE_DIMS
_MAX_SIZE_DIMS = 64


class FaithfulSizes:
    """``torch.Size`` in a faithful read (a rewrite's ``.metadata``) without the C extension, as its
    ``faithful_size`` builds it: ``cls(dims)``, but one object for equal tuples of int64 ints within a load. The
    pickler writes a shared size once and a memo read for the others, so the ``.metadata`` a rewrite writes is the
    same bytes with and without the extension. Keyed by the packed ints (a bytes hash is keyed per process, where a
    tuple's is not: equal-hash offsets would flood the table); anything else is ``cls(*args)`` as it is."""

    def __init__(self) -> None:
        self._seen: dict[bytes, Any] = {}

    def __call__(self, cls: Any, *args: Any) -> Any:
        if len(args) != 1 or type(args[0]) is not tuple or len(args[0]) > _MAX_SIZE_DIMS:
            return cls(*args)
        dims = args[0]
        if not all(type(item) is int and -(2**63) <= item < 2**63 for item in dims):
            return cls(*args)
        key = struct.pack(f"<{len(dims)}q", *dims)
        known = self._seen.get(key)
        if known is not None and type(known) is cls:
            return known
        made = cls(dims)
        if known is None and len(self._seen) < _MAX_SIZES_SEEN:
            self._seen[key] = made
        return made

    def forget(self) -> None:
        """Empty the table (before and after each load, as ``forget_index_sizes``)."""
        self._seen.clear()


class StorageRef:
    """A storage record of a ``torch.save`` zip: its key, dtype, element count and a way to read bytes."""

    def __init__(
        self, key: str, dtype: DtypeRef | None, location: str, numel: int, read: Callable[[], bytes] | None = None
    ) -> None:
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

    __ckd_view__ = "repr"  # short, and nothing of the pickle's inside: ckptdoctor.pickle.plain shows it as is

    def __init__(
        self,
        storage: StorageRef,
        storage_offset: int,
        size: tuple,
        stride: tuple,
        requires_grad: bool = False,
        parameter: bool = False,
    ) -> None:
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
        args: tuple = (
            self.storage,
            self.storage_offset,
            Size(self.size),
            tuple(self.stride),
            self.requires_grad,
            collections.OrderedDict(),
        )
        tensor = (_rebuild_tensor_v2_ref, args)
        if self.parameter:
            return (_rebuild_parameter_ref, (_Rebuilt(*tensor), self.requires_grad, collections.OrderedDict()))
        return tensor

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorRef):
            return NotImplemented
        return (
            self.dtype is other.dtype
            and self.size == other.size
            and self.stride == other.stride
            and self.storage_offset == other.storage_offset
            and self.storage.data() == other.storage.data()
        )

    __hash__ = object.__hash__

    def __ckd_content__(self) -> bytes:
        """What equal tensors (``__eq__``) share, for ckptdoctor.pickle.plain's digest (``same_value``, diff of the
        common state): dtype, size, stride, offset and the storage's bytes (its attributes hold only a way to read
        them: two tensors of other values digested alike, and diff missed a changed optimizer step count)."""
        try:
            data = hashlib.blake2b(self.storage.data(), digest_size=16).digest()
        except (ValueError, OSError) as exc:  # no source, or unreadable: told apart from any readable bytes
            data = f"unreadable:{exc}".encode()
        return f"{self.dtype!r}|{self.size}|{self.stride}|{self.storage_offset}|".encode() + data

    def small_values(self) -> list | None:
        """The values of a tensor of at most :data:`SHOWN_VALUES` elements in a small storage (a step count, a
        scale), read without torch; None for any other (or a dtype not decoded here)."""
        fmt = _STRUCT_FORMATS.get(self.dtype.name if self.dtype is not None else "")
        if fmt is None or len(self.size) > 1 or self.numel > SHOWN_VALUES or self.storage.numel > SHOWN_STORAGE:
            return None
        try:
            data = self.storage.data()
        except (ValueError, OSError):
            return None
        width = struct.calcsize(fmt)
        step = self.stride[0] if self.size else 0
        out = []
        for i in range(self.numel):
            at = (self.storage_offset + i * step) * width
            if at < 0 or at + width > len(data):
                return None
            (value,) = struct.unpack_from(fmt, data, at)
            if self.dtype is not None and self.dtype.name == "bfloat16":  # the high half of a float32
                (value,) = struct.unpack("<f", struct.pack("<I", value << 16))
            out.append(value)
        return out

    def __repr__(self) -> str:
        values = self.small_values()
        if values is None:
            return f"tensor({self.dtype}, shape={list(self.size)})"
        shown = f"value={values[0]!r}" if not self.size else f"values={values!r}"
        return f"tensor({self.dtype}, shape={list(self.size)}, {shown})"


SHOWN_VALUES = 4
SHOWN_STORAGE = 64  # elements: a view of a large storage is not read for its repr
# little-endian struct formats of the dtypes a small tensor's values are shown for (bfloat16: the raw 16 bits)
_STRUCT_FORMATS = {
    "float32": "<f",
    "float64": "<d",
    "float16": "<e",
    "bfloat16": "<H",
    "int64": "<q",
    "int32": "<i",
    "int16": "<h",
    "int8": "<b",
    "uint8": "<B",
    "bool": "<?",
}


class _Rebuilt:
    """A (callable, args) pair that pickles as REDUCE: used to nest a tensor inside a parameter."""

    def __init__(self, func: Any, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return (self.func, self.args)


class GlobalFunc(_Frozen):
    """A named torch function we never import; pickles back to its global reference."""

    def __init__(self, module: str, name: str, impl: Callable[..., Any]) -> None:
        self.module, self.name, self.impl = module, name, impl
        self.__module__ = ALIAS_MODULE
        self._alias = register_alias(self, module, name)
        self._freeze()

    def __call__(self, *args: Any) -> Any:
        return self.impl(*args)

    def __reduce__(self) -> str:
        return self._alias


def _tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False) -> TensorRef:
    # The arguments come from the pickle: check their types here, so that no reader meets a str storage or
    # a float shape later (one clear "corrupt pickle" instead of an AttributeError deep in a command).
    if not isinstance(storage, StorageRef):
        raise TypeError(f"tensor storage is a {type(storage).__name__}, not a storage")
    for name, dims in (("size", size), ("stride", stride)):
        if not isinstance(dims, tuple) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise TypeError(f"tensor {name} {dims!r} is not a tuple of ints")
    if not isinstance(storage_offset, int) or storage_offset < 0 or any(d < 0 for d in size):
        raise TypeError("tensor offset or size is negative")
    return TensorRef(storage, storage_offset, size, stride, bool(requires_grad))


def _rebuild_tensor_v2(
    storage: StorageRef,
    storage_offset: int,
    size: tuple,
    stride: tuple,
    requires_grad: bool = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> TensorRef:
    return _tensor(storage, storage_offset, size, stride, requires_grad)


def _rebuild_tensor(storage: StorageRef, storage_offset: int, size: tuple, stride: tuple) -> TensorRef:
    return _tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(
    data: TensorRef, requires_grad: bool, backward_hooks: Any = None, state: Any = None
) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise TypeError(f"parameter data is a {type(data).__name__}, not a tensor")
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
        "torch._utils", "_rebuild_parameter_with_state", _rebuild_parameter
    ),
}
