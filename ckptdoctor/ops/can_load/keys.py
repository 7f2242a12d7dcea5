"""Requested vs saved keys of the model section, with the global shapes the loading run requests."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptdoctor.formats.te_extra_state import is_extra_state_key, module_family
from ckptdoctor.ops.can_load.shapes import VOCAB_KEYS, dims_of, layer_index, padded_vocab, target_shape
from ckptdoctor.ops.can_load.verdict import FAILS, SectionVerdict

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint

SHAPE_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "swiglu",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    "padded_vocab_size",
    "vocab_size",
    "max_position_embeddings",
)
# SwiGLU linear_fc1 (and its adapters) is a ShardedTensorFactory: its halves are merged after the load.
SWIGLU_FC1 = re.compile(r"(^|\.)linear_fc1\.(.+\.)?(weight|bias)$")
# Args that add or drop keys rather than change shapes.
SPEC_ARGS = ("qk_layernorm", "untie_embeddings_and_output_weights")
# qk_layernorm is a layer-spec choice, not a shape: q_layernorm/k_layernorm norm each head ([L, kv_channels]).
_QK_NORMS = ("self_attention.q_layernorm.", "self_attention.k_layernorm.")
_EMBEDDING, _OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
_EXPERT_KEYS = (
    "decoder.layers.mlp.router.weight",
    "decoder.layers.mlp.experts.experts.linear_fc1.weight",
    "decoder.layers.mlp.experts.experts.linear_fc2.weight",
)
# Megatron-LM's --ckpt-drop-redundant-extra-state (PR #5552, commit 105445d, 2026-08-11; Megatron-LM main, core
# 0.20.0 in development: no megatron-core release has it, 0.19.x neither): generate_state_dict wraps each
# _extra_state whose freshly built value holds no delayed-scaling markers in a LocalNonpersistentObject, for the
# save and for the load request alike, so its load does not request them.
DROP_REDUNDANT_FLAG = "--ckpt-drop-redundant-extra-state"
DROP_REDUNDANT_SINCE = "Megatron-LM main since PR #5552, core 0.20.0 in development; not in megatron-core 0.19.x"
ABSENT_EXTRA_STATE_FIX = (
    "the checkpoint lacks these modules' _extra_state (dropped as redundant: no delayed-scaling state): load with "
    "--dist-ckpt-strictness log_unexpected (or log_all, ignore_all: the modules keep the state they are built "
    f"with), or with Megatron-LM's {DROP_REDUNDANT_FLAG} and a run without delayed-scaling FP8 "
    f"({DROP_REDUNDANT_SINCE}), whose load does not request non-persistent extra state"
)


@dataclass
class KeyPlan:
    requested: dict[str, tuple[int, ...] | None] = field(default_factory=dict)  # logical key -> global shape
    present: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    unexpected: set[str] = field(default_factory=set)  # requested, not saved
    unexpected_objects: dict[str, str] = field(default_factory=dict)  # object key -> one requested shard key
    absent_extra_state: list[str] = field(default_factory=list)  # modules' _extra_state the checkpoint lacks
    ignored: set[str] = field(default_factory=set)  # saved, requested by no rank (the run's model lacks them)
    shape_failure: SectionVerdict | None = None
    why: str | None = None
    fix: str | None = None
    reshards: bool = False  # cut differently at the target although TP/PP/EP/ETP are unchanged (DP buckets)
    unexpected_at_least: bool = False  # unexpected is a lower bound (a frozen base whose full key set is not known)


def logical(key: str, kind: str) -> str:
    return key.split("/shard_", 1)[0] if kind == "bytes" else key


def changed_args(saved: dict[str, Any], run: dict[str, Any]) -> list[str]:
    return [f"{n} {saved.get(n)!r}->{run.get(n)!r}" for n in SHAPE_ARGS if saved.get(n) != run.get(n)]


def model_plan(
    ckpt: Checkpoint,
    saved_args: dict[str, Any],
    args: dict[str, Any],
    saved_tp: int,
    target_tp: int,
    vocab_set: bool,
    extra_state_local: bool = False,
) -> KeyPlan:
    """``extra_state_local``: the run keeps its modules' ``_extra_state`` local (Megatron-LM's
    ``--ckpt-drop-redundant-extra-state`` with a recipe that saves no delayed-scaling state): none is requested."""
    plan = KeyPlan()
    saved_dims = dims_of(saved_args, padded_vocab(saved_args, saved_tp, True))
    run_dims = dims_of(args, padded_vocab(args, target_tp, vocab_set))
    saved_layers, run_layers = (saved_dims.layers, run_dims.layers) if saved_dims and run_dims else (0, 0)
    mismatch: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None
    vocab_note: str | None = None
    new_layer_keys: dict[str, str] = {}
    for entry in ckpt.section_entries("model"):
        key = logical(entry.key, entry.kind)
        shape = tuple(entry.shape) if entry.shape is not None and entry.kind == "tensor" else None
        plan.present[key] = shape
        indexed = layer_index(key)
        if indexed and saved_layers and run_layers:
            prefix, layer, rest = indexed
            if layer >= run_layers:
                continue  # a dropped layer: requested by no rank
            if layer == 0:
                for extra in range(saved_layers, run_layers):
                    new_layer_keys[f"{prefix}.{extra}.{rest}"] = entry.kind
        if shape is None:
            plan.requested[key] = None
            continue
        want = target_shape(key, shape, saved_dims, run_dims)
        plan.requested[key] = want
        if want == shape:
            continue
        if VOCAB_KEYS.search(key) and want[1:] == shape[1:]:
            vocab_note = f"padded vocabulary {shape[0]} -> {want[0]} (allowed mismatch)"
        elif mismatch is None:
            mismatch = (key, shape, want)
    for key, kind in new_layer_keys.items():
        plan.requested[key] = None
        plan.unexpected.add(key)
        if kind == "bytes":
            plan.unexpected_objects[key] = f"{key}/shard_0_1"
    _expert_flip(saved_args, args, plan)
    _qk_layernorm_flip(args, plan, run_dims.kv if run_dims else 0)
    _output_layer_flip(args, plan)
    _layer_keying_flip(saved_args, args, plan, run_layers)
    _extra_state_requests(plan, saved_layers, extra_state_local)
    frozen = _frozen_base(saved_args, plan)
    lost = None if frozen is not None or saved_args.get("save_trainable_params_only") else _lost_modules(args, plan)
    changes = changed_args(saved_args, args)
    changes += [
        f"{n} {saved_args.get(n)!r}->{args.get(n)!r}"
        for n in SPEC_ARGS
        if n in args and bool(saved_args.get(n)) != bool(args.get(n))
    ]
    if changes:
        plan.fix = f"the run's model args differ ({', '.join(changes)}): use the saved values"
    elif plan.absent_extra_state and not extra_state_local:
        plan.fix = ABSENT_EXTRA_STATE_FIX
    if mismatch is not None:
        key, shape, want = mismatch
        plan.shape_failure = SectionVerdict(
            "model",
            FAILS,
            f"global shape of {key} differs: saved {list(shape)}, requested {list(want)}",
            f"CheckpointingException: Global shape mismatch for loaded (torch.Size({list(shape)})) and expected "
            f"({want}) tensor for key {key}",
            plan.fix or "make the run's model args match the checkpoint",
            len(plan.requested),
            len(plan.present),
        )
    plan.why = vocab_note or frozen or lost
    return plan


_DENSE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _frozen_base(saved_args: dict[str, Any], plan: KeyPlan) -> str | None:
    """A trainable-params-only save lacks the frozen base; Megatron-LM's load_checkpoint requests it all."""
    if not saved_args.get("save_trainable_params_only"):
        return None
    base = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if saved_args.get("untie_embeddings_and_output_weights"):
        base.add("output_layer.weight")
    base |= {key.split(".adapter.", 1)[0] + ".weight" for key in plan.present if ".adapter." in key}
    if not saved_args.get("num_experts"):  # every dense GPT layer's linears, whatever the spec
        base |= {f"decoder.layers.{name}.weight" for name in _DENSE_LINEARS}
    absent = base - set(plan.present)
    for key in absent:
        plan.requested[key] = None
        plan.unexpected.add(key)
    # The norms (fused into the linears or not), biases and experts depend on the spec, which the args do not
    # always say: what is counted is a lower bound.
    plan.unexpected_at_least = bool(absent)
    plan.fix = "load with a filtered request (Megatron-Bridge PEFT), or pass the base checkpoint too"
    return f"trainable-params-only save: the frozen base ({len(absent)}+ keys) is not in it" if absent else None


