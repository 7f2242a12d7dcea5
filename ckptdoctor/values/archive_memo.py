"""Archive layouts remembered across chunks: ``torch.save`` archives of equal tensors differ only in CRC-32s.

:func:`ckptdoctor.formats.archive.parse_archive` validates an archive's whole directory (about 250 us a chunk
here, most of a TP=64 diff's decoding). Chunks of one shape and dtype are archives whose directories are
byte-identical except the CRC-32 fields. The first archive of each length is parsed and validated in full; its
layout (where ``data.pkl`` and the storage records start) is reused for a later archive of that length only when
its central directory and end record, CRC fields masked, are byte-identical to the first one's, and so are the
local headers of the members read (CRC masked). Anything else takes the full parse. Only stored (uncompressed)
archives that the lean directory reader handles are remembered.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptdoctor.formats.archive import Blob, TorchArchive

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record (22 bytes)
_CDIR = struct.Struct("<4s6H3L5H2L")  # central directory file header (46 bytes)
_CDIR_CRC = 16  # offset of the CRC-32 in a central directory header
_LOCAL_CRC = 14  # offset of the CRC-32 in a local file header
_NO_CRC = b"\0\0\0\0"
_MAX_LAYOUTS = 1024


@dataclass(frozen=True)
class Layout:
    cd_offset: int
    tail: bytes  # the archive from its central directory to the end, CRC fields zeroed
    crcs: tuple[int, ...]  # where the CRC fields are in ``tail``
    headers: tuple[tuple[int, bytes], ...]  # (offset, local header + name + extra, CRC zeroed) of members read
    pkl: tuple[int, int]  # data.pkl (start, size)
    records: dict[str, tuple[int, int]]  # storage key -> (start, size)


_LAYOUTS: dict[int, Layout] = {}


def _masked(data: Blob, offsets: tuple[int, ...]) -> bytearray:
    out = bytearray(data)
    for offset in offsets:
        out[offset : offset + 4] = _NO_CRC
    return out


def lookup(blob: Blob) -> Layout | None:
    """The remembered layout of an archive of this length, if ``blob``'s directory matches it (see above)."""
    layout = _LAYOUTS.get(len(blob))
    if layout is None or _masked(blob[layout.cd_offset :], layout.crcs) != layout.tail:
        return None
    for offset, header in layout.headers:
        if _masked(blob[offset : offset + len(header)], (_LOCAL_CRC,)) != header:
            return None
    return layout


def remember(blob: Blob, archive: TorchArchive) -> None:
    """Keep the layout of ``archive`` (parsed and validated from ``blob``) for later archives of its length."""
    if archive.general or len(_LAYOUTS) >= _MAX_LAYOUTS or any(m.method for m in archive.members.values()):
        return
    size = len(blob)
    _, _, _, _, count, _, cd_offset, _ = _EOCD.unpack_from(blob, size - _EOCD.size)
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
    pkl = archive.members[f"{prefix}data.pkl"]
    data = f"{prefix}data/"
    records = {name[len(data) :]: (m.start, m.size) for name, m in archive.members.items() if name.startswith(data)}
    read = [f"{prefix}data.pkl", *(f"{data}{key}" for key in records)]
    headers = tuple(
        (local_of[name], bytes(_masked(blob[local_of[name] : archive.members[name].start], (_LOCAL_CRC,))))
        for name in read
    )
    _LAYOUTS[size] = Layout(
        cd_offset, bytes(_masked(blob[cd_offset:], tuple(crcs))), tuple(crcs), headers, (pkl.start, pkl.size), records
    )
