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

from ckptdoctor import safe_pickle
from ckptdoctor.errors import CkptError, UnsafePickleError
from ckptdoctor.torch_stand_ins import DtypeRef, StorageRef, StorageTypeRef, TensorRef

ZIP_MAGIC = b"PK\x03\x04"


def is_torch_zip(head: bytes) -> bool:
    return head[:4] == ZIP_MAGIC


def _archive_prefix(archive: zipfile.ZipFile, where: str) -> str:
    for name in archive.namelist():
        if name.endswith("/data.pkl") and name.count("/") == 1:
            return name[: -len("data.pkl")]
    raise CkptError(f"{where}: not a torch.save archive (no data.pkl record)")


def load_torch_zip(source: bytes | str | os.PathLike, where: str) -> Any:
    """Unpickle a ``torch.save`` archive (bytes or a path) into plain objects and stand-ins.

    Tensors come back as :class:`TensorRef` whose bytes are read from the archive only on demand.
    ``where`` names the file (and item) for error messages.
    """
    in_memory = isinstance(source, (bytes, bytearray, memoryview))
    try:
        fileobj = io.BytesIO(source) if in_memory else open(source, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise CkptError(f"{where}: cannot read ({exc.strerror})") from None
    try:
        try:
            archive = zipfile.ZipFile(fileobj)
        except (zipfile.BadZipFile, ValueError, OSError, NotImplementedError, EOFError, KeyError) as exc:
            raise CkptError(f"{where}: not a readable torch.save file ({exc})") from None
        prefix = _archive_prefix(archive, where)

        def persistent_load(pid: Any) -> StorageRef:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                raise CkptError(f"{where}: unsupported persistent id {pid!r}")
            _, storage_type, key, location, numel = pid
            dtype = storage_type.dtype if isinstance(storage_type, StorageTypeRef) else None
            if dtype is None and isinstance(storage_type, StorageTypeRef):
                dtype = DtypeRef.get("uint8")  # untyped storage: numel counts bytes
            record = f"{prefix}data/{key}"

            def read() -> bytes:
                # Storages are read only when a value is asked for; a file source is reopened then.
                try:
                    with zipfile.ZipFile(io.BytesIO(source) if in_memory else source) as again:
                        return again.read(record)
                except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError, NotImplementedError) as exc:
                    raise CkptError(f"{where}: corrupt storage record {record} ({exc})") from None

            return StorageRef(str(key), dtype, str(location), int(numel), read)

        try:
            with archive.open(f"{prefix}data.pkl") as pkl:
                return safe_pickle.load(pkl, persistent_load)
        except UnsafePickleError as exc:
            raise exc.located(where) from None
        except CkptError:
            raise
        except Exception as exc:  # a corrupt pickle can raise almost anything; report it, never trace
            raise CkptError(f"{where}: corrupt pickle in torch.save archive ({type(exc).__name__}: {exc})") from None
    finally:
        fileobj.close()


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
