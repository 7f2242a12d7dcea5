"""The one unpickler ckptdoctor uses for every pickle it reads.

Checkpoints are pickles from strangers, so nothing here may execute code they name:

* a short allowlist of plain-data classes (builtins containers, ``argparse.Namespace``, paths, ...)
  resolves to the real objects;
* torch names resolve to light stand-ins (dtypes, ``torch.Size``, storages, tensors) so that metadata
  can be read without importing torch;
* every other standard-library name (``os.system``, ``builtins.eval``, ``subprocess.Popen``,
  ``builtins.getattr``, ...) is refused with :class:`UnsafePickleError` before anything is called;
* names from third-party packages (megatron, transformer_engine, nemo, numpy, ...) become inert
  stand-ins: calling one only records its arguments. A stand-in keeps its qualified name and state and
  pickles back (:func:`dumps`) to the same global reference, so real megatron-core unpickles a rewritten
  state to the real objects.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import copyreg
import datetime
import decimal
import fractions
import io
import pathlib
import pickle
import re
import signal
import sys
import types
import uuid
from collections.abc import Callable
from typing import Any, BinaryIO

from ckptdoctor.errors import UnsafePickleError
from ckptdoctor.stand_ins import ALIAS_MODULE, ALIAS_TARGETS, RECORD_BASES, record_class, stand_in_class
from ckptdoctor.torch_stand_ins import (
    DTYPE_ALIASES,
    TORCH_DTYPES,
    TORCH_FUNCS,
    TORCH_VALUE_CLASSES,
    DtypeRef,
    Size,
    StorageTypeRef,
)

# --- the allowlist -----------------------------------------------------------------------------------

# Real objects: plain data, harmless to construct with any arguments.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{("builtins", t.__name__): t for t in (
        set, frozenset, dict, list, tuple, bytearray, bytes, int, float, complex, str, bool, slice,
        range, object, type(None))},
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("collections", "deque"): collections.deque,
    ("collections", "Counter"): collections.Counter,
    ("copyreg", "_reconstructor"): copyreg._reconstructor,  # type: ignore[attr-defined]
    ("copyreg", "__newobj__"): copyreg.__newobj__,  # type: ignore[attr-defined]
    ("copyreg", "__newobj_ex__"): copyreg.__newobj_ex__,  # type: ignore[attr-defined]
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("datetime", "datetime"): datetime.datetime,
    ("datetime", "date"): datetime.date,
    ("datetime", "time"): datetime.time,
    ("datetime", "timedelta"): datetime.timedelta,
    ("datetime", "timezone"): datetime.timezone,
    ("decimal", "Decimal"): decimal.Decimal,
    ("fractions", "Fraction"): fractions.Fraction,
    ("uuid", "UUID"): uuid.UUID,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "Path"): pathlib.PurePath,
    ("_codecs", "encode"): lambda text, encoding="utf-8": _codecs_encode(text, encoding),
    ("codecs", "encode"): lambda text, encoding="utf-8": _codecs_encode(text, encoding),
    ("io", "BytesIO"): io.BytesIO,
    ("_io", "BytesIO"): io.BytesIO,
    ("signal", "Signals"): signal.Signals,
}


def _codecs_encode(text: str, encoding: str) -> bytes:
    # Protocol-2 pickles spell bytes as _codecs.encode(str, "latin1"); only text codecs are allowed,
    # so a crafted codec name cannot reach anything but a text encoder.
    if encoding.lower().replace("_", "-") not in ("latin1", "latin-1", "iso-8859-1", "utf-8", "utf8", "ascii"):
        raise UnsafePickleError("_codecs", f"encode(..., {encoding!r})")
    return text.encode(encoding)


_STDLIB = set(sys.stdlib_module_names) | {"builtins", "__builtin__", "__main__"}


def resolve_global(module: str, name: str) -> Any:
    """What ``module.name`` resolves to when a checkpoint pickle asks for it (the allowlist policy)."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    key = (module, name)
    if key in _ALLOWED:
        return _ALLOWED[key]
    top = module.split(".", 1)[0]
    if top == "torch":
        return _resolve_torch(module, name)
    if top in _STDLIB or not module:
        raise UnsafePickleError(module, name)
    return stand_in_class(module, name)


def _resolve_torch(module: str, name: str) -> Any:
    if func := TORCH_FUNCS.get((module, name)):
        return func
    if value_class := TORCH_VALUE_CLASSES.get((module, name)):
        return value_class
    if (module, name) in RECORD_BASES:
        return record_class(module, name)
    if module == "torch":
        if name == "Size":
            return Size
        plain = DTYPE_ALIASES.get(name, name)
        if plain in TORCH_DTYPES:
            return DtypeRef.get(plain)
        if name.endswith("Storage"):
            return StorageTypeRef.get(module, name)
    if module in ("torch.storage", "torch") and name in ("UntypedStorage", "TypedStorage", "_LegacyStorage"):
        return StorageTypeRef.get(module, name)
    return stand_in_class(module, name)


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals go through :func:`resolve_global`.

    ``persistent_load`` (for torch zip storages) is supplied by the caller; without one, a pickle that
    uses persistent ids is refused.
    """

    def __init__(self, file: BinaryIO, persistent_load: Callable[[Any], Any] | None = None) -> None:
        super().__init__(file)
        self._persistent_load = persistent_load

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 - pickle API
        return resolve_global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent_load is None:
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return self._persistent_load(pid)


def loads(data: bytes, persistent_load: Callable[[Any], Any] | None = None) -> Any:
    return SafeUnpickler(io.BytesIO(data), persistent_load).load()


def load(file: BinaryIO, persistent_load: Callable[[Any], Any] | None = None) -> Any:
    return SafeUnpickler(file, persistent_load).load()


# --- writing back ------------------------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    """The C pickler; protocol 2 writes globals as text GLOBAL opcodes, which ``dumps`` then de-aliases."""


class _PicklerWithStorages(pickle.Pickler):
    def __init__(self, file: BinaryIO, persistent_id: Callable[[Any], Any]) -> None:
        super().__init__(file, protocol=2, fix_imports=False)
        self._persistent_id = persistent_id

    def persistent_id(self, obj: Any) -> Any:
        return self._persistent_id(obj)


_ALIAS_GLOBAL_RE = re.compile(rb"c" + re.escape(ALIAS_MODULE.encode()) + rb"\n(g\d+)\n")


def dumps(obj: Any, persistent_id: Callable[[Any], Any] | None = None) -> bytes:
    """Pickle ``obj`` (plain data, stand-ins, torch stand-ins) so that the original classes load back.

    ``persistent_id`` writes tensor storages (see ``formats.torch_zip``). Protocol 2, as ``torch.save`` uses.
    """
    buf = io.BytesIO()
    if persistent_id is None:
        _Pickler(buf, protocol=2, fix_imports=False).dump(obj)
    else:
        _PicklerWithStorages(buf, persistent_id).dump(obj)
    return _ALIAS_GLOBAL_RE.sub(lambda m: b"c" + ALIAS_TARGETS[m.group(1)], buf.getvalue())
