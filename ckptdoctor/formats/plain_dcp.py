"""Plain PyTorch DCP checkpoints (no Megatron ``metadata.json``): which writer's conventions a state dict follows.

``torch.distributed.checkpoint.save`` with its default planner flattens the nested state dict into dotted keys and
records the mapping in ``.metadata``'s ``planner_data`` (Megatron's torch_dist saves with
``flatten_state_dict=False``: its ``planner_data`` is None). The flavours told apart here, from keys alone:

- Megatron-LM ``--ckpt-format torch_dcp``: ``generate_state_dict``'s dict saved by DCP itself, so ``args`` and
  ``iteration`` are top-level bytes items and the model is ``model.<name>`` (``model<i>.`` per VPP chunk).
- Megatron-FSDP ``--ckpt-format fsdp_dtensor``: the same top-level items, with megatron-core's
  ``fsdp_dtensor_checkpoint`` preprocessing: SwiGLU ``linear_fc1`` split into ``<name>_w``/``<name>_v`` halves
  (``handle_swiglu_in_state_dict``), grouped experts as ``weight<E>``, MTP layers under ``mtp.layers``.
- FSDP2 / TorchTitan: ``optimizer.`` from ``get_optimizer_state_dict`` and TorchTitan's ``train_state``,
  ``dataloader.*`` (one entry per data-parallel rank) and ``lr_scheduler``, the model either under ``model.``
  (``get_model_state_dict`` as one item; TorchTitan up to v0.1.0) or at the top level (TorchTitan since v0.2.0:
  ``CheckpointManager._flattened_model_states_sd`` merges the model's keys into the state dict, and its optimizer
  keys are ``optimizer.state.<fqn>.<state>``/``optimizer.param_groups.<fqn>.<option>``).
- generic: any other ``dcp.save``, TorchTitan's model-only saves among them (its last step with
  ``last_save_model_only``, its step-0 seed): the model's keys alone, nothing in them names the writer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

FLAVOUR_TORCH_DCP = "torch_dcp"
FLAVOUR_FSDP_DTENSOR = "fsdp_dtensor"
FLAVOUR_FSDP2 = "fsdp2"
FLAVOUR_GENERIC = "generic"

FLAVOUR_NAMES = {
    FLAVOUR_TORCH_DCP: "Megatron-LM torch_dcp",
    FLAVOUR_FSDP_DTENSOR: "Megatron-FSDP fsdp_dtensor",
    FLAVOUR_FSDP2: "FSDP2 / TorchTitan",
    FLAVOUR_GENERIC: "plain PyTorch DCP",
}

# the items Megatron-LM's generate_state_dict puts beside the model, which torch_dcp / fsdp_dtensor load first
MEGATRON_TOP_ITEMS = ("args", "iteration")
MEGATRON_COMMON_ITEMS = ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far")
# megatron-core's handle_swiglu_in_state_dict: fc1 weight (or bias) cut into its gate and up halves
_SWIGLU_SPLIT_RE = re.compile(r"\.linear_fc1\.(weight|bias)[0-9]*_[wv]\Z")

# TorchTitan's ParallelAwareDataloader: its state under dp_rank_<r> (beside the replicated world_size of v0.2.0 on)
_PER_RANK_DATALOADER_RE = re.compile(r"^dataloader\.dp_rank_[0-9]+(?:\.|\Z)")
# TorchTitan names a checkpoint dir step-<N> under the save dir (CheckpointManager._create_checkpoint_id)
STEP_DIR_RE = re.compile(r"^step-([0-9]+)\Z")

_TOP_LEVEL_SECTIONS = (
    ("optimizer.", "optimizer"),
    ("optimizer_", "optimizer"),
    ("rng_state", "rng"),
    ("rerun_state_machine", "rerun"),
)
MODEL_PREFIX = "model."
_FSDP2_MARKERS = ("model.", "optimizer.", "train_state", "dataloader.", "lr_scheduler")
# TorchTitan's states beside the model (CheckpointManager's TRAIN_STATE, DATALOADER, LR_SCHEDULER): with the model
# flattened to the top level, every other key is the model's
_FSDP2_OTHER_STATES = ("train_state", "dataloader", "lr_scheduler")

# torch's optimizer state_dict flattened by DCP puts the state's name last: FSDP2's get_optimizer_state_dict keys
# the state by parameter FQN (optimizer.state.layers.0.weight.exp_avg), Megatron-LM's torch_dcp by parameter index
# (optimizer.state.3.exp_avg; optimizer.optimizer.state.3.exp_avg under Megatron's mixed-precision optimizer,
# optimizer.<i>. per chained optimizer), Megatron-FSDP by the wrapped module's FQN (optimizer.state.module.module.
# module.<name>.exp_avg)
_ADAM_MOMENT_RE = re.compile(r"^optimizer\.(?:[0-9]+\.)?(?:optimizer\.)?state\.(.+)\.(exp_avg|exp_avg_sq)\Z")
_WRAPPER_PREFIX_RE = re.compile(r"^(?:module\.)+")
# Megatron-FSDP's per-parameter cuts: SwiGLU halves (weight_w, weight_v) and grouped experts (weight<E>, also
# Megatron-LM torch_dcp's: Transformer Engine's GroupedLinear registers weight0..weight<E-1>)
_CUT_PARAMETER_RE = re.compile(r"\.(weight|bias)[0-9]*(?:_[wv])?\Z")
# One expert's tensor in its own key, the expert index in the name (megatron-core's get_expert_index_from_key:
# SequentialMLP's local_experts.<E>., TEGroupedMLP's linear_fc<n>.weight<E> with fsdp_dtensor's _w/_v after it;
# Hugging Face-style modules, as FSDP2 or a generic save name them: experts.<E>.)
_SEQUENTIAL_EXPERT_RE = re.compile(r"^((?:.*\.)?experts)\.local_experts\.([0-9]+)\.(.+)\Z")
_GROUPED_EXPERT_RE = re.compile(r"^((?:.*\.)?experts)\.(linear_fc[0-9]+\.(?:weight|bias))([0-9]+)((?:_[wv])?)\Z")
_NUMBERED_EXPERT_RE = re.compile(r"^((?:.*\.)?experts)\.([0-9]+)\.(.+)\Z")
# Every expert of a layer in one parameter, stacked on dim 0 ([E, ...]): TorchTitan's GroupedExperts (w1, w2, w3;
# gate_proj, up_proj, down_proj in later releases, with their _bias)
_STACKED_EXPERTS_RE = re.compile(r"^((?:.*\.)?experts)\.((?:w[123]|(?:gate|up|down|gate_up)_proj)(_bias)?)\Z")


def is_megatron(flavour: str | None) -> bool:
    """Whether a flavour is Megatron-LM's (its state dict holds args and iteration)."""
    return flavour in (FLAVOUR_TORCH_DCP, FLAVOUR_FSDP_DTENSOR)


