"""The keys Megatron-Core's optimizers save in a torch_dist checkpoint: one place that reads their form.

A single optimizer saves ``optimizer.state.<stat>.<param key>`` (model-space state: ``exp_avg``, ``exp_avg_sq``,
the distributed optimizer's fp32 ``param`` when fully reshardable) or, for the distributed optimizer's default
``dp_reshardable`` format, flat buckets ``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_(...).
bucket_idx_<k>.<param|exp_avg|exp_avg_sq>``. A ``ChainedOptimizer`` of several (an MoE model's dense and expert
optimizers, each over its own data-parallel group) saves each one's items under ``chained_<i>.``
(``optimizer.ChainedOptimizer.sharded_state_dict``): always for ``dp_reshardable`` buckets, and for every format
where the save's content metadata lacks ``chained_optim_avoid_prefix`` (older Megatron-LM saves). So
``chained_1.optimizer.distributed.dp_group_idx_0...exp_avg`` is an optimizer bucket like
``optimizer.distributed.dp_group_idx_0...exp_avg``, and ``chained_0.optimizer.state.exp_avg.<param>`` the state of
``<param>``. Pure functions of the key, no imports: every layer reads optimizer keys through them.
"""

from __future__ import annotations

import re

_CHAINED = re.compile(r"chained_[0-9]+\.(?=optimizer[./])")
STATE_PREFIX = "optimizer.state."
BUCKET_PREFIX = "optimizer.distributed."
BUCKET_MARK = ".bucket_idx_"


def chain_prefix(key: str) -> str:
    """The ``chained_<i>.`` in front of an optimizer key (``""`` for a single optimizer's and any other key)."""
    if not key.startswith("chained_"):
        return ""
    match = _CHAINED.match(key)
    return match.group(0) if match else ""


def unchained(key: str) -> str:
    """``key`` without its ``chained_<i>.`` prefix: the key one optimizer would save."""
    return key[len(chain_prefix(key)) :]


def is_optimizer_key(key: str) -> bool:
    """An item of the optimizer section: ``optimizer.`` or ``optimizer/``, chained or not."""
    return unchained(key).startswith(("optimizer.", "optimizer/"))


def is_bucket_key(key: str) -> bool:
    """A ``dp_reshardable`` bucket of the distributed optimizer (its parameters flattened: no model key in it)."""
    body = unchained(key)
    return body.startswith(BUCKET_PREFIX) and BUCKET_MARK in body


# DDP's buffer starts every parameter at a multiple of this many elements with the distributed optimizer
# (megatron-core's ``optimizer.param_layout.pad_param_start``; 0.14-0.19).
PARAM_START_ALIGNMENT = 64


def bucket_padding(key: str, offsets: list[int] | tuple[int, ...], sizes: list[int] | tuple[int, ...]) -> bool:
    """Whether a chunk of a flat bucket may be the padding between two parameters (never written): it holds no
    element at a multiple of :data:`PARAM_START_ALIGNMENT`, where every parameter starts. (The tail piece of a
    parameter cut at a DP rank's boundary, shorter than the distance to the next multiple, is also left out.)"""
    if not is_bucket_key(key) or len(offsets) != 1 or len(sizes) != 1:
        return False
    start, end = offsets[0], offsets[0] + sizes[0]
    next_aligned = -(-start // PARAM_START_ALIGNMENT) * PARAM_START_ALIGNMENT
    return next_aligned >= end


def is_distributed_key(key: str) -> bool:
    """Any ``optimizer.distributed.*`` item (the buckets and their per-group objects), chained or not."""
    return unchained(key).startswith(BUCKET_PREFIX)


def state_of(key: str) -> tuple[str, str] | None:
    """``(stat, parameter key)`` of a model-space optimizer item ``[chained_<i>.]optimizer.state.<stat>.<param>``,
    else None."""
    body = unchained(key)
    if not body.startswith(STATE_PREFIX):
        return None
    stat, dot, parameter = body[len(STATE_PREFIX) :].partition(".")
    return (stat, parameter) if dot and stat and parameter else None
