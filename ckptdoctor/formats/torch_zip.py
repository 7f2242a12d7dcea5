"""Read and write ``torch.save`` zip archives without torch, through the safe unpickler.

A ``torch.save`` file is a zip holding ``<archive>/data.pkl`` (the pickled object; tensors refer to
storages by persistent id) and one record ``<archive>/data/<key>`` of raw bytes per storage.
Megatron's ``common.pt``, its ``common_state`` bytes item, every ``_extra_state`` and every tensor
chunk inside a ``.distcp`` file use this format.
"""

from __future__ import annotations

import io
import mmap
import os
import zipfile
from typing import Any

from ckptdoctor import safe_pickle
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.archive import ZIP_MAGIC, is_torch_zip, load_archive
from ckptdoctor.pickle_scan import PickleLimits
from ckptdoctor.torch_stand_ins import DtypeRef, StorageRef, StorageTypeRef, TensorRef

__all__ = ["ZIP_MAGIC", "dump_torch_zip", "is_torch_zip", "load_torch_zip"]


def load_torch_zip(source: bytes | bytearray | memoryview | str | os.PathLike, where: str,
                   limits: PickleLimits | None = None, unlisted: list[str] | None = None) -> Any:
    """Unpickle a ``torch.save`` archive (bytes or a path) into plain objects and stand-ins.

    A file is memory-mapped, so only the bytes asked for are read. ``where`` names the file (and item)
    for error messages; see :func:`ckptdoctor.formats.archive.load_archive`.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return load_archive(source, where, limits, unlisted)
    try:
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            blob: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as exc:
        raise CkptError(f"{where}: cannot read ({exc.strerror})") from None
    return load_archive(blob, where, limits, unlisted)


def _collect_storages(obj: Any, found: dict[int, StorageRef]) -> None:
    if isinstance(obj, TensorRef):
        found.setdefault(id(obj.storage), obj.storage)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _collect_storages(k, found)
            _collect_storages(v, found)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _collect_storages(v, found)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            _collect_storages(v, found)


def dump_torch_zip(obj: Any, archive_name: str = "archive") -> bytes:
    """``torch.save`` format bytes for ``obj`` (plain objects, stand-ins, :class:`TensorRef`).

    Storages keep their keys; their bytes are copied from the source archive.
    """
    storages: dict[int, StorageRef] = {}
    _collect_storages(obj, storages)

    def persistent_id(value: Any) -> Any:
        if isinstance(value, StorageRef):
            storage_type = StorageTypeRef.for_dtype(value.dtype or DtypeRef.get("uint8"))
            return ("storage", storage_type, value.key, value.location, value.numel)
        return None

    pickled = safe_pickle.dumps(obj, persistent_id=persistent_id)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{archive_name}/data.pkl", pickled)
        archive.writestr(f"{archive_name}/.format_version", b"1")
        archive.writestr(f"{archive_name}/byteorder", b"little")
        for storage in storages.values():
            archive.writestr(f"{archive_name}/data/{storage.key}", storage.data())
        archive.writestr(f"{archive_name}/version", b"3\n")
    return buf.getvalue()
