"""The allowlist: what each global a checkpoint pickle names resolves to (or that it is refused).

Checkpoints are pickles from strangers. PyTorch DCP reads ``.metadata`` with plain ``pickle.load`` and
Megatron reads the common state and sharded objects with ``weights_only=False``, so what a global names is
what a real load executes. The policy is an exact allowlist of ``(module, name)`` pairs, collected from what
megatron-core 0.14-0.19, PyTorch DCP, Transformer Engine and Megatron-Bridge write and from Megatron's own
``megatron/core/safe_globals.py``:

* plain-data classes resolve to the real objects, or to wrappers that bound what the pickle can make them
  allocate (``bytes(10**12)`` is refused);
* torch names resolve to light stand-ins (dtypes, ``torch.Size``, storages, tensors, DCP records), so
  metadata is read without importing torch;
* megatron / Transformer Engine / numpy classes on the list become inert stand-ins: calling one only records
  its arguments, and it pickles back (``unpickler.dumps``) to the same global reference;
* an unlisted global of the megatron, transformer_engine or nemo namespaces is read as an inert stand-in too
  (so ``inspect``/``show``/``diff`` can still show a strange checkpoint) but recorded as an
  :class:`UnlistedGlobal`: the gate (``check``, every write) fails on it, because the next loader imports the
  real object and megatron-core ships helpers that import and call a name given as data;
* a name the user trusts on the command line (``--trust-global``, :func:`trusting`) is read as an inert stand-in
  and recorded as trusted (reported, never a failure);
* everything else (``os.system``, ``torch.os.system``, dotted names, names that are not identifiers,
  unlisted torch or numpy callables) is refused with :class:`UnsafePickleError` before anything is called.

:func:`index_only` swaps a few accepted globals for lighter builders when ``.metadata`` is read for its index
only (never written back); which names are accepted, refused or reported is the same in both readings.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import contextlib
import datetime
import functools
import io
import pathlib
import signal
import types
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError
from ckptdoctor.pickle.index_records import DroppedRecord, index_record_class
from ckptdoctor.pickle.limits import DEFAULT_LIMITS, current_limits
from ckptdoctor.pickle.stand_ins import (
    RECORD_BASES,
    STAND_IN_TYPES,
    Record,
    record_class,
    stand_in_class,
    valid_global_name,
)
from ckptdoctor.pickle.torch_stand_ins import (
    DTYPE_ALIASES,
    INDEX_SIZE,
    TORCH_DTYPES,
    TORCH_FUNCS,
    DtypeRef,
    FaithfulSizes,
    Size,
    StorageTypeRef,
)
from ckptdoctor.pickle.torch_values import TORCH_VALUE_CLASSES

index_size: Callable[..., Any]
faithful_size: Callable[..., Any]
forget_index_sizes: Callable[[], None]
# torch.Size: one object per distinct size within a load, in both kinds of read (pickle/_records.c). A
# partial either way, with or without the native module: a pickle that uses the global as an object (NEWOBJ on it,
# a result of that type) meets the same object type, and so the same errors, in both builds.
try:
    from ckptdoctor.pickle._native import faithful_size as _shared_size
    from ckptdoctor.pickle._native import forget_index_sizes
    from ckptdoctor.pickle._native import index_size as _index_size

    faithful_size = functools.partial(_shared_size, Size)
    index_size = functools.partial(_index_size)
except ImportError:  # built without a compiler: the argument tuple itself; sizes shared as the C shares them
    _faithful_sizes = FaithfulSizes()
    index_size = functools.partial(INDEX_SIZE)
    faithful_size = functools.partial(_faithful_sizes, Size)
    forget_index_sizes = _faithful_sizes.forget


# --- the allowlist -----------------------------------------------------------------------------------

_MAX_ALLOC = DEFAULT_LIMITS.max_string


def _sized(kind: type) -> Callable[..., Any]:
    """``bytes`` / ``bytearray`` that refuse a size argument larger than the string limit, and an encoding or
    error handler other than the plain text codecs (``bytes(str, encoding)`` imports ``encodings.<name>``, a
    module the pickle chooses)."""

    def make(*args: Any) -> Any:
        if args and isinstance(args[0], int) and not isinstance(args[0], bool) and args[0] > _MAX_ALLOC:
            raise PickleLimitError(f"{kind.__name__}({args[0]}) exceeds the limit of {_MAX_ALLOC} bytes")
        if len(args) > 1 and not (_text_codec(args[1]) and (len(args) < 3 or args[2] == "strict") and len(args) < 4):
            raise UnsafePickleError("builtins", kind.__name__, detail=f"with codec arguments {args[1:]!r}"[:200])
        return kind(*args)

    return make


_TEXT_CODECS = ("latin1", "latin-1", "iso-8859-1", "utf-8", "utf8", "ascii")


def _text_codec(encoding: Any) -> bool:
    return isinstance(encoding, str) and encoding.lower().replace("_", "-") in _TEXT_CODECS


def _hashing(kind: type) -> Callable[..., Any]:
    """``set``, ``frozenset``, ``OrderedDict``, ``Counter`` that refuse an iterable of more int, float or tuple
    keys than the limit: their hashes are the same in every process, so keys built to collide make inserting
    them quadratic (hash flooding). The opcode scanner counts the keys a pickle inserts itself."""

    pairs = kind in (dict, collections.OrderedDict)

    def make(*args: Any, **kwargs: Any) -> Any:
        source = args[0] if args else ()
        if isinstance(source, dict):
            keys: Any = source.keys()
        elif isinstance(source, (list, tuple, set, frozenset)):
            keys = (item[0] if pairs and isinstance(item, (list, tuple)) and item else item for item in source)
        else:
            keys = ()
        limit = current_limits().max_hashed_keys
        if sum(1 for key in keys if isinstance(key, (int, float, tuple))) > limit:
            raise PickleLimitError(f"{kind.__name__}() of more than {limit} int, float or tuple keys (hash flooding)")
        return kind(*args, **kwargs)

    make.__qualname__ = make.__name__ = kind.__name__
    return make


_DEFAULT_FACTORIES = (None, list, dict, set, int, float, collections.OrderedDict)


def _defaultdict(factory: Any = None, *rest: Any) -> collections.defaultdict:
    # The factory runs whenever a missing key is read: only plain containers and numbers may be one (a pickle names
    # dict, set or OrderedDict through their bounded wrappers here: the real type is the factory).
    factory = _REAL_TYPE.get(id(factory), factory)
    if factory not in _DEFAULT_FACTORIES:
        raise UnsafePickleError("collections", "defaultdict", detail=f"with factory {factory!r}")
    return collections.defaultdict(factory, *rest)


_RECONSTRUCT_BASES = (object, dict, list, set, int, float, complex, bool)


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    # Protocol 0/1 spelling of "make an instance of cls": base.__new__(cls, state) + base.__init__.
    # Only plain bases: a bytes, str or tuple base would let the pickle size an allocation or nest tuples.
    base = _REAL_TYPE.get(id(base), base)
    if not isinstance(cls, type) or base not in _RECONSTRUCT_BASES or not issubclass(cls, base):
        raise UnsafePickleError("copyreg", "_reconstructor", detail=f"of {cls!r} from {base!r}")
    if base is object:
        return object.__new__(cls)
    obj = base.__new__(cls, state)
    base.__init__(obj, state)  # type: ignore[misc]
    return obj


def _codecs_encode(text: str, encoding: str = "utf-8") -> bytes:
    # Protocol-2 pickles spell bytes as _codecs.encode(str, "latin1"); only text codecs are allowed,
    # so a crafted codec name cannot reach anything but a text encoder.
    if not isinstance(text, str) or not _text_codec(encoding):
        raise UnsafePickleError("_codecs", "encode", detail=f"with codec {encoding!r}")
    return text.encode(encoding)


# Real objects (or bounded wrappers): plain data, harmless to construct with any arguments a pickle can hold.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{("builtins", t.__name__): t for t in (list, int, float, complex, bool, slice, object)},
    **{("builtins", t.__name__): _hashing(t) for t in (set, frozenset, dict)},
    ("builtins", "bytes"): _sized(bytes),
    ("builtins", "bytearray"): _sized(bytearray),
    ("collections", "OrderedDict"): _hashing(collections.OrderedDict),
    ("collections", "defaultdict"): _defaultdict,
    ("collections", "deque"): collections.deque,
    ("collections", "Counter"): _hashing(collections.Counter),
    ("copyreg", "_reconstructor"): _reconstructor,
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("datetime", "datetime"): datetime.datetime,
    ("datetime", "date"): datetime.date,
    ("datetime", "time"): datetime.time,
    ("datetime", "timedelta"): datetime.timedelta,
    ("datetime", "timezone"): datetime.timezone,
    ("uuid", "UUID"): uuid.UUID,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "Path"): pathlib.PurePath,
    ("_codecs", "encode"): _codecs_encode,
    ("codecs", "encode"): _codecs_encode,
    ("io", "BytesIO"): io.BytesIO,
    ("_io", "BytesIO"): io.BytesIO,
    ("signal", "Signals"): signal.Signals,
}

_REAL_TYPE = {
    **{id(_ALLOWED[("builtins", t.__name__)]): t for t in (set, frozenset, dict)},
    **{id(_ALLOWED[("collections", t.__name__)]): t for t in (collections.OrderedDict, collections.Counter)},
}

# Classes read as inert stand-ins: what megatron-core, Transformer Engine and numpy put in checkpoints.
_MCORE = "megatron.core"
_TE_RECIPE = "transformer_engine.common.recipe"
KNOWN_STAND_INS: frozenset[tuple[str, str]] = frozenset(
    {
        (f"{_MCORE}.enums", "ModelType"),
        (f"{_MCORE}.transformer.enums", "AttnBackend"),
        (f"{_MCORE}.transformer.enums", "AttnMaskType"),
        (f"{_MCORE}.transformer.enums", "AttnType"),
        (f"{_MCORE}.transformer.enums", "LayerType"),
        (f"{_MCORE}.transformer.enums", "CudaGraphScope"),
        (f"{_MCORE}.transformer.enums", "CudaGraphModule"),
        (f"{_MCORE}.transformer.enums", "InferenceCudaGraphScope"),
        (f"{_MCORE}.rerun_state_machine", "RerunDiagnostic"),
        (f"{_MCORE}.rerun_state_machine", "RerunMode"),
        (f"{_MCORE}.rerun_state_machine", "RerunState"),
        (f"{_MCORE}.optimizer", "OptimizerConfig"),
        (f"{_MCORE}.optimizer.optimizer_config", "OptimizerConfig"),
        (f"{_MCORE}.dist_checkpointing.strategies.torch", "MCoreMetadata"),
        (f"{_MCORE}.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
        (f"{_MCORE}.extensions.transformer_engine", "TEDelayedScaling"),
        *(
            (_TE_RECIPE, name)
            for name in (
                "DelayedScaling",
                "Float8CurrentScaling",
                "Float8BlockScaling",
                "MXFP8BlockScaling",
                "NVFP4BlockScaling",
                "Format",
                "_FormatHelper",
                "MMParams",
                "QParams",  # Float8CurrentScaling's parameters (megatron-core 0.19's safe globals list it)
            )
        ),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.dtypes", "UInt32DType"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("torch", "device"),
        ("torch._C", "Generator"),
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    }
)


def _numpy_reconstruct(module: str) -> Callable[..., Any]:
    """``numpy.core.multiarray._reconstruct(subtype, shape, dtype)`` (how numpy pickles an array) as a stand-in
    call, for ``numpy.ndarray`` only: the real one runs ``ndarray.__new__(subtype, ...)`` of whatever class the
    pickle names (a subclass's ``__array_finalize__``, ``numpy.memmap`` opening a file)."""
    made = stand_in_class(module, "_reconstruct")
    ndarray = stand_in_class("numpy", "ndarray")

    def reconstruct(subtype: Any, *args: Any) -> Any:
        if subtype is not ndarray:
            raise UnsafePickleError(module, "_reconstruct", detail=f"of {subtype!r}: only numpy.ndarray is data")
        return made(subtype, *args)

    return reconstruct


_RECONSTRUCT = {(m, "_reconstruct"): _numpy_reconstruct(m) for m in ("numpy.core.multiarray", "numpy._core.multiarray")}


# Namespaces whose unlisted globals are read (as inert stand-ins) and recorded: a gate failure, not a refusal to read.
TOLERATED_NAMESPACES = ("megatron", "transformer_engine", "nemo")

_TORCH_STORAGE_NAMES = frozenset(
    {storage for _, storage in TORCH_DTYPES.values() if storage} | {"UntypedStorage", "TypedStorage"}
)


@dataclass
class UnlistedGlobal:
    """A global of one read that is not on the allowlist but was read as an inert stand-in: an unlisted name of a
    tolerated namespace, or one the user trusts (``trusted``). How the pickle used it is counted as the
    unpickler builds (``SafeUnpickler``): ``calls`` (REDUCE: ``obj(*args)``), ``instances`` (NEWOBJ:
    ``cls.__new__(cls, *args)``, only a class does that), ``builds`` (BUILD: state given to what it made)."""

    name: str  # module.name
    trusted: bool = False
    calls: int = 0
    instances: int = 0
    builds: int = 0

    @property
    def use(self) -> str:
        """How the pickle uses the name, in words (never found by importing it)."""
        if self.calls:
            what = "a called object (REDUCE: a real load imports it and calls it with the pickle's arguments)"
        elif self.instances:
            what = "an instantiated class (NEWOBJ: a real load imports it and creates an instance)"
        else:
            what = "a referenced global (a real load imports it and hands it to the rest of the pickle)"
        return what[:-1] + ", then applies BUILD state to the result)" if self.builds else what


def merged_unlisted(entries: Iterable[UnlistedGlobal]) -> list[UnlistedGlobal]:
    """One entry per distinct (name, trusted), uses summed, in name order (a pickle may name a global often)."""
    out: dict[tuple[str, bool], UnlistedGlobal] = {}
    for entry in entries:
        kept = out.setdefault((entry.name, entry.trusted), UnlistedGlobal(entry.name, entry.trusted))
        kept.calls += entry.calls
        kept.instances += entry.instances
        kept.builds += entry.builds
    return [out[key] for key in sorted(out)]


# --- trusted names (--trust-global) -------------------------------------------------------------------
_trusted: frozenset[tuple[str, str]] = frozenset()


def parse_trusted(names: Iterable[str]) -> frozenset[tuple[str, str]]:
    """``MODULE.NAME`` strings as (module, name) pairs; a name that is not a dotted identifier is refused."""
    out = set()
    for raw in names:
        module, _, name = str(raw).strip().rpartition(".")
        if not module or not valid_global_name(module, name):
            raise CkptError(
                f"--trust-global: {str(raw)[:80]!r} is not MODULE.NAME (e.g. megatron.core.enums.ModelType)"
            )
        out.add(_canonical(module, name))
    return frozenset(out)


def set_trusted(pairs: frozenset[tuple[str, str]]) -> None:
    """Trust these globals for this process (the CLI does, from ``--trust-global``; never from a file)."""
    global _trusted
    _trusted = pairs
    hash_safe_global.cache_clear()


def trusted_names() -> list[str]:
    """The trusted globals in force, as ``module.name``, sorted."""
    return sorted(f"{module}.{name}" for module, name in _trusted)


@contextlib.contextmanager
def trusting(names: Iterable[str]) -> Iterator[frozenset[tuple[str, str]]]:
    """Trust ``names`` (``MODULE.NAME``) inside the block, as ``--trust-global`` does for a command."""
    previous = _trusted
    set_trusted(parse_trusted(names))
    try:
        yield _trusted
    finally:
        set_trusted(previous)


def check_global_name(module: str, name: str) -> None:
    """Refuse a global whose module is not a dotted identifier or whose name is not a plain identifier.

    A name with a newline would be written back by a text GLOBAL opcode as two lines (a second, attacker
    chosen global); a dotted name resolves through attributes (``torch`` + ``os.system``).
    """
    if not valid_global_name(module, name):
        raise UnsafePickleError(module, name, detail="not a valid dotted Python name")


def classify_global(module: str, name: str) -> str:
    """``"allowed"``, ``"trusted"`` (``--trust-global``), ``"unlisted"`` (tolerated namespace: read, but a gate
    failure) or ``"refused"`` for a global."""
    try:
        resolve_global(module, name)
    except UnsafePickleError:
        return "refused"
    module, name = _canonical(module, name)
    if _listed(module, name):
        return "allowed"
    return "trusted" if (module, name) in _trusted else "unlisted"


def _canonical(module: str, name: str) -> tuple[str, str]:
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _listed(module: str, name: str) -> bool:
    key = (module, name)
    return key in _ALLOWED or key in KNOWN_STAND_INS or key in _RECONSTRUCT or _torch_value(module, name) is not None


def resolve_global(module: str, name: str, unlisted: list[UnlistedGlobal] | None = None) -> Any:
    """What ``module.name`` resolves to when a checkpoint pickle asks for it (the allowlist policy).

    A global read as a stand-in though not on the allowlist (a tolerated namespace's, or a trusted one) is
    appended to ``unlisted``.
    """
    check_global_name(module, name)
    module, name = _canonical(module, name)
    key = (module, name)
    if key in _ALLOWED:
        return _ALLOWED[key]
    torch_value = _torch_value(module, name)
    if torch_value is not None:
        return torch_value
    if key in _RECONSTRUCT:
        return _RECONSTRUCT[key]
    if key in KNOWN_STAND_INS:
        return stand_in_class(module, name)
    trusted = key in _trusted
    if trusted or module.split(".", 1)[0] in TOLERATED_NAMESPACES:
        if unlisted is not None:
            unlisted.append(UnlistedGlobal(f"{module}.{name}", trusted))
        return stand_in_class(module, name)
    raise UnsafePickleError(module, name)


def _torch_value(module: str, name: str) -> Any:
    if func := TORCH_FUNCS.get((module, name)):
        return func
    if value_class := TORCH_VALUE_CLASSES.get((module, name)):
        return value_class
    if (module, name) in RECORD_BASES:
        return record_class(module, name)
    if module == "torch":
        if name == "Size":
            return Size
        if name in TORCH_DTYPES or name in DTYPE_ALIASES:
            return DtypeRef.get(name)
        if name in _TORCH_STORAGE_NAMES:
            return StorageTypeRef.get(module, name)
    if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
        return StorageTypeRef.get(module, name)
    return None


@functools.lru_cache(maxsize=1024)
def hash_safe_global(module: str, name: str) -> bool:
    """Objects this global builds cannot flood a dict as keys (for the scanner's key count).

    True for stand-ins (a keyed digest as hash), classes hashed by identity, ``str`` subclasses (randomized
    hash) and unhashable classes. False for anything whose hash a pickle could choose (ints, floats, tuples and
    their subclasses such as ``torch.Size``, dates, functions whose result is unknown) and for refused names.
    """
    try:
        obj = resolve_global(module, name)
    except (UnsafePickleError, CkptError):
        return False
    if not isinstance(obj, type):
        return False
    if issubclass(obj, STAND_IN_TYPES) or issubclass(obj, str):
        return True
    hash_method = getattr(obj, "__hash__", None)
    return hash_method is None or hash_method is object.__hash__


# The classes of megatron-core's all_local_plans (each rank's SavePlan, kept in .metadata for cached saves): no part
# of the index, so an index-only read drops them (index_records.DroppedRecord). Rewrites read them faithfully.
_PLANNER = "torch.distributed.checkpoint.planner"
PLAN_PARTS: frozenset[tuple[str, str]] = frozenset(
    {
        (_PLANNER, "SavePlan"),
        (_PLANNER, "WriteItem"),
        (_PLANNER, "TensorWriteData"),
        (f"{_MCORE}.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
    }
)


def faithful(obj: Any) -> Any:
    """What a resolved global builds in a faithful read (a rewrite's, written back): ``torch.Size`` one
    :class:`~ckptdoctor.pickle.torch_stand_ins.Size` per distinct size of ints within a load (:data:`faithful_size`:
    sizes are immutable, so records may share one, and the pickle written back then holds each distinct size once);
    anything else is itself."""
    return faithful_size if obj is Size else obj


def index_only(obj: Any) -> Any:
    """What a resolved global builds when ``.metadata`` is read for its index only: DCP records become
    :class:`~ckptdoctor.pickle.index_records.IndexRecord` lists and ``torch.Size`` the plain argument tuple (both at C
    speed, with no second copy of any state; with the C extension, one tuple per distinct size of ints within a
    load, see :func:`forget_index_sizes`); the parts of megatron-core's plans (:data:`PLAN_PARTS`) the one
    :data:`~ckptdoctor.pickle.index_records.DROPPED` object; anything else is itself. Hashing is unchanged (records and
    plan parts by identity, sizes as tuples: the pre-pass counts them as it counts ``Size``)."""
    if obj is Size:
        return index_size
    if isinstance(obj, type) and issubclass(obj, STAND_IN_TYPES) and obj.__ckd_global__ in PLAN_PARTS:
        return DroppedRecord
    if isinstance(obj, type) and issubclass(obj, Record):
        return index_record_class(obj)
    return obj
