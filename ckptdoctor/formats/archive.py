"""The one ``torch.save`` archive decoder: members, ``data.pkl`` through the safe unpickler, storages.

A ``torch.save`` file is a zip holding ``<prefix>/data.pkl`` (the pickled object; tensors refer to storages
by persistent id) and one record ``<prefix>/data/<key>`` of raw bytes per storage. Megatron's ``common.pt``,
its ``common_state`` bytes item, every ``_extra_state`` and every tensor chunk inside a ``.distcp`` use it.

Everything that reads such an archive goes through :func:`parse_archive`, so the checks torch's own reader
makes are made once, the same way: one archive prefix, no duplicate member (torch reads the first, a plain zip
reader the last: the two would see different objects), no ``..`` or absolute member names. Compressed
members (torch never writes them) are inflated with a bound known in advance, so a deflate bomb costs
nothing. Stored members are views into the archive's bytes: no copy.
"""

from __future__ import annotations

import functools
import io
import mmap
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError
from ckptdoctor.formats.crc import crc32
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.limits import PickleLimits, current_limits
from ckptdoctor.pickle.policy import UnlistedGlobal
from ckptdoctor.pickle.torch_stand_ins import DtypeRef, StorageRef, StorageTypeRef

ZIP_MAGIC = b"PK\x03\x04"
MAX_INFLATED = 64 << 20  # the most a compressed storage record may inflate to (torch.save compresses nothing)
# The most a compressed data.pkl may inflate to: unpickling costs up to ~60 bytes of memory per pickle byte
# (an EMPTY_LIST opcode is one byte, a list 56), so this bounds a deflate bomb's objects to a few hundred MB.
MAX_INFLATED_PICKLE = 4 << 20
# The most all compressed records may inflate to in one process: each is bounded, but a .metadata can name one
# bomb from thousands of chunk entries (a 100 KB input cost an hour of inflating in check --deep).
MAX_INFLATED_TOTAL = 1 << 30
# The largest tensor chunk's data.pkl (torch writes ~170 bytes): thousands of .metadata entries can name one
# chunk, so what one decode may cost multiplies (an 800 KB pickle of padding took 0.4 s a chunk in show --stats).
MAX_CHUNK_PICKLE = 16 << 10
_INFLATED = [0]  # bytes inflated so far by this process

_EOCD = struct.Struct("<4s4H2LH")  # signature, disk, cd disk, entries here, entries total, cd size, cd offset, comment
_CDIR = struct.Struct("<4s6H3L5H2L")  # central directory file header (46 bytes)
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header (30 bytes)
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end record, disks (20 bytes)
_ZIP64_RECORD = struct.Struct("<4sQ2H2L4Q")  # zip64 end record: ..., entries here, entries, cd size, cd offset

Blob = bytes | bytearray | memoryview


class ArchiveError(CkptError):
    """An archive torch would not read, or would read differently from us (a CKD404 finding in ``check``)."""


class CorruptRecord(CkptError):
    """A record whose bytes do not match the CRC-32 ``torch.save`` wrote for them: they changed after the save (a
    flipped bit on a disk, a bad copy, an edit). torch's reader does not check it and loads the changed bytes; every
    read here does (CKD314 in ``check --deep``, an error where values are read)."""


def crc_mismatch(name: str, stored: int, data: Blob) -> str | None:
    """Why record ``name``'s bytes ``data`` are not those saved with CRC-32 ``stored``, or None."""
    computed = crc32(data, 0)
    if computed == stored:
        return None
    why = f"saved {stored:08x}, its bytes now {computed:08x}"
    return f"record {name} fails its CRC-32 ({why}): they changed after the save"


def stored_record_problem(blob: Blob, member: Member) -> str | None:
    """:func:`crc_mismatch` of a stored member of ``blob`` read where ``member`` (of an archive of the same layout:
    values.archive_memo) says it and its CRC-32 lie, without the archive object."""
    stored = int.from_bytes(blob[member.crc_at : member.crc_at + 4], "little")
    return crc_mismatch(member.name, stored, memoryview(blob)[member.start : member.start + member.size])