_PER_LAYER_RE = re.compile(r"^decoder\.layers\.\d+\.")


def _lost_modules(args: dict[str, Any], plan: KeyPlan) -> str | None:
    """Keys every GPT model of the run's args has, whatever its spec, that the checkpoint lacks (removed or renamed
    after the save: ``edit --remove``/``--rename``); the run requests them. The embedding, the untied output layer,
    the final layernorm and, for dense layers with standard attention, each layer's four linears; nothing for a
    hybrid (Mamba) model, nor the MLP of an MoE model or the QKV of multi-latent attention."""
    present = set(plan.present)
    if not any(key.startswith(("decoder.", "embedding.", "output_layer.")) for key in present):
        return None  # not a GPT decoder's keys
    if any(key.startswith("encoder.") for key in present) or args.get("hybrid_override_pattern"):
        return None  # an encoder-decoder or a hybrid (Mamba) model: other modules
    if args.get("is_hybrid_model"):
        return None
    wanted = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if args.get("untie_embeddings_and_output_weights"):
        wanted.add("output_layer.weight")
    linears = ["self_attention.linear_proj"] + (
        [] if args.get("multi_latent_attention") else ["self_attention.linear_qkv"]
    )
    if not args.get("num_experts"):
        linears += ["mlp.linear_fc1", "mlp.linear_fc2"]
    layers = args.get("num_layers")
    if any(_PER_LAYER_RE.match(key) for key in present):
        if isinstance(layers, int) and not isinstance(layers, bool) and 0 < layers <= 100_000:
            wanted |= {f"decoder.layers.{i}.{name}.weight" for i in range(layers) for name in linears}
    else:
        wanted |= {f"decoder.layers.{name}.weight" for name in linears}
    absent = sorted(wanted - present - set(plan.requested))
    for key in absent:
        plan.requested[key] = None
        plan.unexpected.add(key)
    if not absent:
        return None
    plan.fix = (
        "restore the keys (from the save's source, or the edit's backup), or load with a run whose model has the "
        "saved names"
    )
    example = absent[0]
    return (
        f"the checkpoint lacks {len(absent)} key(s) every model of these args has (e.g. {example}): removed or renamed?"
    )


