"""Read and write ``torch.save`` zip archives without torch, through the safe unpickler.

A ``torch.save`` file is a zip holding ``<archive>/data.pkl`` (the pickled object; tensors refer to
storages by persistent id) and one record ``<archive>/data/<key>`` of raw bytes per storage.
Megatron's ``common.pt``, its ``common_state`` bytes item, every ``_extra_state`` and every tensor
chunk inside a ``.distcp`` file use this format.
"""

from __future__ import annotations

import io
import os
import zipfile
from typing import Any

from ckptdoctor.errors import CkptError, PickleLimitError
from ckptdoctor.formats.archive import ZIP_MAGIC, is_torch_zip, load_archive
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.limits import PickleLimits, current_limits
from ckptdoctor.pickle.policy import UnlistedGlobal
from ckptdoctor.pickle.torch_stand_ins import DtypeRef, StorageRef, StorageTypeRef
from ckptdoctor.storage.files import TooLarge, open_regular, read_capped

__all__ = ["ZIP_MAGIC", "dump_torch_zip", "is_torch_zip", "load_torch_zip"]


def load_torch_zip(
    source: bytes | bytearray | memoryview | str | os.PathLike,
    where: str,
    limits: PickleLimits | None = None,
    unlisted: list[UnlistedGlobal] | None = None,
) -> Any:
    """Unpickle a ``torch.save`` archive (bytes or a path) into plain objects and stand-ins.

    A file is read whole (a common state is small; no memory map, which a file truncated by another
    process would turn into SIGBUS), up to the pickle size limit. ``where`` names the file (and item) for
    error messages; see :func:`ckptdoctor.formats.archive.load_archive`.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return load_archive(source, where, limits, unlisted)
    max_bytes = (limits or current_limits()).max_bytes
    try:
        with open_regular(source) as f:
            blob = read_capped(f, max_bytes)
    except OSError as exc:
        raise CkptError(f"{where}: cannot read ({exc.strerror})") from None
    except TooLarge:  # refused on its size, nothing read
        raise _too_large(where, max_bytes) from None
    if len(blob) > max_bytes:  # it grew over the limit while read
        raise _too_large(where, max_bytes)
    return load_archive(blob, where, limits, unlisted)


def _too_large(where: str, max_bytes: int) -> PickleLimitError:
    return PickleLimitError(f"{where}: larger than the limit of {max_bytes} bytes (raise it with --max-pickle-bytes)")


def dump_torch_zip(obj: Any, archive_name: str = "archive") -> bytes:
    """``torch.save`` format bytes for ``obj`` (plain objects, stand-ins, :class:`TensorRef`).

    Storages keep their keys; their bytes are copied from the source archive.
    """
    storages: dict[int, StorageRef] = {}

    def persistent_id(value: Any) -> Any:
        # The pickler visits each object once (its memo), so collecting storages here stays linear even
        # for a graph of shared references that a recursive walk would expand exponentially.
        if isinstance(value, StorageRef):
            storages.setdefault(id(value), value)
            storage_type = StorageTypeRef.for_dtype(value.dtype or DtypeRef.get("uint8"))
            return ("storage", storage_type, value.key, value.location, value.numel)
        return None

    pickled = unpickler.dumps(obj, persistent_id=persistent_id)
    buf = io.BytesIO()

    def member(name: str) -> zipfile.ZipInfo:  # a fixed date: the same object gives the same bytes
        return zipfile.ZipInfo(f"{archive_name}/{name}", date_time=(1980, 1, 1, 0, 0, 0))

    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(member("data.pkl"), pickled)
        archive.writestr(member(".format_version"), b"1")
        archive.writestr(member("byteorder"), b"little")
        for storage in storages.values():
            archive.writestr(member(f"data/{storage.key}"), storage.data())
        archive.writestr(member("version"), b"3\n")
    return buf.getvalue()
