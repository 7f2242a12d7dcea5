"""The one unpickler ckptdoctor uses for every pickle it reads, and the one pickler it writes with.

What a global resolves to is the allowlist of :mod:`ckptdoctor.pickle.policy` (the policy is described there).
Before the unpickler runs, :mod:`ckptdoctor.pickle.scanner` enforces the resource limits (nesting, memo, string
sizes, opcodes that mutate a shared global). Nothing here is shared between reads: stand-in classes and
torch stand-ins are immutable.
"""

from __future__ import annotations

import io
import mmap
import pickle
import re
from collections.abc import Callable
from typing import Any, BinaryIO

from ckptdoctor.errors import CkptError, GateRefusal, PickleLimitError, UnlistedGlobalError, UnsafePickleError
from ckptdoctor.pickle.limits import PickleLimits
from ckptdoctor.pickle.policy import (
    UnlistedGlobal,
    faithful,
    forget_index_sizes,
    hash_safe_global,
    index_only,
    merged_unlisted,
    resolve_global,
)
from ckptdoctor.pickle.scanner import scan
from ckptdoctor.pickle.stand_ins import ALIAS_MODULE, ALIAS_TARGETS, StandIn
from ckptdoctor.pickle.torch_stand_ins import StorageRef
from ckptdoctor.problems import UNLISTED_GLOBAL

__all__ = ["SafeUnpickler", "dumps", "dumps_taken", "loads", "loads_prefix"]

_pruned_reader: Callable[[bytes | bytearray | memoryview | mmap.mmap, bool, bool], BinaryIO | None] | None
try:  # the native module (ckptdoctor/pickle/_prune.c); without it, pickles are read as they are
    from ckptdoctor.pickle._native import pruned_reader as _pruned_reader
except ImportError:
    _pruned_reader = None