def _extra_state_requests(plan: KeyPlan, layers: int, local: bool) -> None:
    """Each linear module whose weight is saved requests its ``_extra_state`` (Megatron's local spec saves None
    there, TE's spec its get_extra_state): one the checkpoint lacks (``edit --drop-redundant-extra-state``,
    Megatron-LM's ``--ckpt-drop-redundant-extra-state``) is requested and absent, unless the run keeps its extra
    state local, which requests none, saved or not."""
    modules = {k[: -len(".weight")] for k in plan.present if k.endswith(".weight")}
    absent = sorted(
        f"{m}._extra_state" for m in modules if module_family(m) and f"{m}._extra_state" not in plan.present
    )
    plan.absent_extra_state = absent
    if local:
        for key in [k for k in plan.requested if is_extra_state_key(k)]:
            del plan.requested[key]
        return
    for key in absent:
        plan.requested[key] = None
        plan.unexpected.add(key)
        plan.unexpected_objects[key] = f"{key}/shard_0_{layers or 1}"


def _qk_layernorm_flip(args: dict[str, Any], plan: KeyPlan, kv: int) -> None:
    """The run requests q_layernorm/k_layernorm iff its spec has them (Megatron-LM's ``--use-checkpoint-args``
    does not copy qk_layernorm): without, the saved ones are requested by no rank (ignored unless ``*_all``
    strictness); with, on a checkpoint that lacks them, they are requested and absent."""
    saved = sorted(k for k in plan.present if any(n in k for n in _QK_NORMS))
    run_has = bool(args["qk_layernorm"]) if "qk_layernorm" in args else bool(saved)
    if saved and not run_has:
        for key in saved:
            plan.requested.pop(key, None)
            plan.ignored.add(key)
    elif run_has and not saved and "decoder.layers.self_attention.linear_qkv.weight" in plan.present:
        layers = plan.present["decoder.layers.self_attention.linear_qkv.weight"]
        for norm in _QK_NORMS:
            key = f"decoder.layers.{norm}weight"
            plan.requested[key] = (layers[0], kv) if layers and kv else None
            plan.unexpected.add(key)