def is_torch_zip(head: Blob) -> bool:
    return bytes(head[:4]) == ZIP_MAGIC


@dataclass(frozen=True)
class Member:
    """One archive member: where its bytes start, how many there are, and how they are stored."""

    name: str
    start: int  # offset of the member's (possibly compressed) bytes in the archive
    size: int  # uncompressed size
    compressed_size: int
    method: int  # 0 stored, 8 deflated
    crc: int  # CRC-32 of the uncompressed bytes, from the central directory
    # where that CRC-32 lies in the archive (-1: read by zipfile): archives of one layout differ only in these
    # fields (values.archive_memo), so a member of a remembered layout reads this archive's own CRC from there
    crc_at: int = -1


class TorchArchive:
    """A parsed ``torch.save`` archive over bytes held in memory (or a memory map)."""

    def __init__(self, blob: Blob, members: dict[str, Member], prefix: str, where: str, general: bool) -> None:
        self.blob = blob
        self.members = members
        self.prefix = prefix
        self.where = where
        self.general = general  # the directory needed the general (zipfile) reader: zip64 or a comment
        order = members.get(f"{prefix}byteorder")  # data, not directory: checked for every archive, remembered too
        if order is not None and bytes(blob[order.start : order.start + order.compressed_size]) != b"little":
            # torch.load byte-swaps every storage of a "big" archive: it would load other values than ours
            raise ArchiveError(f"{where}: archive's byteorder is not little-endian (torch would byte-swap it)")

    def stored_crc(self, member: Member) -> int:
        """The CRC-32 this archive's central directory holds for ``member``."""
        if member.crc_at < 0:
            return member.crc
        return int.from_bytes(self.blob[member.crc_at : member.crc_at + 4], "little")

    def crc_problem(self, name: str, data: Blob) -> str | None:
        """Why ``data`` (the member's uncompressed bytes) is not what was saved, or None."""
        return crc_mismatch(name, self.stored_crc(self.members[name]), data)

    def members_crc_problem(self, read: dict[str, Blob] | None = None) -> str | None:
        """The first member (in directory order) whose bytes fail their CRC-32, or None: every record's checksum
        (``read``: members whose bytes the caller holds already, by name)."""
        for name, member in self.members.items():
            data = (read or {}).get(name)
            if data is None:
                # a compressed member (torch.save writes none) inflates within the bound of a storage record's: a
                # deflate bomb is a PickleLimitError (CKD403), not memory
                limit = min(member.size, MAX_INFLATED) if member.method else member.size
                try:
                    data = self.read(name, limit, verify_crc=False)
                except PickleLimitError:
                    raise
                except CkptError as exc:
                    return str(exc).removeprefix(f"{self.where}: ")
            problem = crc_mismatch(name, self.stored_crc(member), data)
            if problem is not None:
                return problem
        return None

    def read(self, name: str, limit: int, verify_crc: bool = True) -> Blob:
        """A member's bytes (a view for stored members); refuses more than ``limit`` bytes.

        ``verify_crc`` checks the record's CRC-32 (torch's reader does not: it loads changed bytes) and raises
        :class:`CorruptRecord` where it does not match. Every reader of values keeps the default; the CRC costs
        about 0.02 ns a byte where the C fold runs (formats/crc.py).
        """
        member = self.members.get(name)
        if member is None:
            raise CkptError(f"{self.where}: record {name} missing from the archive")
        if member.size > limit:
            raise PickleLimitError(f"{self.where}: record {name} holds {member.size} bytes, over the limit of {limit}")
        raw = memoryview(self.blob)[member.start : member.start + member.compressed_size]
        data: Blob = raw
        if member.method:
            if _INFLATED[0] + member.size > MAX_INFLATED_TOTAL:
                raise PickleLimitError(
                    f"{self.where}: record {name}: compressed records inflating to over {MAX_INFLATED_TOTAL} bytes "
                    "in all (torch.save compresses none; many entries naming one deflate bomb multiply its cost)"
                )
            _INFLATED[0] += member.size
            inflater = zlib.decompressobj(-15)
            try:
                data = inflater.decompress(raw, member.size + 1)
            except zlib.error as exc:
                raise CkptError(f"{self.where}: corrupt storage record {name} ({exc})") from None
            if len(data) != member.size or inflater.unconsumed_tail:
                raise ArchiveError(
                    f"{self.where}: record {name} inflates to more than its declared {member.size} bytes"
                )
        if verify_crc:
            problem = self.crc_problem(name, data)
            if problem is not None:
                raise CorruptRecord(f"{self.where}: {problem}")
        return data

    def pickle(self, limits: PickleLimits | None = None, verify_crc: bool = True) -> Blob:
        """The archive's ``data.pkl``: up to the pickle size limit when stored, ``MAX_INFLATED_PICKLE`` when
        compressed (the one place that policy lives)."""
        name = f"{self.prefix}data.pkl"
        max_bytes = (limits or current_limits()).max_bytes
        return self.read(
            name, min(max_bytes, MAX_INFLATED_PICKLE) if self.members[name].method else max_bytes, verify_crc
        )

    def storage(self, key: str) -> Member:
        member = self.members.get(f"{self.prefix}data/{key}")
        if member is None:
            raise CkptError(f"{self.where}: storage record {key} missing from the archive")
        return member


