"""The parallel layout a checkpoint was saved with, inferred from its chunk grids and writer ranks.

* Transformer layers are stacked: model keys under ``*.layers.`` (no layer index after it) have a
  prepended layer axis, and Megatron writes one chunk per layer along it. Heterogeneous stacks are keyed
  per layer (``decoder.layers.3.``). Only ranks of a layer's pipeline stage write its chunks, so the
  pipeline stages are the groups of layers connected by shared writer ranks (``__<rank>_<n>.distcp``);
  virtual stages of one rank fall into its group.
* Tensor parallelism cuts the non-layer axes into chunks. SwiGLU's ``linear_fc1`` (and its adapters)
  hold ``cat([W, V])`` cut into 2*TP chunks (2 even at TP=1), so they decide TP only when nothing else
  is split.
* Expert tensors ``[L, E, ...]`` hold one chunk per expert; only the ranks of an expert's EP rank (and its
  expert-data-parallel replicas) write it, so EP is the number of groups of experts joined by writer ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptdoctor.formats import BACKEND_DCP
from ckptdoctor.formats.dcp_index import CHUNK_STORAGE, STORAGE_PATH
from ckptdoctor.formats.torch_dist import writer_rank
from ckptdoctor.shard_grid import ShardGrid, shard_grid

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint, Entry

_STACKED_LAYER_RE = re.compile(r"(^|\.)layers\.(?!\d)")
_INDEXED_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_LOCAL_EXPERT_RE = re.compile(r"(?:^|\.)local_experts\.(\d+)\.")
_SWIGLU_FC1_RE = re.compile(r"(^|\.)linear_fc1\.(.+\.)?(weight|bias)$")


@dataclass
class SavedLayout:
    tp: int | None  # tensor-parallel degree shown by chunk grids (1 when nothing is split)
    pp: int | None  # pipeline stages (groups of layers with disjoint writer ranks); None if unknown
    layers: int | None  # transformer layers seen (stacked axis length or per-layer keys)
    ep: int | None  # expert-parallel degree shown by expert tensors; None without experts
    writer_ranks: list[int]  # ranks that wrote data files (from __<rank>_<n>.distcp names)
    sharding: ShardGrid | None = None  # plain DCP: the chunk grid's sharding (its TP/PP/EP are not Megatron's)

    def as_dict(self) -> dict[str, Any]:
        """The layout as reports show it (inspect and diff JSON): each degree, the writer ranks, the summary."""
        shown: dict[str, Any] = {
            "tp": self.tp,
            "pp": self.pp,
            "layers": self.layers,
            "ep": self.ep,
            "writer_ranks": self.writer_ranks,
            "summary": self.summary(),
        }
        if self.sharding is not None:
            shown["sharding"] = self.sharding.as_dict()
        return shown

    def summary(self) -> str:
        def show(value: int | None) -> str:
            return "?" if value is None else str(value)

        n = len(self.writer_ranks)
        if self.sharding is not None:
            return self.sharding.summary()
        if not n and self.pp is None:  # zarr: chunk files named by their index, not by the rank that wrote them
            parts = [f"TP={show(self.tp)}"] + ([f"EP={self.ep}"] if self.ep is not None else [])
            return " ".join(parts) + " (PP not known: no data file names the rank that wrote it)"
        parts = [f"TP={show(self.tp)}", f"PP={show(self.pp)}"]
        if self.ep is not None:
            parts.append(f"EP={self.ep}")
        parts.append(f"({n} writer{'s' if n != 1 else ''})")
        return " ".join(parts)


def is_stacked_layer_key(key: str) -> bool:
    return bool(_STACKED_LAYER_RE.search(key))


def is_expert_key(key: str) -> bool:
    return ".experts." in key


def _distinct_offsets(entry: Entry, axis: int) -> int:
    return len({c.offsets[axis] for c in entry.chunks if len(c.offsets) > axis})


def _count_groups(layer_ranks: dict[int, set[int]]) -> int:
    """Connected groups of layers, two layers joined when a rank wrote chunks of both."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[int, int] = {}
    for layer, ranks in layer_ranks.items():
        find(layer)
        for rank in ranks:
            if rank in owner:
                parent[find(layer)] = find(owner[rank])
            else:
                owner[rank] = layer
    return len({find(layer) for layer in layer_ranks})


class _WriterRanks(dict[str, "int | None"]):
    """Data file -> writer rank (``writer_rank``), each file name parsed once: a checkpoint has a few hundred
    files and up to millions of chunks."""

    def __missing__(self, relative_path: str) -> int | None:
        rank = self[relative_path] = writer_rank(relative_path)
        return rank


