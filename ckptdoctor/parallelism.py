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
from typing import TYPE_CHECKING, Any, cast

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
# Tensors Megatron never splits by tensor parallelism (norms, the router, the biases added after a row-parallel
# linear, learned positions): one whole copy per rank, which DCP saves once from whichever rank it balances the write
# to. They show neither the TP degree (a save keeping only them, a strip-frozen output or a PEFT base-free save,
# would read as TP=1) nor a stage's ranks (each layer's copy from another rank: two "stages" at PP=1).
_REPLICATED_RE = re.compile(
    r"(?:layernorm|layer_norm|norm)(?:_weight|_bias|\.weight|\.bias)$"
    r"|(?:^|\.)router\.(?:weight|expert_bias)$|(?:^|\.)linear_(?:proj|fc2)\.bias$|position_embeddings\.weight$"
)


@dataclass
class SavedLayout:
    tp: int | None  # tensor-parallel degree shown by chunk grids (1 when nothing is split)
    pp: int | None  # pipeline stages (groups of layers with disjoint writer ranks); None if unknown
    layers: int | None  # transformer layers seen (stacked axis length or per-layer keys)
    ep: int | None  # expert-parallel degree shown by expert tensors; None without experts
    writer_ranks: list[int]  # ranks that wrote data files (from __<rank>_<n>.distcp names)
    sharding: ShardGrid | None = None  # plain DCP: the chunk grid's sharding (its TP/PP/EP are not Megatron's)
    etp: int | None = None  # expert-tensor-parallel degree: how expert tensors are cut within an expert

    def as_dict(self) -> dict[str, Any]:
        """The layout as reports show it (inspect and diff JSON): each degree, the writer ranks, the summary."""
        shown: dict[str, Any] = {
            "tp": self.tp,
            "pp": self.pp,
            "layers": self.layers,
            "ep": self.ep,
            "etp": self.etp,
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
        if self.etp is not None and self.etp != self.tp:  # Megatron's default ETP is TP: shown where it differs
            parts.append(f"ETP={self.etp}")
        parts.append(f"({n} writer{'s' if n != 1 else ''})")
        return " ".join(parts)


def same_layout(a: SavedLayout, b: SavedLayout) -> bool:
    """The same parallel layout: TP, PP (where both are known: a zarr save's data files do not tell it), EP, ETP and a
    plain DCP's sharding. Not the number of ranks that wrote data files: data-parallel replicas add writers, not
    another layout (``diff`` said "layout differs" for a save at DP=2 with every key chunked alike)."""
    pp_known = a.pp is not None and b.pp is not None
    sharding = (a.sharding.summary() if a.sharding else None, b.sharding.summary() if b.sharding else None)
    return (
        a.tp == b.tp
        and (not pp_known or a.pp == b.pp)
        and a.ep == b.ep
        and (a.etp or a.tp) == (b.etp or b.tp)
        and sharding[0] == sharding[1]
    )


def is_stacked_layer_key(key: str) -> bool:
    return bool(_STACKED_LAYER_RE.search(key))


def is_expert_key(key: str) -> bool:
    return ".experts." in key


def _distinct_offsets(entry: Entry, axis: int) -> int:
    return len({c.offsets[axis] for c in entry.chunks if len(c.offsets) > axis})


_NO_RANK = frozenset({None})


class _Coverage:
    """Which writer ranks wrote which units (layers, or experts), as spans: each chunk's [start, end) along the
    axis with its ranks. Kept as spans, not unit by unit: a hostile ``.metadata`` may give one chunk 2^40 layers
    (a few bytes) that a dict per unit would take minutes and GBs to hold."""

    def __init__(self) -> None:
        self.spans: set[tuple[int, int, frozenset[int]]] = set()  # a million chunks hold a few thousand spans
        self._one: dict[int | None, frozenset[int]] = {}  # each rank's set, made once

    def add(self, start: int, end: int, ranks: set[int | None]) -> None:
        if end > start:
            named = frozenset(ranks)
            self.spans.add((start, end, cast("frozenset[int]", named - _NO_RANK if None in named else named)))

    def add_one(self, start: int, end: int, rank: int | None) -> None:
        """:meth:`add` of one chunk's writer rank (the most frequent call: one per chunk)."""
        if end > start:
            named = self._one.get(rank)
            if named is None:
                named = self._one[rank] = frozenset() if rank is None else frozenset((rank,))
            self.spans.add((start, end, named))

    def __bool__(self) -> bool:
        return bool(self.spans)

    def units(self) -> int:
        """The units some chunk covers."""
        return _covered([(start, end) for start, end, _ in self.spans])

    def groups(self) -> int:
        """Connected groups of units, two units joined when a rank wrote chunks of both; a unit no named rank
        wrote is a group of its own. The ranks are the nodes: those of one span, of spans that share a unit (an
        overlapping run, sorted by start) and the same rank anywhere are one group."""
        parent: dict[int, int] = {}

        def find(x: int) -> int:
            while parent.setdefault(x, x) != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        ranked = sorted((start, end, min(ranks), ranks) for start, end, ranks in self.spans if ranks)
        block_end: int | None = None
        block_rank = 0
        for start, end, first, ranks in ranked:
            for rank in ranks:
                parent[find(rank)] = find(first)
            if block_end is not None and start < block_end:  # shares a unit with the run before it
                parent[find(first)] = find(block_rank)
                block_end = max(block_end, end)
            else:
                block_end, block_rank = end, first
        named = len({find(rank) for _, _, _, ranks in ranked for rank in ranks})
        unnamed = self.units() - _covered([(start, end) for start, end, _, _ in ranked])
        return named + unnamed


def _covered(spans: list[tuple[int, int]]) -> int:
    """The length of the union of [start, end) spans."""
    total = 0
    reach: int | None = None
    for start, end in sorted(spans):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


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


def _collect_expert_ranks(entry: Entry, stacked: bool, expert_ranks: _Coverage, rank_of: _WriterRanks) -> None:
    """Experts -> writer ranks, from ``local_experts.<e>.`` keys or the expert axis of the chunks."""
    named = _LOCAL_EXPERT_RE.search(entry.key)
    if named:  # one expert for every chunk of the key
        if entry.chunks:
            expert = int(named.group(1))
            expert_ranks.add(expert, expert + 1, _chunk_ranks(entry, rank_of))
        return
    axis = 1 if stacked else 0
    for chunk in entry.chunks:
        if len(chunk.offsets) > axis:
            rank = rank_of[chunk.storage.relative_path] if chunk.storage else None
            expert_ranks.add_one(chunk.offsets[axis], chunk.offsets[axis] + chunk.sizes[axis], rank)


def infer_layout(checkpoint: Checkpoint) -> SavedLayout:
    if checkpoint.location.backend == BACKEND_DCP:  # no Megatron layout: DTensor shards over one mesh
        grid = shard_grid(checkpoint)
        written = set(checkpoint.data_files) | checkpoint.referenced_files()
        ranks = sorted({r for name in written if (r := writer_rank(name)) is not None})
        return SavedLayout(tp=None, pp=None, layers=None, ep=None, writer_ranks=ranks, sharding=grid)
    split_counts: list[int] = []
    fc1_counts: list[int] = []
    expert_counts: list[int] = []  # the same within one expert (ETP), SwiGLU fc1 apart
    expert_fc1_counts: list[int] = []
    stacks: dict[str, _Coverage] = {}  # the text before "layers." (decoder., mtp., ...) -> its layers' ranks
    expert_ranks = _Coverage()
    ranks_known = True
    rank_of = _WriterRanks()
    for entry in checkpoint.section_entries("model"):
        if entry.kind != "tensor" or not entry.shape or entry.misranked_chunk() is not None:
            continue  # a chunk of another rank than its tensor tells nothing of the layout (check: CKD coverage)
        if _REPLICATED_RE.search(entry.key):
            continue
        stacked_at = _STACKED_LAYER_RE.search(entry.key)
        stacked = stacked_at is not None
        indexed = None if stacked else _INDEXED_LAYER_RE.search(entry.key)
        if stacked_at is not None:
            layer_ranks = _stack(stacks, entry.key, stacked_at)
            for chunk in entry.chunks:
                rank = rank_of[chunk.storage.relative_path] if chunk.storage else None
                ranks_known = ranks_known and rank is not None
                layer_ranks.add_one(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0], rank)
        elif indexed and entry.chunks:  # one layer for every chunk of the key
            chunk_ranks = _chunk_ranks(entry, rank_of)
            ranks_known = ranks_known and None not in chunk_ranks
            layer = int(indexed.group(1))
            _stack(stacks, entry.key, indexed).add(layer, layer + 1, chunk_ranks)
        first_split_axis = 1 if stacked else 0
        if is_expert_key(entry.key):
            _collect_expert_ranks(entry, stacked, expert_ranks, rank_of)
            within = _within_expert_split(entry, stacked)
            if within is not None:
                (expert_fc1_counts if _SWIGLU_FC1_RE.search(entry.key) else expert_counts).append(within)
            continue
        split = max((_distinct_offsets(entry, a) for a in range(first_split_axis, len(entry.shape))), default=1)
        (fc1_counts if _SWIGLU_FC1_RE.search(entry.key) else split_counts).append(split)
    # the ranks whose files the index references too: a half-written save (a rank's file missing) keeps its layout
    written = set(checkpoint.data_files) | checkpoint.referenced_files()
    ranks = sorted({r for name in written if (r := rank_of[name]) is not None})
    if any(c > 1 for c in split_counts):
        tp: int | None = min(c for c in split_counts if c > 1)
    elif split_counts:
        # Nothing but fc1 split: TP=1 with SwiGLU (2 chunks) or fc1 alone cut TP ways.
        tp = 1 if all(c <= 2 for c in fc1_counts) else min(fc1_counts) // 2
    else:
        tp = None
    # The pipeline splits the decoder's layers; other stacks number their own (an MTP block's mtp.layers.<i>, on the
    # last stage, shares no layer with decoder layer i: joined with it, a PP=2 save read as PP=1).
    main = max(stacks.items(), key=lambda item: (item[0].endswith("decoder."), item[1].units()), default=None)
    layer_ranks = main[1] if main is not None else _Coverage()
    pp = layer_ranks.groups() if layer_ranks and ranks_known else None
    ep = expert_ranks.groups() if expert_ranks and ranks_known else None
    etp = _degree(expert_counts, expert_fc1_counts)
    return SavedLayout(tp=tp, pp=pp, layers=layer_ranks.units() or None, ep=ep, writer_ranks=ranks, etp=etp)