def parse_archive(blob: Blob, where: str) -> TorchArchive:
    """Parse and validate a ``torch.save`` archive's directory. Raises :class:`ArchiveError` for anomalies
    (duplicates, several prefixes, unsafe names) and :class:`CkptError` for a damaged archive."""
    general = False
    try:
        entries = _central_directory(blob, where)
    except _NeedsZipfile:
        entries, general = _zipfile_directory(blob, where), True
    except (ValueError, struct.error) as exc:
        raise CkptError(f"{where}: not a readable torch.save file ({exc})") from None
    members: dict[str, Member] = {}
    folded: set[bytes] = set()  # torch (miniz) finds a member by its name in ASCII case-insensitively
    prefix: str | None = None
    for member in entries:
        name = member.name
        if name.encode().lower() in folded:
            raise ArchiveError(
                f"{where}: archive holds two members named {name!r} (ignoring case, as torch's lookup does: "
                "torch may read another member than ours)"
            )
        folded.add(name.encode().lower())
        if _unsafe_name(name):
            raise ArchiveError(f"{where}: archive member name {name!r} leaves the archive directory")
        head = name.split("/", 1)[0] + "/"
        if prefix is None:
            prefix = head
        elif head != prefix or "/" not in name:
            raise ArchiveError(
                f"{where}: archive members under more than one prefix ({prefix!r}, {head!r}); "
                "torch refuses such an archive"
            )
        if member.method not in (0, 8):
            raise CkptError(f"{where}: member {name} uses zip compression method {member.method}")
        if member.start + member.compressed_size > len(blob):
            raise CkptError(f"{where}: member {name} runs past the end of the archive")
        members[name] = member
    if prefix is None or f"{prefix}data.pkl" not in members:
        raise CkptError(f"{where}: not a torch.save archive (no data.pkl record)")
    return TorchArchive(blob, members, prefix, where, general)


def _unsafe_name(name: str) -> bool:
    parts = name.split("/")
    return (
        not name
        or name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or any(part in ("..", ".") for part in parts)
        or (len(name) > 1 and name[1] == ":")
    )


class _NeedsZipfile(Exception):
    """An archive feature the lean directory reader leaves to :mod:`zipfile` (zip64, a comment)."""


