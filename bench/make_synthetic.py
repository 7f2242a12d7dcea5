"""Generate large synthetic Megatron-Core ``torch_dist`` checkpoints for benchmarks, written by real PyTorch DCP.

Layout produced (the same as a Megatron-LM save dir)::

    OUT/latest_checkpointed_iteration.txt     # "100", no newline
    OUT/iter_0000100/.metadata                # written by FileSystemWriter.finish (DCP Metadata pickle)
    OUT/iter_0000100/__<rank>_<n>.distcp      # written by FileSystemWriter.write_data
    OUT/iter_0000100/metadata.json            # Megatron's backend marker
    OUT/iter_0000100/common.pt                # torch.save({"args": Namespace, "iteration", "checkpoint_version"})

How the many data files come about (simulated ranks, honest DCP write path)
---------------------------------------------------------------------------
``dcp.save`` on N ranks runs: per rank ``planner.set_up_planner`` + ``create_local_plan`` +
``writer.prepare_local_plan``; on the coordinator ``planner.create_global_plan`` +
``writer.prepare_global_plan`` (which gives rank i the file prefix ``__i_``); per rank ``planner.finish_plan``
+ ``writer.write_data``; on the coordinator ``writer.finish`` (which pickles ``.metadata``).  This script drives
exactly those public ``SavePlanner`` / ``StorageWriter`` steps for ``--files / 2`` simulated ranks inside one
process (no process group), so the files, the byte layout inside them and ``.metadata`` are all produced by
PyTorch's own ``DefaultSavePlanner`` and ``FileSystemWriter``.  Each simulated rank uses
``FileSystemWriter(thread_count=2)``, as Megatron's torch_dist strategy does, hence two files per rank:
``__<rank>_0.distcp`` and ``__<rank>_1.distcp``.

The only custom piece is ``SyntheticPlanner`` (a ``DefaultSavePlanner`` subclass): its local plan lists the
chunks this rank owns (global shape + chunk offsets, the way Megatron's ShardedTensors reach DCP), and
``lookup_object`` creates each chunk's tensor on demand when the writer asks for it, so the whole checkpoint
is never held in memory (peak RSS is a few hundred MB whatever --total-bytes is).

Model shape: a Megatron GPT with MoE layers, keyed per layer the way Megatron-Core writes non-homogeneous
stacks (``decoder.layers.<i>.self_attention.linear_qkv.weight``, ``decoder.layers.<i>.mlp.experts.local_experts.
<e>.linear_fc1.weight``), because that is how a real checkpoint reaches ~20,000 keys; ``--layout stacked``
instead writes the dense, homogeneous-stack keys with a leading layer axis (``decoder.layers.self_attention.
linear_qkv.weight`` of shape [L, 3h, h], one chunk per layer and TP rank) - a stacked checkpoint only has a few
dozen keys, so there --keys sets the layer count through the per-layer ``_extra_state`` objects TE modules save.
Optimizer state is ``optimizer.state.exp_avg.<key>`` / ``optimizer.state.exp_avg_sq.<key>`` (fp32), with the
parameter's chunking.  Tensor-parallel chunks are written by ranks with ``rank % tp == t``; replicated
tensors and experts go to the least-loaded rank (Megatron's fully parallel save spreads them over DP ranks).

Values are seeded pseudo-random slices of a small random pool (deterministic for a given --seed).

Usage::

    python bench/make_synthetic.py --out bench/data/ckpt_4G --total-bytes 4G --keys 20000 --files 2000
    python bench/make_synthetic.py --out /tmp/small --total-bytes 8M --keys 200 --files 8 --verify
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import io
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

ITERATION = 100
GENERATOR = 2  # bumped when the same options make another checkpoint (harness.synthetic regenerates on a change)
SIZE_TOLERANCE = 0.10  # the checkpoint's bytes on disk are within this of --total-bytes unless the keys forbid it
THREADS_PER_RANK = 2  # Megatron's torch_dist save strategy default: two files per rank
SHAPE_TP = 64  # hidden size and vocab fit TP=64, so every --tp dividing 64 gives the same shapes
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


# ----------------------------------------------------------------------------------------------------------------
# The synthetic model: which keys, shapes and chunks
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tp_rank: int | None  # TP rank that holds it; None = replicated / expert (any rank may write it)
    rank: int = -1  # simulated writer rank, assigned later

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class TensorSpec:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[Chunk]


@dataclass
class ObjectSpec:
    key: str  # e.g. rng_state/shard_0.1_1.2
    payload: str  # "rng" or "extra_state"
    rank: int = -1


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 512M, 0.5G, 4G)")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def split(shape: tuple[int, ...], axis: int, parts: int, lead: tuple[int, ...] = ()) -> list[Chunk]:
    """``parts`` even chunks along ``axis`` (chunk i is held by TP rank i % tp); ``lead`` prefixes offsets."""
    assert shape[axis] % parts == 0, (shape, axis, parts)
    step = shape[axis] // parts
    chunks = []
    for i in range(parts):
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[axis], sizes[axis] = i * step, step
        chunks.append(Chunk(lead + tuple(offsets), (1,) * len(lead) + tuple(sizes), i))
    return chunks


def whole(shape: tuple[int, ...]) -> list[Chunk]:
    return [Chunk((0,) * len(shape), shape, None)]


@dataclass
class ModelDims:
    layout: str
    layers: int
    hidden: int
    experts: int  # 0 = dense MLP
    vocab: int
    tp: int
    expert_tp: int = 1  # expert tensor parallel size: 1 (each expert whole) or tp
    ffn_size: int | None = None  # None: 4 x hidden (dense) / hidden (per expert)

    @property
    def ffn(self) -> int:  # dense SwiGLU FFN / per-expert FFN
        if self.ffn_size is not None:
            return self.ffn_size
        return 4 * self.hidden if self.experts == 0 else self.hidden


def layer_tensors(d: ModelDims, prefix: str, lead: tuple[int, ...] = ()) -> list[tuple[str, tuple[int, ...], list]]:
    """(key, shape, chunks) of one transformer layer; ``lead`` = (layer,) offsets for stacked keys."""
    h, f, tp = d.hidden, d.ffn, d.tp
    stacked = bool(lead)
    L = d.layers

    def full(shape: tuple[int, ...]) -> tuple[int, ...]:
        return ((L,) + shape) if stacked else shape

    def tp_split(shape: tuple[int, ...], axis: int, parts: int) -> list[Chunk]:
        chunks = split(shape, axis, parts, lead)
        for c in chunks:
            c.tp_rank = c.tp_rank % tp
        return chunks

    def rep(shape: tuple[int, ...]) -> list[Chunk]:
        return [Chunk(lead + (0,) * len(shape), (1,) * len(lead) + shape, None)]

    out = [
        (f"{prefix}self_attention.linear_qkv.layer_norm_weight", full((h,)), rep((h,))),
        (f"{prefix}self_attention.linear_qkv.weight", full((3 * h, h)), tp_split((3 * h, h), 0, tp)),
        (f"{prefix}self_attention.linear_proj.weight", full((h, h)), tp_split((h, h), 1, tp)),
    ]
    if d.experts == 0:
        out += [
            (f"{prefix}mlp.linear_fc1.layer_norm_weight", full((h,)), rep((h,))),
            # SwiGLU fc1 holds cat([W, V]); Megatron cuts each half TP ways -> 2*TP chunks
            (f"{prefix}mlp.linear_fc1.weight", full((2 * f, h)), tp_split((2 * f, h), 0, 2 * tp)),
            (f"{prefix}mlp.linear_fc2.weight", full((h, f)), tp_split((h, f), 1, tp)),
        ]
    else:
        out += [
            (f"{prefix}pre_mlp_layernorm.weight", full((h,)), rep((h,))),
            (f"{prefix}mlp.router.weight", full((d.experts, h)), rep((d.experts, h))),
        ]
        for e in range(d.experts):
            ep = f"{prefix}mlp.experts.local_experts.{e}."
            if d.expert_tp == 1:  # expert tensor parallel = 1: each expert whole on its EP rank
                out += [
                    (f"{ep}linear_fc1.weight", (2 * f, h), whole((2 * f, h))),
                    (f"{ep}linear_fc2.weight", (h, f), whole((h, f))),
                ]
            else:  # expert tensor parallel = TP (Megatron's default): split like the dense MLP
                out += [
                    (f"{ep}linear_fc1.weight", (2 * f, h), tp_split((2 * f, h), 0, 2 * tp)),
                    (f"{ep}linear_fc2.weight", (h, f), tp_split((h, f), 1, tp)),
                ]
    return out


def model_tensors(d: ModelDims) -> list[tuple[str, tuple[int, ...], list]]:
    h, tp = d.hidden, d.tp
    out = [("embedding.word_embeddings.weight", (d.vocab, h), split((d.vocab, h), 0, tp))]
    if d.layout == "stacked":
        for layer in range(d.layers):
            for key, shape, chunks in layer_tensors(d, "decoder.layers.", (layer,)):
                out.append((key, shape, chunks))
        merged: dict[str, tuple[tuple[int, ...], list]] = {}
        for key, shape, chunks in out:
            merged.setdefault(key, (shape, []))[1].extend(chunks)
        out = [(k, s, c) for k, (s, c) in merged.items()]
    else:
        for layer in range(d.layers):
            out += layer_tensors(d, f"decoder.layers.{layer}.")
    out += [
        ("decoder.final_layernorm.weight", (h,), whole((h,))),
        ("output_layer.weight", (d.vocab, h), split((d.vocab, h), 0, tp)),
    ]
    return out


def model_numel(d: ModelDims) -> int:
    return sum(math.prod(shape) for _, shape, _ in model_tensors_shapes(d))


def model_tensors_shapes(d: ModelDims) -> list[tuple[str, tuple[int, ...], None]]:
    """Shapes only (cheap: no chunk lists), for sizing."""
    h, f = d.hidden, d.ffn
    per_layer = [(3 * h, h), (h, h), (h,)]
    if d.experts == 0:
        per_layer += [(h,), (2 * f, h), (h, f)]
    else:
        per_layer += [(h,), (d.experts, h)] + [(2 * f, h), (h, f)] * d.experts
    shapes = [(d.vocab, h), (h,), (d.vocab, h)] + per_layer * d.layers
    return [("", s, None) for s in shapes]


# Bytes a checkpoint holds besides tensor data, fitted on make_synthetic outputs from 2k to 1M chunks: FileSystemWriter
# frames every item with torch.save (~1,580 B in the .distcp files); .metadata is ~210 B per key + ~130 B per
# chunk; an rng ShardedObject ~10 KB, an _extra_state one ~1 KB; common.pt ~3 KB. At 20,000 keys that is ~41 MB,
# so a small --total-bytes cannot be met with many keys or chunks (the smallest model is made, with a warning).
METADATA_BYTES_PER_KEY = 210
METADATA_BYTES_PER_CHUNK = 130 + 1_580
OBJECT_BYTES = {"rng": 10_000, "extra_state": 1_000}
COMMON_BYTES = 3_000


def choose_dims(
    total_bytes: int,
    keys: int,
    tp: int,
    layout: str,
    param_bytes: int,
    layers: int | None,
    n_objects: int,
    shape_tp: int = SHAPE_TP,
    expert_tp: int = 1,
) -> ModelDims:
    """Layers/experts from the key budget; hidden size and FFN size from the byte budget.

    The model does not depend on ``tp``: hidden size and vocab are multiples of what TP=``shape_tp`` needs, and
    so is the FFN size where the FFN is TP-split (dense MLP, or ``expert_tp`` > 1), so checkpoints made with
    any ``tp`` dividing ``shape_tp`` hold the same keys with the same global shapes (a reshard of one model),
    and value commands across layouts compare values instead of stopping at a shape difference.

    Size: the checkpoint's bytes on disk (tensor data + ``.metadata`` + objects) aim at ``total_bytes``. The
    hidden size alone moves the size in steps of ~(1 + 1/k)^2 (a 4x jump from hidden 64 to 128 at TP-64
    shapes), so for each hidden size the FFN size (the bulk of a MoE model) is solved for the remaining bytes
    and the vocab takes up what one FFN step leaves; of the (hidden, FFN, vocab) triples within 1% of the budget
    the one nearest the usual FFN/hidden ratio is kept (else the nearest in size). A key or chunk count whose
    framing, ``.metadata`` and smallest tensors already exceed ``total_bytes`` gets the smallest model
    (``write_checkpoint`` warns and records a ``size_note``)."""
    if shape_tp % tp:
        raise SystemExit(f"--tp {tp} does not divide --shape-tp {shape_tp}")
    if expert_tp not in (1, tp):
        raise SystemExit(f"--expert-tp {expert_tp} must be 1 or --tp {tp}")
    bytes_per_element = param_bytes + 2 * 4  # param + fp32 exp_avg + fp32 exp_avg_sq
    if layout == "stacked":
        # ~9 stacked model keys x 3 (param, exp_avg, exp_avg_sq); the rest are per-layer _extra_state objects
        n_layers = layers or max(1, (keys - 27 - shape_tp) // 4)
        experts = 0
    else:
        model_keys = max(9, round((keys - shape_tp) / 3))
        n_layers = layers or max(1, min(32, (model_keys - 3) // 8))
        per_layer = (model_keys - 3) / n_layers
        experts = 0 if per_layer < 7 else max(1, round((per_layer - 5) / 2))
    unit = 2 * shape_tp  # vocab rows split evenly over any TP dividing shape_tp
    ffn_step = shape_tp if experts == 0 or expert_tp > 1 else 1  # experts whole on one rank: any FFN size
    # Keys and chunks do not depend on hidden/FFN size; they are counted at TP=1 (at TP=shape_tp when experts are
    # TP-split: their chunks are most of the count), so that the model does not depend on --tp (a larger --tp
    # adds its extra chunks' framing and .metadata entries, ~1.7 KB each, to the size).
    probe_tp = shape_tp if expert_tp > 1 else 1
    probe = ModelDims(layout, n_layers, shape_tp, experts, unit, probe_tp, probe_tp, ffn_step)
    tensors, objects = build_specs(probe, torch.float32)
    overhead = (
        METADATA_BYTES_PER_KEY * (len(tensors) + len(objects))
        + METADATA_BYTES_PER_CHUNK * (sum(len(t.chunks) for t in tensors) + len(objects))
        + sum(OBJECT_BYTES[o.payload] for o in objects)
        + COMMON_BYTES
    )
    natural = 1 if experts else 4  # FFN / hidden: Megatron's dense default 4h; an expert here h
    candidates = []  # (relative size error, |log(ffn / natural ffn)|, ModelDims)
    for hidden in range(shape_tp, 1 << 16, shape_tp):
        vocab = max(unit, (16 * hidden) // unit * unit)

        def dims(ffn: int, hidden: int = hidden, vocab: int = vocab) -> ModelDims:
            return ModelDims(layout, n_layers, hidden, experts, vocab, tp, expert_tp, ffn)

        fixed = model_numel(dims(0))
        per_ffn = model_numel(dims(1)) - fixed
        want = (total_bytes - overhead) / bytes_per_element
        steps = (want - fixed) / (per_ffn * ffn_step)
        for n in {max(1, math.floor(steps)), max(1, math.ceil(steps))}:
            d = dims(n * ffn_step)
            # the vocab (embedding + output rows, in steps of ``unit``, 0.5x-4x the usual 16 x hidden) takes up the rest
            rows = round((want - model_numel(d)) / (2 * hidden) / unit) * unit
            d = dataclasses.replace(d, vocab=min(4 * vocab, max(vocab // 2 // unit * unit or unit, vocab + rows)))
            size = model_numel(d) * bytes_per_element + overhead
            candidates.append((abs(size / total_bytes - 1), abs(math.log(d.ffn / (natural * hidden))), d))
        if steps < 1:  # even the smallest FFN overshoots: larger hidden sizes only grow
            break
    close = [c for c in candidates if c[0] <= 0.01]
    if close:
        return min(close, key=lambda c: (c[1], c[0]))[2]
    return min(candidates, key=lambda c: (c[0], c[1]))[2]


def extra_state_objects(d: ModelDims) -> list[ObjectSpec]:
    """TE modules' ``_extra_state``: one ShardedObject per layer per module (``shard_<layer>_<L>``)."""
    modules = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
    return [
        ObjectSpec(f"decoder.layers.{m}._extra_state/shard_{layer}_{d.layers}", "extra_state")
        for m in modules
        for layer in range(d.layers)
    ]


