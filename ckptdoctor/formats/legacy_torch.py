"""Torch's legacy (non-zip) save format, read only to check its pickles; and the Transformer Engine extra state
that carries it.

``torch.save(obj, f, _use_new_zipfile_serialization=False)`` writes five pickles in a row (a magic number, the
protocol version, a sys-info dict, the object with its storages as persistent ids, the storage keys), then the
raw storage bytes. Plain :mod:`pickle` writes a torch storage that way, as ``torch.storage._load_from_bytes(<a
legacy save>)``, which a real load answers with ``torch.load(..., weights_only=False)``. Transformer Engine 2.x
saves a module's FP8 state as ``pickle.dumps(state)`` in a uint8 tensor (Megatron stores it as the
``_extra_state`` bytes item) and loads it with ``pickle.loads``: every pickle in it, nested saves included, is
what a real load of that model runs.
"""

from __future__ import annotations

from typing import Any

from ckptdoctor.errors import PickleLimitError, UnsafePickleError
from ckptdoctor.formats.archive import ArchiveError, is_torch_zip, load_archive, storage_ref
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.policy import UnlistedGlobal
from ckptdoctor.pickle.torch_stand_ins import StorageRef, TensorRef

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization's MAGIC_NUMBER, the first pickle of a legacy save
_PICKLES = 5  # magic number, protocol version, sys info, the object, the storage keys
MAX_NESTED_SAVES = 10_000  # a real FP8 state holds a few tensors per module
# A real FP8 state is tens of KB (scales and amax histories of a few GEMMs); unpickling costs up to ~60 bytes of
# memory per pickle byte, so a payload of hundreds of MB of one-byte opcodes would build gigabytes of objects.
MAX_PAYLOAD = 16 << 20


def check_legacy_save(data: bytes, where: str, unlisted: list[UnlistedGlobal] | None = None) -> int:
    """Every pickle of a legacy save through the safe unpickler (the allowlist and the limits); raises what
    :func:`ckptdoctor.pickle.unpickler.loads` raises, or :class:`ArchiveError` where ``data`` is no legacy save.
    Returns where the pickles end: the raw storage bytes follow (each an 8-byte element count and its data)."""
    view = memoryview(data)
    position = 0
    for index in range(_PICKLES):
        load = (lambda pid: _legacy_storage(pid, where)) if index == 3 else None
        try:
            obj, used = unpickler.loads_prefix(view[position:], load, unlisted)
        except (UnsafePickleError, PickleLimitError) as exc:
            raise exc.located(where) from None
        except Exception as exc:  # a corrupt pickle can raise almost anything: torch.load would fail on it too
            raise ArchiveError(f"{where}: a nested torch save that is not one ({type(exc).__name__})") from None
        if index == 0 and obj != LEGACY_MAGIC:
            raise ArchiveError(f"{where}: a nested torch save whose magic number is not torch's")
        position += used
    return position


def _legacy_storage(pid: Any, where: str) -> StorageRef:
    # the legacy persistent id: ('storage', storage type, key, location, numel, view metadata: None)
    if isinstance(pid, tuple) and len(pid) == 6 and pid[5] is None:
        pid = pid[:5]
    return storage_ref(pid, where)


def check_te_extra_state(obj: Any, where: str, unlisted: list[UnlistedGlobal] | None = None) -> None:
    """If ``obj`` (a decoded ``_extra_state`` item) is a Transformer Engine 2.x state, a non-empty uint8 tensor
    of pickled bytes, check that pickle and every legacy save nested in it (see the module doc)."""
    if not isinstance(obj, TensorRef) or obj.dtype is None or obj.dtype.name != "uint8" or not obj.numel:
        return
    if obj.stride not in ((1,), ()) or len(obj.size) > 1:
        raise ArchiveError(f"{where}: a uint8 extra state that is no flat byte tensor")
    if obj.numel > MAX_PAYLOAD:
        raise PickleLimitError(f"{where}: a uint8 extra state of {obj.numel} bytes exceeds the limit of {MAX_PAYLOAD}")
    payload = obj.storage.data()[obj.storage_offset : obj.storage_offset + obj.numel]
    nested: list[bytes] = []
    where = f"{where}: Transformer Engine extra state"
    try:
        unpickler.loads_prefix(payload, None, unlisted, nested_saves=nested)
    except (UnsafePickleError, PickleLimitError) as exc:
        raise exc.located(where) from None
    except Exception as exc:  # a corrupt pickle can raise almost anything: TE's pickle.loads would fail too
        raise ArchiveError(f"{where}: a uint8 tensor that is no pickle ({type(exc).__name__})") from None
    if len(nested) > MAX_NESTED_SAVES:
        raise PickleLimitError(f"{where}: extra state nests more than {MAX_NESTED_SAVES} torch saves")
    for data in nested:  # torch.load(data): a zip archive's pickle, or a legacy save's five
        if is_torch_zip(data):
            load_archive(data, where, None, unlisted)
        else:
            check_legacy_save(data, where, unlisted)