def _central_directory(blob: Blob, where: str) -> list[Member]:
    size = len(blob)
    if size < _EOCD.size:
        raise ValueError("too short for a zip archive")
    sig, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(blob, size - _EOCD.size)
    if sig != b"PK\x05\x06" or count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        raise _NeedsZipfile
    locator = size - _EOCD.size - _ZIP64_LOCATOR.size
    if locator >= 0 and bytes(blob[locator : locator + 4]) == b"PK\x06\x07":
        # torch's reader takes the directory from the zip64 end record the locator names whenever there is one
        # (torch.save always writes one): it must describe the directory read here
        record = _ZIP64_LOCATOR.unpack_from(blob, locator)[2]
        if record + _ZIP64_RECORD.size > locator:
            raise ValueError("zip64 end record past its locator")
        sig64, *_, count64, cd_size64, cd_offset64 = _ZIP64_RECORD.unpack_from(blob, record)
        if sig64 != b"PK\x06\x06":
            raise ValueError("bad zip64 end record")
        if (count64, cd_size64, cd_offset64) != (count, cd_size, cd_offset):
            raise ArchiveError(
                f"{where}: archive's zip64 end record names another central directory than its end record"
            )
    cd_end = cd_offset + cd_size
    if cd_end > size - _EOCD.size:
        raise ValueError("central directory lies past the end of the archive")
    out: list[Member] = []
    pos = cd_offset
    for _ in range(count):
        if pos + _CDIR.size > cd_end:
            raise ValueError("central directory is truncated")
        (sig, _, _, _, method, _, _, crc, compressed, plain, name_len, extra_len, comment_len, _, _, _, local) = (
            _CDIR.unpack_from(blob, pos)
        )
        if sig != b"PK\x01\x02":
            raise ValueError("bad central directory entry")
        if plain == 0xFFFFFFFF or compressed == 0xFFFFFFFF or local == 0xFFFFFFFF:
            raise _NeedsZipfile
        name_start = pos + _CDIR.size
        name = bytes(blob[name_start : name_start + name_len]).decode("utf-8", "replace")
        out.append(Member(name, _data_start(blob, local, cd_offset), plain, compressed, method, crc, pos + 16))
        pos = name_start + name_len + extra_len + comment_len
    if pos > cd_end:
        raise ValueError("central directory entries overrun the directory")
    return out


def _data_start(blob: Blob, local: int, limit: int) -> int:
    if local + _LOCAL.size > limit:
        raise ValueError("member header past the central directory")
    sig, _, _, _, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(blob, local)
    if sig != b"PK\x03\x04":
        raise ValueError("bad local header")
    return local + _LOCAL.size + name_len + extra_len


def _zipfile_directory(blob: Blob, where: str) -> list[Member]:
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:  # type: ignore[arg-type]
            infos = archive.infolist()
            _same_directory_as_torch(blob, archive, where)
            if len(infos) > 1 << 20:
                raise ArchiveError(f"{where}: archive lists {len(infos)} members")
            return [
                Member(
                    i.filename,
                    _data_start(blob, i.header_offset, len(blob)),
                    i.file_size,
                    i.compress_size,
                    i.compress_type,
                    i.CRC,
                )
                for i in infos
            ]
    except ArchiveError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, NotImplementedError, EOFError, KeyError, struct.error) as exc:
        raise CkptError(f"{where}: not a readable torch.save file ({exc})") from None


def _same_directory_as_torch(blob: Blob, archive: zipfile.ZipFile, where: str) -> None:
    """Refuse an archive whose central directory torch's reader (miniz) finds elsewhere than :mod:`zipfile`: miniz
    reads it at the offset the end record declares and the zip64 end record where the zip64 locator points;
    zipfile reads the zip64 record just before the locator, and a directory found elsewhere than declared it
    takes for data prepended to the archive (shifting every offset). Either way torch would load other members
    than the ones checked here."""
    endrec = zipfile._EndRecData(archive.fp)  # type: ignore[attr-defined]  # the end record zipfile used
    location, declared = endrec[zipfile._ECD_LOCATION], endrec[zipfile._ECD_OFFSET]  # type: ignore[attr-defined]
    locator = location - _ZIP64_LOCATOR.size
    if locator >= 0 and bytes(blob[locator : locator + 4]) == b"PK\x06\x07":
        record = _ZIP64_LOCATOR.unpack_from(blob, locator)[2]
        if record != locator - _ZIP64_RECORD.size:
            raise ArchiveError(f"{where}: archive's zip64 locator names a record torch reads and zipfile does not")
    if archive.start_dir != declared:
        raise ArchiveError(
            f"{where}: archive's central directory is not where its end record says "
            f"({archive.start_dir}, not {declared}): torch would read another one"
        )