def flavour_of(kinds: dict[str, str]) -> str:
    """The flavour of a plain DCP state dict, given each flattened key's kind (``tensor`` or ``bytes``)."""
    if all(kinds.get(name) == "bytes" for name in MEGATRON_TOP_ITEMS):
        if any(_SWIGLU_SPLIT_RE.search(key) for key in kinds):
            return FLAVOUR_FSDP_DTENSOR
        return FLAVOUR_TORCH_DCP
    if any(key.startswith(_FSDP2_MARKERS) for key in kinds):
        return FLAVOUR_FSDP2
    return FLAVOUR_GENERIC


def megatron_flavour(flavour: str, args: dict) -> str:
    """A Megatron-LM flavour told from keys, corrected by the saved args: a Megatron-FSDP save without SwiGLU has
    no ``_w``/``_v`` keys, but its args say ``ckpt_format='fsdp_dtensor'`` (or ``use_megatron_fsdp``)."""
    if args.get("ckpt_format") == FLAVOUR_FSDP_DTENSOR or args.get("use_megatron_fsdp") is True:
        return FLAVOUR_FSDP_DTENSOR
    if args.get("ckpt_format") == FLAVOUR_TORCH_DCP:
        return FLAVOUR_TORCH_DCP
    return flavour


def section_of(key: str, flavour: str) -> str:
    """A flattened key's section: ``model.`` (``model<i>.``) is the model, ``optimizer.`` the optimizer, the RNG and
    rerun states theirs, and the rest (train state, dataloader, scheduler, args) ``other``; in a generic save
    without a ``model.`` prefix every key but the optimizer's is a model key, and in an FSDP2 / TorchTitan save
    every key but the optimizer's and TorchTitan's other states' (its model at the top level or under ``model.``)."""
    for prefix, section in _TOP_LEVEL_SECTIONS:
        if key.startswith(prefix):
            return section
    if flavour == FLAVOUR_GENERIC:
        return "model"
    if flavour == FLAVOUR_FSDP2:
        # lr_scheduler_<i>: one item per scheduler in TorchTitan's early releases
        return "other" if key.split(".", 1)[0].startswith(_FSDP2_OTHER_STATES) else "model"
    head = key.split(".", 1)[0]
    if head == "model" or (head.startswith("model") and head[5:].isdigit()):
        return "model"
    return "other"


