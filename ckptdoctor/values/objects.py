"""``diff --values`` of bytes items (ShardedObjects: rng state, ``_extra_state``, rerun state): compared by the
sha256 of their raw bytes; when the bytes differ, both are decoded (safe unpickler) and compared as objects,
because torch.save archives of equal objects can differ in serialization details."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from ckptdoctor.errors import CkptError
from ckptdoctor.values.io import Context
from ckptdoctor.values.report import ValueDiff

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint
    from ckptdoctor.logical_items import Item


def compare_objects(a: Checkpoint, ia: Item, b: Checkpoint, ib: Item, ctx: Context) -> ValueDiff:
    if sorted(ia.entries) != sorted(ib.entries):
        return ValueDiff(
            ia.key,
            ia.section,
            ia.kind,
            None,
            None,
            None,
            None,
            f"sharded differently (A: {ia.grid_summary()}, B: {ib.grid_summary()}): layout, values not compared",
        )
    hashes: dict[str, tuple[str, str]] = {}
    differing: list[str] = []
    for suffix in sorted(ia.entries):
        digests = []
        for side, ckpt, item in (("a", a, ia), ("b", b, ib)):
            location = item.entries[suffix].chunks[0].storage if item.entries[suffix].chunks else None
            if location is None:
                raise CkptError(f"{ckpt.iteration_dir}: item {item.entries[suffix].key}: no storage entry")
            entry = item.entries[suffix]
            # small items: not counted against the in-flight cap
            data = ctx.files.read(ckpt, location, entry.max_range_bytes(entry.chunks[0]))
            ctx.read.add(side, len(data))
            digests.append(hashlib.sha256(data).hexdigest())
        hashes[suffix] = (digests[0], digests[1])
        if digests[0] != digests[1]:
            differing.append(suffix)
    single = hashes[next(iter(hashes))] if len(hashes) == 1 else (None, None)
    if not differing:
        return ValueDiff(ia.key, ia.section, ia.kind, True, None, None, None, None, *single)
    decoded_equal = True
    reason = None
    for suffix in differing:
        key_a, key_b = ia.entries[suffix].key, ib.entries[suffix].key
        try:
            if a.read_bytes_item(key_a) != b.read_bytes_item(key_b):
                decoded_equal = False
                break
        except CkptError as exc:
            decoded_equal, reason = False, f"cannot decode to compare objects: {exc}"
            break
    n = len(differing)
    what = f"{n} of {len(hashes)} shard{'s' if len(hashes) != 1 else ''}"
    if decoded_equal:
        note = f"serialized bytes differ in {what}, decoded objects are equal"
    else:
        note = reason or f"bytes and decoded objects differ in {what}"
    return ValueDiff(ia.key, ia.section, ia.kind, decoded_equal, None, None, None, note, *single)