def _degree(counts: list[int], fc1_counts: list[int]) -> int | None:
    """The parallel degree the chunk counts show: the smallest split > 1 (1 when nothing is split); SwiGLU's fc1
    (cat([W, V]): 2 chunks a rank) decides only when nothing else is there (None without either)."""
    if any(c > 1 for c in counts):
        return min(c for c in counts if c > 1)
    if counts:
        return 1
    if fc1_counts:
        return 1 if all(c <= 2 for c in fc1_counts) else min(fc1_counts) // 2
    return None


def _within_expert_split(entry: Entry, stacked: bool) -> int | None:
    """How many ways one expert's tensor is cut (its ETP): the most distinct chunk offsets along an axis after
    the layer and expert axes. Only the layouts whose expert axis is known: ``local_experts.<e>.`` keys (no expert
    axis) and ``experts.experts.`` ones (``[L, E, ...]`` when stacked); None for others (grouped ``weight<e>``)."""
    if _LOCAL_EXPERT_RE.search(entry.key):
        first = 1 if stacked else 0
    elif ".experts.experts." in entry.key:
        first = 2 if stacked else 1
    else:
        return None
    return max((_distinct_offsets(entry, a) for a in range(first, len(entry.shape or ()))), default=1)


def _stack(stacks: dict[str, _Coverage], key: str, layers_at: re.Match[str]) -> _Coverage:
    """The coverage of the layer stack ``key`` belongs to: the text before its ``layers.`` (``layers_at``)."""
    prefix = key[: layers_at.start() + 1] if layers_at.group(0).startswith(".") else ""
    coverage = stacks.get(prefix)
    if coverage is None:
        coverage = stacks[prefix] = _Coverage()
    return coverage