def build_specs(d: ModelDims, param_dtype: torch.dtype) -> tuple[list[TensorSpec], list[ObjectSpec]]:
    tensors = []
    params = model_tensors(d)
    for key, shape, chunks in params:
        tensors.append(TensorSpec(key, shape, param_dtype, chunks))
    for state in ("exp_avg", "exp_avg_sq"):
        for key, shape, chunks in params:
            tensors.append(
                TensorSpec(
                    f"optimizer.state.{state}.{key}", shape, torch.float32, [dataclasses.replace(c) for c in chunks]
                )
            )
    # rng_state: a ShardedObject over (pp, tp), as Megatron's get_rng_state saves it for torch_dist
    objects = [ObjectSpec(f"rng_state/shard_0.{t}_1.{d.tp}", "rng") for t in range(d.tp)]
    if d.layout == "stacked":
        objects += extra_state_objects(d)
    return tensors, objects


SpecBuilder = Callable[[ModelDims, torch.dtype], tuple[list[TensorSpec], list[ObjectSpec]]]


def assign_ranks(tensors: list[TensorSpec], objects: list[ObjectSpec], world: int, tp: int, elem_bytes) -> None:
    """TP chunk t -> least-loaded rank with rank % tp == t; replicated chunks and objects -> least-loaded rank.

    Ranks that hold fewer than ``THREADS_PER_RANK`` chunks come first, whatever their load: a real save spreads
    work so that every writer thread of every rank writes something (DCP writes one file per thread, so a rank
    with a single item leaves an empty ``.distcp`` file, which a real 20,000-file checkpoint does not have).
    """
    # heaps of (has enough items, bytes, rank) per TP rank and over every rank
    groups = [[(0, 0, r) for r in range(t, world, tp)] for t in range(tp)]
    everyone = [(0, 0, r) for r in range(world)]
    loads = [0] * world
    counts = [0] * world

    def key(r: int) -> tuple[int, int, int]:
        return (int(counts[r] >= THREADS_PER_RANK), loads[r], r)

    def pop_least(heap):
        while True:  # lazy deletion: an entry is stale once its rank's load or item count has grown
            entry = heapq.heappop(heap)
            if entry == key(entry[2]):
                return entry[2]

    items = [(c.numel * elem_bytes(t.dtype), c) for t in tensors for c in t.chunks]
    items.sort(key=lambda x: -x[0])
    for nbytes, chunk in items:
        r = pop_least(everyone if chunk.tp_rank is None else groups[chunk.tp_rank])
        chunk.rank = r
        loads[r] += nbytes
        counts[r] += 1
        heapq.heappush(groups[r % tp], key(r))
        heapq.heappush(everyone, key(r))
    for i, obj in enumerate(objects):
        obj.rank = i % world


