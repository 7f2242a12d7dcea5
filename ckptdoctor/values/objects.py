"""``diff --values`` of bytes items (ShardedObjects: rng state, ``_extra_state``, rerun state): compared by the
sha256 of their raw bytes; when the bytes differ, both are decoded (safe unpickler) and compared as objects,
because torch.save archives of equal objects can differ in serialization details. Objects that differ are
compared field by field (:func:`ckptdoctor.pickle.paths.diff_fields`): the report names the differing paths.
A Transformer Engine ``_extra_state`` item is compared as TE's state (:func:`ckptdoctor.formats.te_extra_state.
comparable`: form, generation, recipe and its fields, tensor shapes and bytes), not as its pickle."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.te_extra_state import comparable, is_extra_state_key
from ckptdoctor.pickle.paths import FieldChange, diff_fields, join
from ckptdoctor.pickle.plain import to_plain
from ckptdoctor.values.io import Context
from ckptdoctor.values.report import ValueDiff

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint
    from ckptdoctor.logical_items import Item


FIELDS_KEPT = 1000  # differing fields a worker sends back per key (the report lists at most the diff's limit)


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
    fields: list[FieldChange] = []
    for suffix in differing:
        key_a, key_b = ia.entries[suffix].key, ib.entries[suffix].key
        try:
            if is_extra_state_key(key_a):  # Transformer Engine's state, decoded: recipe, fields, tensor bytes
                value_a = comparable(a.bytes_item_data(key_a)[0], f"{a.iteration_dir}: item {key_a}")
                value_b = comparable(b.bytes_item_data(key_b)[0], f"{b.iteration_dir}: item {key_b}")
            else:
                value_a, value_b = a.read_bytes_item(key_a), b.read_bytes_item(key_b)
        except CkptError as exc:  # refused by the gate or damaged (an ArchiveError is one too)
            decoded_equal, reason = False, f"cannot decode to compare objects: {exc}"
            break
        if value_a != value_b:
            decoded_equal = False
            # the differing fields by path under the key (and the shard, where there are several)
            prefix = ia.key if len(hashes) == 1 else join(ia.key, suffix)
            found = diff_fields(value_a, value_b, prefix)
            fields += found.changes
            if not found.complete:
                reason = "walk stopped at its node or depth limit: there may be more differing fields"
    n = len(differing)
    what = f"{n} of {len(hashes)} shard{'s' if len(hashes) != 1 else ''}"
    if decoded_equal:
        note = f"serialized bytes differ in {what}, decoded objects are equal"
    else:
        note = f"bytes and decoded objects differ in {what}"
        if reason:
            note = f"{note}; {reason}" if fields else reason
    result = ValueDiff(ia.key, ia.section, ia.kind, decoded_equal, None, None, None, note, *single)
    if fields:
        # plain values: a worker process sends its results back pickled, and stand-ins are this process's classes
        kept = fields[:FIELDS_KEPT]
        result.fields = [FieldChange(f.path, f.change, to_plain(f.a), to_plain(f.b)) for f in kept]
        result.fields_count = len(fields)
    return result
