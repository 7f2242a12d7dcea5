"""Archive layouts remembered across chunks: ``torch.save`` archives of equal tensors differ only in CRC-32s.

:func:`ckptdoctor.formats.archive.parse_archive` validates an archive's whole directory (about 250 us a chunk
here, most of a TP=64 diff's decoding). Chunks of one shape and dtype are archives whose directories are
byte-identical except the CRC-32 fields. The first archive of each length is parsed and validated in full; its
layout (where ``data.pkl`` and the storage records start) is reused for a later archive of that length only when
its central directory and end record, CRC fields masked, are byte-identical to the first one's, and so are the
local headers of all its members (CRC masked). Everything :func:`parse_archive` checks lies in those bytes and
the archive's length, so such an archive passes the same checks with the same members (CRC-32s aside): the
reuse is a full validation, not a shortcut (``check --deep`` relies on it, :func:`parse`); each archive's own CRC-32s
are read where its first one's lie. Anything else takes
the full parse. Only stored (uncompressed) archives that the lean directory reader handles are remembered.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ckptdoctor.formats.archive import Blob, Member, TorchArchive, chunk_limits, parse_archive

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record (22 bytes)
_CDIR = struct.Struct("<4s6H3L5H2L")  # central directory file header (46 bytes)
_CDIR_CRC = 16  # offset of the CRC-32 in a central directory header
_LOCAL_CRC = 14  # offset of the CRC-32 in a local file header
_NO_CRC = b"\0\0\0\0"
_MAX_LAYOUTS = 1024
_PER_LENGTH = 8  # layouts kept per archive length (chunks of other shapes can pickle to other data.pkl sizes)


@dataclass(frozen=True)
class Layout:
    headers: tuple[tuple[int, bytes], ...]  # (offset, local header + name + extra, CRC zeroed) of every member
    records: dict[str, tuple[int, int]]  # storage key -> (start, size)
    members: dict[str, Member]  # the first archive's members (their ``crc`` is the first archive's)
    prefix: str
    spans: tuple[tuple[int, int], ...]  # (start, end) of every directory byte but the CRC fields, in order
    skeleton: bytes  # those bytes joined
    pickle: tuple[int, int] = (0, 0)  # (start, size) of data.pkl (stored)
    byteorder: tuple[int, int] | None = None  # (start, size) of the byteorder record, if any (data: checked each time)

    def matches(self, blob: Blob) -> bool:
        """Whether ``blob`` (of this layout's length) has these directory bytes: one join of ~20 slices and one
        compare (~3 us), where a full parse costs ~20-40 us."""
        view = memoryview(blob)
        try:
            return b"".join([view[a:b] for a, b in self.spans]) == self.skeleton
        finally:
            view.release()


_LAYOUTS: dict[int, list[Layout]] = {}  # archive length -> layouts of that length
_COUNT = [0]


def _masked(data: Blob, offsets: tuple[int, ...]) -> bytearray:
    out = bytearray(data)
    for offset in offsets:
        out[offset : offset + 4] = _NO_CRC
    return out


def lookup(blob: Blob) -> Layout | None:
    """The remembered layout of an archive of this length, if ``blob``'s directory matches it (see above)."""
    for layout in _LAYOUTS.get(len(blob), ()):
        if layout.matches(blob):
            return layout
    return None


def _spans(size: int, cd_offset: int, crcs: list[int], headers: tuple[tuple[int, bytes], ...]) -> list[tuple[int, int]]:
    """The archive's directory bytes as (start, end) spans in file order, CRC fields left out."""
    skip = sorted([offset + _LOCAL_CRC for offset, _ in headers] + [cd_offset + c for c in crcs])
    starts = sorted([(offset, offset + len(h)) for offset, h in headers] + [(cd_offset, size)])
    spans: list[tuple[int, int]] = []
    for start, end in starts:
        at = start
        for crc in skip:
            if start <= crc < end:
                spans.append((at, crc))
                at = crc + 4
        spans.append((at, end))
    return [(a, b) for a, b in spans if b > a]


def remember(blob: Blob, archive: TorchArchive) -> None:
    """Keep the layout of ``archive`` (parsed and validated from ``blob``) for later archives of its length."""
    size = len(blob)
    known = _LAYOUTS.get(size, [])
    if archive.general or _COUNT[0] >= _MAX_LAYOUTS or len(known) >= _PER_LENGTH:
        return
    if any(m.method for m in archive.members.values()):
        return
    _, _, _, _, count, _, cd_offset, _ = _EOCD.unpack_from(blob, size - _EOCD.size)
    locator = size - _EOCD.size - 20
    zip64 = locator >= 0 and bytes(blob[locator : locator + 4]) == b"PK\x06\x07"
    if zip64 and struct.unpack_from("<Q", blob, locator + 8)[0] < cd_offset:
        return  # its zip64 end record (which torch reads) lies outside the bytes a match compares
    crcs, local_of = [], {}
    pos = cd_offset
    for _ in range(count):
        fields = _CDIR.unpack_from(blob, pos)
        name_len, extra_len, comment_len, local = fields[10], fields[11], fields[12], fields[16]
        name = bytes(blob[pos + _CDIR.size : pos + _CDIR.size + name_len]).decode("utf-8", "replace")
        crcs.append(pos - cd_offset + _CDIR_CRC)
        local_of[name] = local
        pos += _CDIR.size + name_len + extra_len + comment_len
    prefix = archive.prefix
    pkl = archive.members.get(f"{prefix}data.pkl")
    if pkl is None or pkl.name not in local_of:
        return
    data = f"{prefix}data/"
    records = {name[len(data) :]: (m.start, m.size) for name, m in archive.members.items() if name.startswith(data)}
    read = [f"{prefix}data.pkl", *(f"{data}{key}" for key in records)]
    every = read + [name for name in archive.members if name not in read]
    headers = tuple(
        (local_of[name], bytes(_masked(blob[local_of[name] : archive.members[name].start], (_LOCAL_CRC,))))
        for name in every
    )
    spans = _spans(size, cd_offset, crcs, headers)
    skeleton = b"".join(bytes(blob[a:b]) for a, b in spans)
    order = archive.members.get(f"{prefix}byteorder")
    layout = Layout(
        headers,
        records,
        dict(archive.members),
        prefix,
        tuple(spans),
        skeleton,
        (pkl.start, pkl.size),
        None if order is None else (order.start, order.compressed_size),
    )
    _LAYOUTS[size] = [*known, layout]
    _COUNT[0] += 1


def plain_pickle(blob: Blob) -> tuple[Layout, bytes] | None:
    """(layout, ``data.pkl`` bytes) of an archive whose directory matches a remembered layout and whose byteorder
    record (data, so checked for every archive, as :class:`TorchArchive` does) says little-endian; None otherwise
    (the caller then takes :func:`parse`, which reports what is wrong). With the ``data.pkl`` bytes, the chunk's
    sizes and dtype, the layout decides everything a decode of this archive checks: callers remember their
    verdict per (layout, pickle, ...) and skip the archive object (a few us a chunk)."""
    layout = lookup(blob)
    if layout is None:
        return None
    if layout.byteorder is not None:
        start, size = layout.byteorder
        if blob[start : start + size] != b"little":
            return None
    start, size = layout.pickle
    return layout, bytes(blob[start : start + size])


def plain_key(blob: Blob, sizes: tuple, dtype: str | None) -> tuple | None:
    """The key under which a decode of this chunk archive can be remembered and reused: (layout, ``data.pkl``,
    sizes, dtype, pickle limit), everything such an answer depends on; None where :func:`plain_pickle` is None.
    (A layout is never forgotten, so its id names it for the life of the process.)"""
    found = plain_pickle(blob)
    if found is None:
        return None
    return (id(found[0]), found[1], sizes, dtype, chunk_limits().max_bytes)


def parse(blob: Blob, where: str) -> TorchArchive:
    """:func:`~ckptdoctor.formats.archive.parse_archive` of ``blob``, from a remembered layout when the archive's
    directory and local headers match it (the same checks pass: see the module doc), else in full (and
    remembered). Raises what ``parse_archive`` raises."""
    layout = lookup(blob)
    if layout is not None:
        # the first archive's members: where each record and CRC-32 lies is this archive's too (its CRC-32s are read
        # from there, TorchArchive.stored_crc)
        return TorchArchive(blob, layout.members, layout.prefix, where, False)
    archive = parse_archive(blob, where)
    remember(blob, archive)
    return archive