def _per_layer_keys(args: dict[str, Any]) -> bool:
    """Megatron keys layers by index (``decoder.layers.<i>.``) when they are not all alike: a moe_layer_freq
    pattern (a list, or an int > 1) (``TransformerBlock.sharded_state_dict``: non_homogeneous_layers)."""
    freq = args.get("moe_layer_freq")
    return bool(args.get("num_experts")) and (
        isinstance(freq, list) or (isinstance(freq, int) and not isinstance(freq, bool) and freq > 1)
    )


def _layer_keying_flip(saved_args: dict[str, Any], args: dict[str, Any], plan: KeyPlan, layers: int) -> None:
    """A run whose layers are keyed otherwise than the checkpoint's (stacked vs per layer) requests keys it lacks."""
    saved, run = _per_layer_keys(saved_args), _per_layer_keys(args)
    if saved == run:
        return
    for key in list(plan.present):
        indexed = layer_index(key)
        if saved and indexed and indexed[0] == "decoder.layers":
            plan.requested.pop(key, None)
            stacked = f"decoder.layers.{indexed[2]}"
            plan.requested[stacked] = None
            plan.unexpected.add(stacked)
        elif run and not indexed and key.startswith("decoder.layers."):
            plan.requested.pop(key, None)
            for i in range(layers):
                per_layer = f"decoder.layers.{i}.{key[len('decoder.layers.') :]}"
                plan.requested[per_layer] = None
                plan.unexpected.add(per_layer)


def _output_layer_flip(args: dict[str, Any], plan: KeyPlan) -> None:
    """Tied embeddings (``untie_embeddings_and_output_weights`` False) save no output_layer.weight (a last stage
    without the embedding saves its output layer as a replica of it). An untied run on a tied checkpoint requests
    it (absent); a tied run on an untied checkpoint requests it from no rank (ignored unless ``*_all``)."""
    if "untie_embeddings_and_output_weights" not in args:
        return
    untied = bool(args["untie_embeddings_and_output_weights"])
    if untied and _OUTPUT not in plan.present and _EMBEDDING in plan.present:
        plan.requested[_OUTPUT] = plan.requested.get(_EMBEDDING)
        plan.unexpected.add(_OUTPUT)
    elif not untied and _OUTPUT in plan.present:
        plan.requested.pop(_OUTPUT, None)
        plan.ignored.add(_OUTPUT)


def _expert_flip(saved_args: dict[str, Any], args: dict[str, Any], plan: KeyPlan) -> None:
    """Adding experts to a dense checkpoint requests router/expert keys it lacks."""
    if not saved_args.get("num_experts") and args.get("num_experts"):
        for key in _EXPERT_KEYS:
            plan.requested[key] = None
            plan.unexpected.add(key)