def chunk_limits() -> PickleLimits:
    """The limits for a tensor chunk's ``data.pkl``: those in force, at most ``MAX_CHUNK_PICKLE`` bytes."""
    return _chunk_limits(current_limits())


@functools.lru_cache(maxsize=4)
def _chunk_limits(limits: PickleLimits) -> PickleLimits:
    return replace(limits, max_bytes=min(limits.max_bytes, MAX_CHUNK_PICKLE))


def storage_ref(pid: Any, where: str) -> StorageRef:
    """The storage a ``torch.save`` pickle's persistent id names, without its bytes: the one dtype policy of
    every reader (an untyped storage is bytes; a storage type we do not know is refused)."""
    place = f"{where}: " if where else ""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise CkptError(f"{place}unsupported persistent id {pid!r}")
    _, storage_type, key, location, numel = pid
    if not isinstance(storage_type, StorageTypeRef) or not isinstance(numel, int) or numel < 0:
        raise CkptError(f"{place}malformed storage reference {pid!r}")
    return StorageRef(str(key), storage_type.dtype or DtypeRef.get("uint8"), str(location), numel)


def _storage_ref_factory(archive: TorchArchive) -> Callable[[Any], StorageRef]:
    """``persistent_load`` for an archive's pickle: :func:`storage_ref`, bytes read from the archive on demand."""

    def persistent_load(pid: Any) -> StorageRef:
        ref = storage_ref(pid, archive.where)
        member = archive.storage(ref.key)
        expected = ref.numel * (ref.dtype.itemsize or 1) if ref.dtype else ref.numel

        def read() -> bytes:
            # A stored record is a slice of bytes already here; a compressed one may inflate to at most what
            # the tensor needs (and never past MAX_INFLATED): a deflate bomb is refused before it inflates.
            limit = max(expected, member.size) if member.method == 0 else min(expected, MAX_INFLATED)
            return bytes(archive.read(member.name, limit))

        return StorageRef(ref.key, ref.dtype, ref.location, ref.numel, read)

    return persistent_load


def load_archive(
    blob: Blob, where: str, limits: PickleLimits | None = None, unlisted: list[UnlistedGlobal] | None = None
) -> Any:
    """Unpickle a ``torch.save`` archive held in memory into plain objects and stand-ins.

    Tensors come back as :class:`~ckptdoctor.pickle.torch_stand_ins.TensorRef` whose bytes are read only on demand.
    ``where`` names the file (and item) in every error.
    """
    archive = parse_archive(blob, where)
    pickled = archive.pickle(limits)
    return unpickle(pickled, where, _storage_ref_factory(archive), limits, unlisted, "pickle in torch.save archive")


def unpickle(
    pickled: Blob | mmap.mmap,
    where: str,
    persistent_load: Callable[[Any], Any] | None = None,
    limits: PickleLimits | None = None,
    unlisted: list[UnlistedGlobal] | None = None,
    what: str = "pickle",
    index_only: bool = False,
) -> Any:
    """:func:`unpickler.loads` with every failure turned into an error naming ``where`` (and ``what``)."""
    try:
        return unpickler.loads(pickled, persistent_load, limits, unlisted, index_only)
    except (UnsafePickleError, PickleLimitError) as exc:
        raise exc.located(where) from None
    except CkptError:
        raise
    except Exception as exc:  # a corrupt pickle can raise almost anything; report it, never trace
        raise CkptError(f"{where}: corrupt {what} ({type(exc).__name__}: {exc})") from None
