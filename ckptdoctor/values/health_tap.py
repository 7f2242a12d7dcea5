"""``diff --values --stats`` in one read: ``check --health``'s statistics of the chunks a value comparison reads.

The value comparison reads every chunk of the tensor keys in both checkpoints; :class:`HealthTap` is handed each
chunk's bytes as they arrive (:func:`ckptdoctor.values.tensor` and the single-chunk fast path of
:mod:`ckptdoctor.values.diff`) and feeds its elements to one :class:`~ckptdoctor.values.health.HealthScan` per
side, each chunk once (a chunk read again after the cache let it go is not counted twice). The statistics are
exact and order independent, so they equal those of ``check --health``'s own pass. A chunk that is not a plain
stored record (:func:`~ckptdoctor.values.read.chunk_bits` answers None: a zarr chunk, a strided view) marks its
side ``missed``: the caller then reads that side again with ``check --health``'s pass.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from ckptdoctor.values.health import HealthScan, crowded_keys
from ckptdoctor.values.read import chunk_bits

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint, Entry
    from ckptdoctor.formats.torch_dist import DcpChunk

SIDES = ("a", "b")


class HealthTap:
    """Per side ("a", "b"): the statistics of the chunks fed to :meth:`add`, and whether one could not be read
    as plain bits (``missed``). Plain data, pickled back from a worker and merged with :meth:`merge`."""

    def __init__(self) -> None:
        self.scans = {side: HealthScan() for side in SIDES}
        self.missed = dict.fromkeys(SIDES, False)
        self._seen: set[tuple[str, str, tuple[int, ...]]] = set()
        self._planned: set[str] = set()  # the sides whose scan has its checkpoint's crowded keys

    def add(self, side: str, checkpoint: Checkpoint, entry: Entry, chunk: DcpChunk, blob: Any) -> None:
        """One chunk's bytes (its storage range) as read for side ``side``."""
        seen = (side, entry.key, tuple(chunk.offsets))
        if seen in self._seen or self.missed[side]:
            return
        self._seen.add(seen)
        if side not in self._planned:  # check --health's plan for the side's checkpoint (crowded_keys)
            self._planned.add(side)
            entries = checkpoint.entries.values()
            self.scans[side].crowded = crowded_keys((item.key, item.dtype, item.shape) for item in entries)
        bits = chunk_bits(checkpoint, entry, chunk, blob)
        if bits is None:
            self.missed[side] = True
            return
        self.scans[side].scan(entry.key, entry.dtype, entry.shape, tuple(chunk.offsets), tuple(chunk.sizes), bits)

    def add_twin(self, checkpoint: Checkpoint, entry: Entry, chunk: DcpChunk, blob: Any) -> None:
        """A key held whole by one chunk of the same bytes on both sides: measured once, counted for both."""
        self.add("a", checkpoint, entry, chunk, blob)
        measured = self.scans["a"].keys.get(entry.key)
        if measured is None:  # not plain bits (or side a already missed): side b is read again too
            self.missed["b"] = True
        elif entry.key not in self.scans["b"].keys:
            self.scans["b"].keys[entry.key] = copy.deepcopy(measured)
            self._seen.add(("b", entry.key, tuple(chunk.offsets)))

    def merge(self, other: HealthTap) -> None:
        for side in SIDES:
            self.scans[side].merge(other.scans[side])
            self.missed[side] = self.missed[side] or other.missed[side]

    def __getstate__(self) -> dict:
        return {"scans": self.scans, "missed": self.missed, "_seen": set(), "_planned": set()}  # what a merge needs
