"""Logical items of a checkpoint (``diff``, ``inspect``): tensors by key, ShardedObjects by their base key.

A Megatron ShardedObject is saved as one DCP bytes item per shard, keyed
``<key>/shard_<offsets joined by .>_<global shape joined by .>`` (``rng_state/shard_0.1_1.2``). The shard
suffix encodes the object's sharding, which follows the parallel layout: the same ``rng_state`` is
``shard_0.0_1.1`` at TP=1 and ``shard_0.0_1.2`` + ``shard_0.1_1.2`` at TP=2. Comparing raw DCP keys would call
that a content difference; grouping shards under their base key makes it a layout difference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptdoctor.checkpoint import COMMON_STATE_PREFIX, Checkpoint, Entry

_SHARD_RE = re.compile(r"^(?P<base>.+)/shard_(?P<offsets>\d+(?:\.\d+)*)_(?P<shape>\d+(?:\.\d+)*)$")


def logical_key(entry_key: str, kind: str) -> str:
    """The logical key of a DCP entry: a tensor's own key, a ShardedObject shard's base key (the one definition of
    "key" that inspect and diff count; an entry is one DCP item, a shard of an object or a tensor)."""
    if kind == "tensor":
        return entry_key
    match = _SHARD_RE.match(entry_key)
    return entry_key if match is None else match.group("base")


KIND_TENSOR = "tensor"
KIND_OBJECT = "object"  # a ShardedObject: one or more bytes shards
KIND_BYTES = "bytes"  # a bytes item without a shard suffix


@dataclass(slots=True)
class Item:
    """One logical key: a tensor (one DCP entry) or a sharded object (its shard entries by suffix)."""

    key: str
    section: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None  # tensor: global shape; object: the shard grid's global shape
    # tensor/bytes: the one entry; object: shard suffix -> entry. Not a dict for one entry: diff holds an item per
    # key of each side, and a one-entry dict is ~200 bytes (80 MB at 200k keys)
    contents: Entry | dict[str, Entry]

    @property
    def entries(self) -> dict[str, Entry]:
        """Tensor/bytes: ``{"": entry}``; object: the shard entries by suffix (the item's own dict)."""
        contents = self.contents
        return contents if isinstance(contents, dict) else {"": contents}

    @property
    def entry(self) -> Entry:
        contents = self.contents
        return next(iter(contents.values())) if isinstance(contents, dict) else contents

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def grid(self) -> tuple:
        """What the parallel layout decides: tensor chunk boxes, or object shard suffixes."""
        if self.kind == KIND_TENSOR:
            return tuple(sorted((c.offsets, c.sizes) for c in self.entry.chunks))
        return tuple(sorted(self.entries))

    def same_grid(self, other: Item) -> bool:
        """Same chunk boxes (in any order; the common case, same order, needs no sort)."""
        if self.kind == KIND_TENSOR and other.kind == KIND_TENSOR:
            mine, theirs = self.entry.chunks, other.entry.chunks
            if len(mine) != len(theirs):
                return False
            if all(x.offsets == y.offsets and x.sizes == y.sizes for x, y in zip(mine, theirs)):
                return True
        return self.grid() == other.grid()

    def grid_summary(self) -> str:
        if self.kind == KIND_TENSOR:
            chunks = self.entry.chunks
            sizes = {c.sizes for c in chunks}
            shown = f" of {list(next(iter(sizes)))}" if len(sizes) == 1 else ""
            return f"{len(chunks)} chunk{'s' if len(chunks) != 1 else ''}{shown}"
        n = len(self.entries)
        shape = "" if self.shape is None else f" of {list(self.shape)}"
        return f"{n} shard{'s' if n != 1 else ''}{shape}"


def logical_items(checkpoint: Checkpoint) -> dict[str, Item]:
    """The checkpoint's items keyed by logical key (ShardedObject shards grouped under their base key)."""
    items: dict[str, Item] = {}
    for key, entry in checkpoint.entries.items():
        if entry.kind == "tensor":
            items[key] = Item(key, entry.section, KIND_TENSOR, entry.dtype, entry.shape, entry)
            continue
        match = _SHARD_RE.match(key)
        if match is None:
            items[key] = Item(key, entry.section, KIND_BYTES, entry.dtype, entry.shape, entry)
            continue
        base = match.group("base")
        shape = tuple(int(s) for s in match.group("shape").split("."))
        suffix = key[len(base) + 1 :]
        item = items.get(base)
        if item is None or item.kind != KIND_OBJECT:
            item = items[base] = Item(base, entry.section, KIND_OBJECT, None, shape, {})
        elif item.shape != shape:
            item.shape = None  # inconsistent shard grids: show no single global shape
        item.entries[suffix] = entry
    return items


def is_common_state_item(key: str) -> bool:
    """The core >= 0.19 common-state item (``common_state/shard_0_1``, grouped as ``common_state``)."""
    return key == COMMON_STATE_PREFIX or key.startswith(COMMON_STATE_PREFIX + "/")