def model_under_prefix(model_keys: Iterable[str], flavour: str | None) -> bool | None:
    """Whether an FSDP2 / TorchTitan or generic save keeps its model under ``model.`` (TorchTitan up to v0.1.0,
    ``get_model_state_dict`` saved as one item: True) or at the top level (TorchTitan since v0.2.0 and its
    model-only saves: False); None for the Megatron flavours, a torch_dist save, no model keys or a mix."""
    if flavour not in (FLAVOUR_FSDP2, FLAVOUR_GENERIC):
        return None
    prefixed = {key.startswith(MODEL_PREFIX) for key in model_keys}
    return prefixed.pop() if len(prefixed) == 1 else None


def has_planner_mapping(planner_data: object) -> bool:
    """Whether ``.metadata``'s ``planner_data`` is the flattening map of DCP's default planner (plain DCP), not
    Megatron torch_dist's None."""
    return isinstance(planner_data, dict) and bool(planner_data)


def step_number(name: str) -> int | None:
    """The step of a TorchTitan ``step-<N>`` dir name; None for any other name."""
    match = STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def per_rank_keys(keys: Iterable[str]) -> list[str]:
    """Keys that hold one rank's private state (TorchTitan's ``dataloader.dp_rank_<r>``): DCP loads them only at
    the world size that wrote them."""
    return [key for key in keys if _PER_RANK_DATALOADER_RE.match(key)]


def adam_moment(key: str, flavour: str) -> tuple[str, str] | None:
    """``(moment, parameter)`` of a plain DCP key holding an Adam moment (``exp_avg`` or ``exp_avg_sq``) in the
    flavour's naming, the parameter as the optimizer names it (FQN, or index for Megatron-LM's torch_dcp;
    Megatron-FSDP's wrapper prefixes dropped); None for any other key."""
    match = _ADAM_MOMENT_RE.match(key)
    if match is None:
        return None
    parameter = match.group(1)
    if flavour == FLAVOUR_FSDP_DTENSOR:
        parameter = _WRAPPER_PREFIX_RE.sub("", parameter)
    return match.group(2), parameter


def parameter_name(key: str, flavour: str) -> str:
    """A model key named as the parameter it holds, for telling weights from biases and norm scales: Megatron-FSDP
    cuts ``linear_fc1.weight`` into ``weight_w``/``weight_v``, grouped experts' weights are ``weight<E>`` (both
    Megatron flavours), and TorchTitan's stacked experts' weights are named ``w1`` (``.weight`` added here)."""
    if is_megatron(flavour):
        return _CUT_PARAMETER_RE.sub(lambda match: "." + match.group(1), key)
    stacked = _STACKED_EXPERTS_RE.match(key)
    if stacked is not None:
        return key[: -len("_bias")] + ".bias" if stacked.group(3) else key + ".weight"
    return key


@dataclass(frozen=True)
class ExpertKey:
    """Where a key sits among a MoE layer's experts."""

    module: str  # the layer's experts module (``model.module.decoder.layers.0.mlp.experts``)
    tensor: str  # the tensor within one expert, the same name for every expert (``linear_fc1.weight_w``)
    expert: int | None  # the expert the key holds; None: the key stacks every expert on dim 0


def expert_key(key: str) -> ExpertKey | None:
    """The experts module, tensor and expert of a plain DCP key holding one expert's tensor (Megatron's
    ``experts.local_experts.<E>.<tensor>`` and ``experts.linear_fc<n>.weight<E>[_w|_v]``, the Hugging Face-style
    ``experts.<E>.<tensor>``) or every expert's (TorchTitan's ``experts.w1`` ``[E, ...]``); None for any other key.
    The flavours' namings do not overlap, so every key is parsed against all of them: a generic ``dcp.save`` of a
    Megatron model names its experts Megatron's way."""
    sequential = _SEQUENTIAL_EXPERT_RE.match(key) or _NUMBERED_EXPERT_RE.match(key)
    if sequential is not None:
        return ExpertKey(sequential.group(1), sequential.group(3), int(sequential.group(2)))
    grouped = _GROUPED_EXPERT_RE.match(key)
    if grouped is not None:
        return ExpertKey(grouped.group(1), grouped.group(2) + grouped.group(4), int(grouped.group(3)))
    stacked = _STACKED_EXPERTS_RE.match(key)
    if stacked is not None:
        return ExpertKey(stacked.group(1), stacked.group(2), None)
    return None


def stacks_experts(key: str) -> bool:
    """Whether a key holds every expert of a layer stacked on dim 0 (TorchTitan's ``experts.w1``): its statistics
    are kept per expert, as torch_dist's ``experts.experts.`` keys' are."""
    return _STACKED_EXPERTS_RE.match(key) is not None