# ----------------------------------------------------------------------------------------------------------------
# The DCP planner: lists this rank's chunks, makes each chunk's values only when the writer asks for it
# ----------------------------------------------------------------------------------------------------------------


class ValuePool:
    """Seeded random pools per dtype. ``global_values``: element i (row-major global index) of a key is
    ``pool[(hash(key) + i) % n]``, the same whatever the chunking (a resharded checkpoint holds equal values);
    else a chunk's values are a slice starting at a hash of (key, offsets)."""

    def __init__(self, seed: int, numel: int, global_values: bool = True) -> None:
        self.global_values = global_values
        gen = torch.Generator().manual_seed(seed)
        base = torch.randn(numel, generator=gen)
        self.seed = seed
        self.pools = {torch.float32: base, torch.bfloat16: base.to(torch.bfloat16)}
        self.sq = base.square()  # exp_avg_sq is non-negative

    def make(
        self,
        key: str,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        dtype: torch.dtype,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        pool = self.sq if ".exp_avg_sq." in key else self.pools[dtype]
        if self.global_values and shape is not None:
            return self._global(pool, key, offsets, sizes, shape)
        n = math.prod(sizes)
        if n > pool.numel():
            reps = -(-n // pool.numel())
            return pool.repeat(reps)[:n].clone().view(sizes)
        start = zlib.crc32(f"{self.seed}|{key}|{offsets}".encode()) % (pool.numel() - n + 1)
        return pool[start : start + n].clone().view(sizes)

    def _global(
        self, pool: torch.Tensor, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        n = pool.numel()
        index = torch.full((), zlib.crc32(f"{self.seed}|{key}".encode()) % n, dtype=torch.int64)
        stride = 1
        for d in reversed(range(len(shape))):
            view = [1] * len(shape)
            view[d] = sizes[d]
            index = index + (torch.arange(offsets[d], offsets[d] + sizes[d], dtype=torch.int64) * stride).view(view)
            stride *= shape[d]
        return pool[index.remainder_(n) if index.dim() else index % n]


def object_payload(obj: ObjectSpec, seed: int) -> io.BytesIO:
    """A ShardedObject's bytes the way Megatron hands them to DCP: a BytesIO holding ``torch.save(data)``."""
    rnd = random.Random(zlib.crc32(f"{seed}|{obj.key}".encode()))
    if obj.payload == "rng":
        data = [
            {
                "random_rng_state": rnd.getstate(),
                "torch_rng_state": torch.Generator().manual_seed(rnd.getrandbits(32)).get_state(),
                "rng_tracker_states": {},
            }
        ]
    else:
        data = io.BytesIO(bytes(rnd.getrandbits(8) for _ in range(64)))
    inner = io.BytesIO()
    torch.save(data, inner)
    inner.seek(0)
    return inner


class SyntheticPlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose local plan is this simulated rank's chunks, created lazily in lookup_object."""

    def __init__(
        self, rank: int, chunks: list[tuple[TensorSpec, Chunk]], objects: list[ObjectSpec], pool: ValuePool
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.rank = rank
        self.my_chunks = chunks
        self.my_objects = objects
        self.chunk_by_index = {(t.key, c.offsets): (t, c) for t, c in chunks}
        self.objects_by_key = {o.key: o for o in objects}
        self.pool = pool

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner({}, storage_meta, is_coordinator)  # values are made on demand, never held

    def create_local_plan(self) -> SavePlan:
        items = []
        for spec, c in self.my_chunks:
            offsets = torch.Size(c.offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(spec.key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets, torch.Size(c.sizes)),
                        properties=TensorProperties(dtype=spec.dtype),
                        size=torch.Size(spec.shape),
                    ),
                )
            )
        for obj in self.my_objects:
            items.append(WriteItem(index=MetadataIndex(obj.key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.objects_by_key:
            return object_payload(self.objects_by_key[index.fqn], self.pool.seed)
        spec, chunk = self.chunk_by_index[(index.fqn, tuple(index.offset))]
        return self.pool.make(spec.key, chunk.offsets, chunk.sizes, spec.dtype, spec.shape)


# ----------------------------------------------------------------------------------------------------------------
# Driving the save: the dcp.save steps for every simulated rank, writes split over --jobs forked workers
# ----------------------------------------------------------------------------------------------------------------

_STATE: dict = {}


def _write_ranks(ranks: list[int]) -> list[list]:
    torch.set_num_threads(1)
    planners, writers, plans = _STATE["planners"], _STATE["writers"], _STATE["plans"]
    results = []
    for r in ranks:
        final = planners[r].finish_plan(plans[r])
        fut = writers[r].write_data(final, planners[r])
        fut.wait()
        results.append(fut.value())
    return results


def write_checkpoint(
    out: Path,
    total_bytes: int,
    keys: int,
    files: int,
    dtype: str,
    seed: int,
    tp: int,
    layout: str,
    layers: int | None,
    jobs: int,
    shape_tp: int = SHAPE_TP,
    values: str = "global",
    expert_tp: int = 1,
    build_specs: SpecBuilder = build_specs,
    mcore_plans: bool = False,
) -> dict:
    """Write the checkpoint; ``build_specs`` makes its keys, shapes and chunks from the dims ``choose_dims``
    picks (default: the model above; bench_strip.py passes its PEFT variant of it)."""
    t0 = time.perf_counter()
    if files % THREADS_PER_RANK:
        raise SystemExit(f"--files must be a multiple of {THREADS_PER_RANK} (each simulated rank writes two files)")
    world = files // THREADS_PER_RANK
    if world % tp:
        raise SystemExit(f"--files/2 = {world} ranks is not a multiple of --tp {tp}")
    param_dtype = DTYPES[dtype]
    param_bytes = torch.tensor([], dtype=param_dtype).element_size()
    n_objects = tp
    d = choose_dims(total_bytes, keys, tp, layout, param_bytes, layers, n_objects, shape_tp, expert_tp)
    tensors, objects = build_specs(d, param_dtype)
    n_chunks = sum(len(t.chunks) for t in tensors) + len(objects)
    if n_chunks < files:  # every writer thread of every rank writes at least one item (no empty file)
        raise SystemExit(f"only {n_chunks} chunks for {files} files; ask for more --keys or fewer --files")
    elem_bytes = {torch.float32: 4, torch.bfloat16: 2}.__getitem__
    assign_ranks(tensors, objects, world, tp, elem_bytes)

    iter_dir = out / f"iter_{ITERATION:07d}"
    if out.exists():
        shutil.rmtree(out)
    iter_dir.mkdir(parents=True)
    max_chunk = max(c.numel for t in tensors for c in t.chunks)
    pool = ValuePool(seed, min(max(max_chunk, 1 << 22), 1 << 25), values == "global")

    # local step, every rank
    rank_chunks: list[list] = [[] for _ in range(world)]
    rank_objects: list[list] = [[] for _ in range(world)]
    for t in tensors:
        for c in t.chunks:
            rank_chunks[c.rank].append((t, c))
    for o in objects:
        rank_objects[o.rank].append(o)
    planners, writers, local_plans = [], [], []
    for r in range(world):
        planner = SyntheticPlanner(r, rank_chunks[r], rank_objects[r], pool)
        writer = FileSystemWriter(str(iter_dir), thread_count=THREADS_PER_RANK, sync_files=False)
        planner.set_up_planner({}, writer.storage_meta(), is_coordinator=(r == 0))
        writer.set_up_storage_writer(r == 0, rank=r, use_collectives=True)
        local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
        planners.append(planner)
        writers.append(writer)
    # global step, coordinator (rank 0): dedup, Metadata, validation, file prefixes __<rank>_
    global_plans, metadata = planners[0].create_global_plan(local_plans)
    if mcore_plans:
        # megatron-core's saver keeps every rank's local plan in .metadata (all_local_plans, for cached saves): a
        # write item per chunk whose chunk and properties are the very objects state_dict_metadata holds (so the
        # pickle refers to them again), as in every fixture megatron-core 0.14-0.19 wrote
        metadata.all_local_plans = local_plans
    global_plans = writers[0].prepare_global_plan(global_plans)
    t_plan = time.perf_counter()

    # write step, every rank (forked workers share the planners; results come back pickled)
    _STATE.update(planners=planners, writers=writers, plans=global_plans)
    jobs = max(1, min(jobs, world))
    shards = [list(range(i, world, jobs)) for i in range(jobs)]
    if jobs == 1:
        per_job = [_write_ranks(shards[0])]
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool_:
            per_job = pool_.map(_write_ranks, shards)
    results_by_rank: list = [None] * world
    for shard, res in zip(shards, per_job):
        for r, rr in zip(shard, res):
            results_by_rank[r] = rr
    # finish step, coordinator: writes .metadata
    writers[0].finish(metadata, results_by_rank)
    t_write = time.perf_counter()

    write_common(iter_dir, d, world, param_dtype)
    (iter_dir / "metadata.json").write_text(json.dumps(METADATA_JSON))
    (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))

    data_files = sorted(p for p in iter_dir.iterdir() if p.name.endswith(".distcp"))
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    ratio = on_disk / total_bytes
    size_note = None
    if abs(ratio - 1) > SIZE_TOLERANCE:
        size_note = (
            f"{on_disk:,} bytes on disk = {ratio:.2f} x --total-bytes {total_bytes:,}: "
            f"{n_chunks:,} chunks of {len(tensors) + len(objects):,} keys (~1.7 KB of framing and .metadata each) "
            f"at TP={tp}, with shapes for TP={shape_tp}"
        )
        print(f"make_synthetic: warning: {size_note}", file=sys.stderr)
    info = {
        "generator": GENERATOR,
        "out": str(out),
        "iteration_dir": str(iter_dir),
        "layout": layout,
        "dtype": dtype,
        "seed": seed,
        "tp": tp,
        "shape_tp": shape_tp,
        "expert_tp": expert_tp,
        "mcore_plans": int(mcore_plans),
        "values": values,
        "world": world,
        "layers": d.layers,
        "hidden": d.hidden,
        "ffn": d.ffn,
        "experts": d.experts,
        "vocab": d.vocab,
        "keys": len(tensors) + len(objects),
        "tensor_keys": len(tensors),
        "object_keys": len(objects),
        "chunks": n_chunks,
        "files": len(data_files),
        "data_bytes": sum(p.stat().st_size for p in data_files),
        "metadata_bytes": (iter_dir / ".metadata").stat().st_size,
        "bytes": on_disk,  # every file of the save dir (du -sb), synthetic.json excepted
        "size_ratio": round(ratio, 3),
        "size_note": size_note,
        "requested": {"total_bytes": total_bytes, "keys": keys, "files": files},
        "seconds": {
            "plan": round(t_plan - t0, 2),
            "write": round(t_write - t_plan, 2),
            "total": round(time.perf_counter() - t0, 2),
        },
    }
    (out / "synthetic.json").write_text(json.dumps(info, indent=1))
    return info


def write_common(iter_dir: Path, d: ModelDims, world: int, param_dtype: torch.dtype) -> None:
    tp = d.tp
    args = argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=math.gcd(d.experts, world // tp) if d.experts else 1,
        expert_tensor_parallel_size=1 if d.experts else tp,
        sequence_parallel=tp > 1,
        world_size=world,
        data_parallel_size=world // tp,
        use_distributed_optimizer=False,
        num_layers=d.layers,
        hidden_size=d.hidden,
        ffn_hidden_size=d.ffn if not d.experts else 4 * d.hidden,
        moe_ffn_hidden_size=d.ffn if d.experts else None,
        num_experts=d.experts or None,
        num_attention_heads=max(1, d.hidden // 64) if d.hidden % 64 == 0 else tp,
        num_query_groups=None,
        group_query_attention=False,
        kv_channels=None,
        seq_length=4096,
        max_position_embeddings=4096,
        padded_vocab_size=d.vocab,
        vocab_size=None,
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        params_dtype=param_dtype,
        bf16=param_dtype == torch.bfloat16,
        fp16=False,
        fp8=None,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        iteration=ITERATION,
        train_iters=1000,
        lr=3e-4,
        min_lr=3e-5,
        micro_batch_size=1,
        global_batch_size=world // tp,
        consumed_train_samples=ITERATION * (world // tp),
        seed=1234,
        save="synthetic",
        load="synthetic",
        optimizer="adam",
        adam_beta1=0.9,
        adam_beta2=0.95,
        transformer_impl="transformer_engine",
    )
    torch.save(
        {
            "args": args,
            "iteration": ITERATION,
            "checkpoint_version": 3.0,
            "num_floating_point_operations_so_far": 0.0,
            "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 3e-5, "num_steps": ITERATION},
        },
        iter_dir / "common.pt",
    )


def verify_with_torch(iter_dir: Path, expect_keys: int) -> None:
    """PyTorch itself must read it: convert with dcp_to_torch_save, torch.load, compare a few values."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out_pt = iter_dir.parent / "verify_tmp.pt"
    try:
        dcp_to_torch_save(str(iter_dir), str(out_pt))
        state = torch.load(out_pt, weights_only=False)
    finally:
        out_pt.unlink(missing_ok=True)
    assert len(state) == expect_keys, (len(state), expect_keys)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert all(v.abs().sum() > 0 for v in tensors.values()), "all-zero tensor"
    assert all((v >= 0).all() for k, v in tensors.items() if ".exp_avg_sq." in k)
    print(f"verified with dcp_to_torch_save + torch.load: {len(state)} items ({len(tensors)} tensors)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="save dir to (re)create")
    p.add_argument(
        "--total-bytes",
        type=parse_size,
        default=parse_size("4G"),
        help="approximate bytes on disk: tensor data + .metadata (K/M/G are powers of 1024), default 4G",
    )
    p.add_argument("--keys", type=int, default=20000, help="approximate number of keys, default 20000")
    p.add_argument("--files", type=int, default=2000, help="number of .distcp files (2 per simulated rank)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype (optimizer is fp32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (chunks per TP-split tensor)")
    p.add_argument("--layout", choices=["per-layer", "stacked"], default="per-layer")
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes for writing")
    p.add_argument(
        "--shape-tp",
        type=int,
        default=SHAPE_TP,
        help=f"hidden size and vocab fit this TP, so any --tp dividing it gives equal shapes (default {SHAPE_TP})",
    )
    p.add_argument(
        "--values",
        choices=["global", "chunk"],
        default="global",
        help="global: values follow the global index (equal across --tp: a reshard); chunk: per-chunk slices",
    )
    p.add_argument(
        "--expert-tp",
        type=int,
        default=1,
        help="expert tensor parallel size: 1 (default: each expert one chunk) or --tp (Megatron's default, "
        "experts split like the dense MLP: how a per-layer MoE checkpoint reaches ~1M chunks)",
    )
    p.add_argument(
        "--mcore-plans",
        type=int,
        choices=[0, 1],
        default=0,
        help="1: also store every rank's local plan in .metadata (all_local_plans), as megatron-core's saver does",
    )
    p.add_argument("--verify", action="store_true", help="then check it with dcp_to_torch_save + torch.load")
    a = p.parse_args(argv)
    info = write_checkpoint(
        a.out,
        a.total_bytes,
        a.keys,
        a.files,
        a.dtype,
        a.seed,
        a.tp,
        a.layout,
        a.layers,
        a.jobs,
        a.shape_tp,
        a.values,
        a.expert_tp,
        mcore_plans=bool(a.mcore_plans),
    )
    print(json.dumps(info, indent=1))
    if a.verify:
        verify_with_torch(Path(info["iteration_dir"]), info["keys"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