def _chunk_ranks(entry: Entry, rank_of: _WriterRanks) -> set[int | None]:
    """The writer ranks of an entry's chunks (None for a chunk without storage or of an unnamed file).
    map/filter at C speed: this runs over every chunk (10^6 in a large checkpoint)."""
    stored = list(filter(None, map(CHUNK_STORAGE, entry.chunks)))
    ranks: set[int | None] = set(map(rank_of.__getitem__, map(STORAGE_PATH, stored)))
    if len(stored) < len(entry.chunks):  # a chunk without storage
        ranks.add(None)
    return ranks


def _add_ranks(index: dict[int, set[int]], at: int, ranks: set[int | None]) -> None:
    known = index.setdefault(at, set())
    known.update(ranks)  # type: ignore[arg-type]  # None is taken out below (it never belongs)
    known.discard(None)  # type: ignore[arg-type]


def _collect_expert_ranks(
    entry: Entry, stacked: bool, expert_ranks: dict[int, set[int]], rank_of: _WriterRanks
) -> None:
    """Expert index -> writer ranks, from ``local_experts.<e>.`` keys or the expert axis of the chunks."""
    named = _LOCAL_EXPERT_RE.search(entry.key)
    if named:  # one expert for every chunk of the key
        if entry.chunks:
            _add_ranks(expert_ranks, int(named.group(1)), _chunk_ranks(entry, rank_of))
        return
    axis = 1 if stacked else 0
    for chunk in entry.chunks:
        if len(chunk.offsets) > axis:
            rank = rank_of[chunk.storage.relative_path] if chunk.storage else None
            for expert in range(chunk.offsets[axis], chunk.offsets[axis] + chunk.sizes[axis]):
                _add_ranks(expert_ranks, expert, {rank})


def infer_layout(checkpoint: Checkpoint) -> SavedLayout:
    if checkpoint.location.backend == BACKEND_DCP:  # no Megatron layout: DTensor shards over one mesh
        grid = shard_grid(checkpoint)
        ranks = sorted({r for name in checkpoint.data_files if (r := writer_rank(name)) is not None})
        return SavedLayout(tp=None, pp=None, layers=None, ep=None, writer_ranks=ranks, sharding=grid)
    split_counts: list[int] = []
    fc1_counts: list[int] = []
    layer_ranks: dict[int, set[int]] = {}
    expert_ranks: dict[int, set[int]] = {}
    ranks_known = True
    rank_of = _WriterRanks()
    for entry in checkpoint.section_entries("model"):
        if entry.kind != "tensor" or not entry.shape or entry.misranked_chunk() is not None:
            continue  # a chunk of another rank than its tensor tells nothing of the layout (check: CKD coverage)
        stacked = is_stacked_layer_key(entry.key)
        indexed = None if stacked else _INDEXED_LAYER_RE.search(entry.key)
        if stacked:
            for chunk in entry.chunks:
                rank = rank_of[chunk.storage.relative_path] if chunk.storage else None
                ranks_known = ranks_known and rank is not None
                for layer in range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]):
                    _add_ranks(layer_ranks, layer, {rank})
        elif indexed and entry.chunks:  # one layer for every chunk of the key
            chunk_ranks = _chunk_ranks(entry, rank_of)
            ranks_known = ranks_known and None not in chunk_ranks
            _add_ranks(layer_ranks, int(indexed.group(1)), chunk_ranks)
        first_split_axis = 1 if stacked else 0
        if is_expert_key(entry.key):
            _collect_expert_ranks(entry, stacked, expert_ranks, rank_of)
            continue
        split = max((_distinct_offsets(entry, a) for a in range(first_split_axis, len(entry.shape))), default=1)
        (fc1_counts if _SWIGLU_FC1_RE.search(entry.key) else split_counts).append(split)
    ranks = sorted({r for name in checkpoint.data_files if (r := rank_of[name]) is not None})
    if any(c > 1 for c in split_counts):
        tp: int | None = min(c for c in split_counts if c > 1)
    elif split_counts:
        # Nothing but fc1 split: TP=1 with SwiGLU (2 chunks) or fc1 alone cut TP ways.
        tp = 1 if all(c <= 2 for c in fc1_counts) else min(fc1_counts) // 2
    else:
        tp = None
    pp = _count_groups(layer_ranks) if layer_ranks and ranks_known else None
    ep = _count_groups(expert_ranks) if expert_ranks and ranks_known else None
    return SavedLayout(tp=tp, pp=pp, layers=len(layer_ranks) or None, ep=ep, writer_ranks=ranks)