# How plain pickle writes a torch storage: torch's own loader, or the one megatron-core (0.19: its __init__)
# puts in its place, which a pickle made in a process that imported megatron.core names instead.
_LOAD_FROM_BYTES = frozenset(
    {("torch.storage", "_load_from_bytes"), ("megatron.core.safe_globals", "safe_load_from_bytes")}
)


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals go through :func:`resolve_global`.

    ``persistent_load`` (for torch zip storages) is supplied by the caller; without one, a pickle that
    uses persistent ids is refused. ``unlisted`` collects the globals of this read that are not on the allowlist
    but read as stand-ins (a tolerated namespace's, or trusted), with how the pickle used each.
    ``index_only``: the result is read, never written back (see :func:`ckptdoctor.pickle.policy.index_only`).
    """

    def __init__(
        self,
        file: BinaryIO,
        persistent_load: Callable[[Any], Any] | None = None,
        index_only: bool = False,
        nested_saves: list[bytes] | None = None,
    ) -> None:
        super().__init__(file)
        self._persistent_load = persistent_load
        self._index_only = index_only
        self._nested_saves = nested_saves
        self.unlisted: list[UnlistedGlobal] = []
        self._recorders: dict[tuple[str, str], Any] = {}  # the stand-ins of this read's unlisted or trusted names

    def load(self) -> Any:
        """``pickle.Unpickler.load``; a load shares equal sizes within itself only (the tables of
        ``policy.index_size`` and ``faithful_size`` are emptied before and after it), so what one load builds
        never depends on another."""
        forget_index_sizes()
        try:
            return super().load()
        finally:
            forget_index_sizes()

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 - pickle API
        if (module, name) in _LOAD_FROM_BYTES and self._nested_saves is not None:
            return self._record_nested_save
        recorder = self._recorders.get((module, name))
        if recorder is not None:  # one class and one entry per name and read, however often the pickle names it
            return recorder
        before = len(self.unlisted)
        obj = resolve_global(module, name, self.unlisted)
        obj = index_only(obj) if self._index_only else faithful(obj)
        if len(self.unlisted) > before:
            if self.unlisted[-1].trusted:
                self._recorders[(module, name)] = obj
            else:
                obj = self._recorders[(module, name)] = _recording_uses(obj, self.unlisted[-1])
        return obj

    def _record_nested_save(self, data: Any) -> StorageRef:
        """``torch.storage._load_from_bytes(data)``, which a real load answers with ``torch.load(data,
        weights_only=False)``: the bytes are kept for the caller to check (``nested_saves``), nothing is loaded."""
        if not isinstance(data, bytes):
            raise pickle.UnpicklingError("torch.storage._load_from_bytes of something other than bytes")
        assert self._nested_saves is not None
        self._nested_saves.append(data)
        return StorageRef("nested", None, "", 0)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent_load is None:
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return self._persistent_load(pid)


def _recording_uses(cls: type[StandIn], entry: UnlistedGlobal) -> type[StandIn]:
    """A subclass of an unlisted global's stand-in, made for one ``find_class``, that counts how the pickle uses it
    (``entry.calls``, ``instances``, ``builds``): the gate's message says what a real load would do with the name.
    REDUCE (``cls(*args)``) runs ``__new__`` and ``__init__``, NEWOBJ only ``__new__``. It pickles back as the
    global (``__reduce__``), where the write's read-back then refuses it (:func:`_verify_written`)."""

    def __new__(sub: type[StandIn], *args: Any, **kwargs: Any) -> StandIn:
        entry.instances += 1
        return StandIn.__new__(sub, *args, **kwargs)

    def __init__(self: StandIn, *args: Any, **kwargs: Any) -> None:
        entry.instances -= 1  # a call: __new__ counted it first
        entry.calls += 1
        StandIn.__init__(self, *args, **kwargs)

    def __setstate__(self: StandIn, state: Any) -> None:
        entry.builds += 1
        StandIn.__setstate__(self, state)

    def __reduce__(self: StandIn) -> tuple:  # pickled back as the global itself (a --trust-global write)
        reduced = StandIn.__reduce__(self)
        if reduced[0] is type(self):
            return (cls, *reduced[1:])
        return (reduced[0], (cls, *reduced[1][1:]), *reduced[2:])

    namespace = {
        "__reduce__": __reduce__,
        "__new__": __new__,
        "__init__": __init__,
        "__setstate__": __setstate__,
        "__ckd_global__": cls.__ckd_global__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    maker: Any = type(cls)  # the stand-ins' read-only metaclass
    return maker(cls.__name__, (cls,), namespace)  # type: ignore[no-any-return]


def loads(
    data: bytes | bytearray | memoryview | mmap.mmap,
    persistent_load: Callable[[Any], Any] | None = None,
    limits: PickleLimits | None = None,
    unlisted: list[UnlistedGlobal] | None = None,
    index_only: bool = False,
    _ours: bool = False,
) -> Any:
    """Unpickle ``data`` under the allowlist and the limits. Globals read as stand-ins though not on the allowlist
    go to ``unlisted`` (see :class:`~ckptdoctor.pickle.policy.UnlistedGlobal`).

    Raises :class:`UnsafePickleError` (a refused global), :class:`PickleLimitError` (a limit) or whatever
    a corrupt pickle raises (callers turn that into a message naming the file). ``index_only``: DCP records
    and ``torch.Size`` are built lighter, for a result that is read and dropped, never written back.
    ``_ours`` (only :func:`_verify_written`): a pickle :func:`dumps` just made, whose shape is bounded by the
    pickler that wrote it; the resource pre-pass is skipped, never the allowlist.

    Where the C extension is built, the unpickler reads the pickle without its unread memo entries
    (``pruned_reader`` in ``ckptdoctor/pickle/_prune.c``, after the pre-pass has checked the original): the same
    objects, or the same failure, in less memory. A DCP ``.metadata`` memoizes ~15 objects per chunk and reads a
    few hundred in all; the C unpickler would keep every memoized object alive until the load returns.
    """
    return _load(data, persistent_load, limits, unlisted, index_only, _ours, prune=True)[0]


def loads_prefix(
    data: bytes | bytearray | memoryview,
    persistent_load: Callable[[Any], Any] | None = None,
    unlisted: list[UnlistedGlobal] | None = None,
    nested_saves: list[bytes] | None = None,
) -> tuple[Any, int]:
    """:func:`loads` of the first pickle in ``data`` and where it ends (torch's legacy save format is several
    pickles in a row). ``nested_saves``: ``torch.storage._load_from_bytes`` is accepted and records its bytes
    there (the caller checks them as legacy saves); elsewhere it stays refused."""
    return _load(data, persistent_load, None, unlisted, False, False, nested_saves)


def _load(
    data: bytes | bytearray | memoryview | mmap.mmap,
    persistent_load: Callable[[Any], Any] | None,
    limits: PickleLimits | None,
    unlisted: list[UnlistedGlobal] | None,
    index_only: bool,
    ours: bool,
    nested_saves: list[bytes] | None = None,
    prune: bool = False,
) -> tuple[Any, int]:
    """The object and where its pickle ends in ``data``; -1 where ``prune`` had the unpickler read the pickle
    pruned (only :func:`loads_prefix` needs the position, and it does not prune)."""
    if not ours:
        scan(data, limits, hash_safe_global)  # the first pickle only: the scan stops at its STOP
    # The pruned pickle is translated from data as the unpickler reads it (no second copy); None: data is read
    # as it is (no memo entry to drop, or pruning not certain to be exact).
    # An anonymous map (files.read_releasable: a large .metadata) is ours alone: the reader may give back its
    # pages as it goes. Read as it is, it is its own file (BytesIO would copy it).
    mapped = isinstance(data, mmap.mmap)
    # An index-only read also leaves out the states of megatron-core's save plans, which it builds as DROPPED
    # anyway (drop_plans, ckptdoctor/pickle/_plans.c); a faithful read keeps them, to write them back.
    pruned = _pruned_reader(data, mapped, index_only) if prune and _pruned_reader is not None else None
    stream: Any = pruned
    if pruned is None:
        stream = io.BytesIO(data) if not mapped else data
        stream.seek(0)
    unpickler = SafeUnpickler(stream, persistent_load, index_only, nested_saves)
    try:
        obj = unpickler.load()
    except RecursionError:
        raise PickleLimitError("pickle nests too deeply to decode") from None
    except MemoryError:
        raise PickleLimitError("pickle needs more memory than is available") from None
    except (UnsafePickleError, PickleLimitError):
        raise
    except Exception as exc:  # a failure after an unlisted global: the stand-in's, not the real load's
        refuse_unlisted(unpickler.unlisted, exc)
        raise
    finally:
        if unlisted is not None:
            unlisted.extend(unpickler.unlisted)
    return obj, -1 if pruned is not None else stream.tell()


def refuse_unlisted(unlisted: list[UnlistedGlobal], error: Exception) -> None:
    """Raise :class:`UnlistedGlobalError` for the first untrusted global in ``unlisted``, if any: ``error`` (a read
    that failed, or a result of the wrong shape) came after a global read as an inert stand-in, which a real load
    imports and runs instead: the gate fails on the global, whatever the stand-in then broke."""
    failing = [entry for entry in merged_unlisted(unlisted) if not entry.trusted]
    if failing:
        module, _, name = failing[0].name.rpartition(".")
        why = f"{type(error).__name__}: {error}" if not isinstance(error, CkptError) else str(error)
        detail = f"not on the allowlist, {failing[0].use}; the rest fails with ckptdoctor's inert stand-in ({why})"
        raise UnlistedGlobalError(module, name, detail=detail[:600]) from None


# --- writing back ------------------------------------------------------------------------------------


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
    out = _pickled(obj, persistent_id)
    _verify_written(out)
    return out


def dumps_taken(held: list) -> bytes:
    """:func:`dumps` of the one object in ``held``, taken out of it (``held`` is left empty) and let go as soon
    as it is pickled, before the read-back check: where ``held`` had the only reference (a rewrite's
    ``.metadata`` stand-ins, the largest thing it holds), the check reuses their memory instead of adding to it.
    """
    if len(held) != 1:
        raise ValueError("dumps_taken needs a list holding exactly one object")
    out = _pickled(held.pop(), None)
    _verify_written(out)
    return out


def _pickled(obj: Any, persistent_id: Callable[[Any], Any] | None) -> bytes:
    """The pickle of ``obj``, globals de-aliased, not yet checked. Without storages, ``pickle.dumps`` (the C
    pickler returns its own output buffer: no second copy of a large pickle through a ``BytesIO``); the raw
    pickle is let go once the de-aliased one exists."""
    try:
        if persistent_id is None:
            raw = pickle.dumps(obj, protocol=2, fix_imports=False)
        else:
            buf = io.BytesIO()
            _PicklerWithStorages(buf, persistent_id).dump(obj)
            raw = buf.getvalue()
            del buf
    except RecursionError:
        raise PickleLimitError("refusing to write: the object nests too deeply to pickle") from None
    del obj
    return _dealiased(raw)


def _dealiased(raw: bytes) -> bytes:
    """``raw`` with each aliased GLOBAL swapped for the original reference (as ``re.sub`` would), joined from
    views of ``raw``: one new copy of a large pickle, not a copy of every piece between globals and their join."""
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    start = 0
    for match in _ALIAS_GLOBAL_RE.finditer(raw):
        pieces += (view[start : match.start()], b"c" + ALIAS_TARGETS[match.group(1)])
        start = match.end()
    pieces.append(view[start:])
    return b"".join(pieces)


def _verify_written(data: bytes) -> None:
    """Read a pickle we are about to write back through the scanner and the allowlist (no execution).

    Every pickle ckptdoctor writes passes here before it replaces anything: a name that slipped through
    would otherwise reach the next loader, which executes what it names. Read index-only (the same allowlist;
    lighter records, and the result is dropped): a rewritten ``.metadata`` of 100k keys is not held in memory
    twice as stand-ins. The resource pre-pass is skipped (half the cost of a 9 MB ``.metadata``): it guards
    the reader against a hostile shape, and this pickle's shape is bounded by the C pickler that just wrote it
    (its nesting by the recursion limit, its memo by the objects it holds), which held objects we read
    through that pre-pass.
    """
    unlisted: list[UnlistedGlobal] = []
    try:
        loads(data, lambda pid: StorageRef("0", None, "cpu", 0), None, unlisted, index_only=True, _ours=True)
    except (UnsafePickleError, PickleLimitError) as exc:
        raise CkptError(f"refusing to write a pickle that does not read back safely: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any failure to read back means we made something wrong
        raise CkptError(f"refusing to write a pickle that does not read back ({type(exc).__name__}: {exc})") from None
    failing = [entry for entry in merged_unlisted(unlisted) if not entry.trusted]
    if failing:  # read as a stand-in here, but the next loader imports it: the gate fails on it
        raise GateRefusal(
            f"{UNLISTED_GLOBAL} refusing to write a pickle that references {failing[0].name}, "
            f"{failing[0].use}; it is not on the allowlist (--trust-global {failing[0].name} overrides)"
        )
