"""Health rules (CKD5xx, ``check --health``): values that load without error but are not a trained model's.

They read the per-key and per-slice statistics of :mod:`ckptdoctor.values.health`, gathered during
``check --deep``'s one streaming pass (:mod:`.deep_decode`): an all-zero weight or an all-zero layer or expert of
a stacked weight, experts of one layer equal to each other, optimizer moments that contradict the iteration.
NaN and Inf stay CKD313. Padded vocab rows are never looked at alone: a weight is flagged only when a whole
key or a whole slice (one layer, one expert) is zero.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckptdoctor.formats.plain_dcp import adam_moment, parameter_name
from ckptdoctor.rules import ERROR, WARNING, Finding, family_rule, finding
from ckptdoctor.rules.structure import Scanned
from ckptdoctor.values.health import HealthScan, KeyStats, Moments

_rule = family_rule("health")

ZERO_WEIGHT = _rule(
    "CKD501",
    "zero-weight",
    ERROR,
    "--health: a weight, or one layer or expert of a stacked weight, is all zero",
    "No trained weight matrix or norm scale is exactly zero everywhere: a conversion that lost a tensor, an "
    "expert left unwritten or a zero-filled resize loads without error and trains on from a different model. "
    "Biases may be zero and are not flagged; nor are LoRA's linear_out weights (zero at initialisation).",
)
DUPLICATE_EXPERTS = _rule(
    "CKD502",
    "duplicate-experts",
    WARNING,
    "--health: two experts of one layer are equal in every tensor",
    "Trained experts diverge from their first step; two equal ones are a copy made by a conversion or a "
    "resharding that wrote one expert's weights into another's place.",
)
EXPERTS_ALL_EQUAL = _rule(
    "CKD503",
    "experts-all-equal",
    WARNING,
    "--health: all experts of a layer are equal, as in every MoE layer (upcycled or never trained?)",
    "An upcycled dense model starts with equal experts; after training they differ. Equal experts in every "
    "layer are an upcycled checkpoint never trained, or experts re-initialised from one copy.",
)
EXPERTS_EQUAL_IN_LAYER = _rule(
    "CKD504",
    "experts-equal-in-layer",
    ERROR,
    "--health: all experts of a layer are equal while other layers' experts differ",
    "Training moves every layer's experts apart alike; one layer whose experts are all copies of one was "
    "overwritten (a conversion broadcasting one expert, a load that fell back to one shard).",
)
LAYER_AT_INIT = _rule(
    "CKD505",
    "layer-at-init",
    WARNING,
    "--health: a layer's norm scales are exactly one (and its biases zero) while other layers' have moved",
    "Megatron initialises norm scales to one and biases to zero; training moves them in every layer. One layer "
    "still exactly at those values beside layers that moved was never trained, or was replaced by a fresh "
    "initialisation (a conversion that skipped it, a partial load).",
)
MOMENTS_ZERO = _rule(
    "CKD510",
    "optimizer-moments-zero",
    WARNING,
    "--health: every exp_avg and exp_avg_sq value is zero at an iteration > 0 (optimizer re-initialised?)",
    "Adam's moments are non-zero after its first step; all zero at a later iteration is a fresh optimizer saved "
    "as if resumed, and a resume from it restarts Adam's warm-up on a trained model.",
)
SECOND_MOMENT_NEGATIVE = _rule(
    "CKD511",
    "exp-avg-sq-negative",
    ERROR,
    "--health: an exp_avg_sq value is negative",
    "The second moment is an average of squares and never negative; a negative value is corruption, and "
    "Adam's sqrt of it gives NaN on the first step after the resume.",
)
MOMENT_MISSING = _rule(
    "CKD512",
    "optimizer-moment-missing",
    ERROR,
    "--health: a parameter has exp_avg but no exp_avg_sq in the optimizer state, or the reverse",
    "Adam keeps both moments for every parameter it steps; one without the other is a partly written or "
    "filtered optimizer section, which Megatron's load refuses or fills with a fresh state.",
)

RULES = [
    ZERO_WEIGHT,
    DUPLICATE_EXPERTS,
    EXPERTS_ALL_EQUAL,
    EXPERTS_EQUAL_IN_LAYER,
    LAYER_AT_INIT,
    MOMENTS_ZERO,
    SECOND_MOMENT_NEGATIVE,
    MOMENT_MISSING,
]

_MODEL_SPACE_MOMENT = re.compile(r"^optimizer\.state\.(exp_avg|exp_avg_sq)\.(.+)$")
_BUCKET_MOMENT = re.compile(r"^optimizer\.distributed\..*\.bucket_idx_\d+\.(exp_avg|exp_avg_sq)$")
_MAY_BE_ZERO = re.compile(r"(bias$|_bias$|\.adapter\.(.+\.)?linear_out\.weight$)")
_NORM_SCALE = re.compile(r"(norm\.weight|norm_weight)$")  # input_layernorm.weight, linear_qkv.layer_norm_weight, ...
_LAYER_IN_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_health(state: Scanned, scan: HealthScan) -> list[Finding]:
    """Every health rule on one iteration dir's statistics."""
    if state.checkpoint is None:
        return []
    path = state.shown
    flavour = state.checkpoint.flavour  # plain DCP: keys named the flavour's way; None for torch_dist
    model = {k: s for k, s in scan.keys.items() if state.checkpoint.entries[k].section == "model"}
    out = _zero_weights(path, model, flavour)
    out += _equal_experts(path, model)
    out += _layers_at_init(path, model, flavour)
    out += _optimizer(state, scan)
    return out


def _never_zero(key: str) -> bool:
    """A parameter kind that is never all zero when trained: weights and norm scales, not biases or LoRA's B."""
    return key.endswith("weight") and not _MAY_BE_ZERO.search(key)


def _parameter(key: str, flavour: str | None) -> str:
    """The key as the parameter it holds (a plain DCP flavour's cut parameters by their parameter's name)."""
    return key if flavour is None else parameter_name(key, flavour)


def _moment(key: str, flavour: str | None) -> tuple[str, str] | None:
    """``(moment, parameter)`` of a model-space Adam moment: torch_dist's ``optimizer.state.<moment>.<param>``,
    or the plain DCP flavour's naming (the moment last)."""
    if flavour is not None:
        return adam_moment(key, flavour)
    match = _MODEL_SPACE_MOMENT.match(key)
    return (match.group(1), match.group(2)) if match else None


def _slice_name(stats: KeyStats, index: tuple[int, ...]) -> str:
    return " ".join(f"{axis} {i}" for axis, i in zip(stats.axes, index))


def _zero_weights(path: Path, model: dict[str, KeyStats], flavour: str | None) -> list[Finding]:
    out = []
    for key, stats in model.items():
        if not _never_zero(_parameter(key, flavour)):
            continue
        whole = stats.whole()
        if whole.all_zero:
            out.append(finding(ZERO_WEIGHT, path, f"{key}: all {whole.count} values are zero"))
            continue
        zero = sorted(index for index, moments in stats.slices.items() if moments.all_zero and stats.axes)
        if zero:
            names = ", ".join(_slice_name(stats, index) for index in zero[:8])
            more = f" and {len(zero) - 8} more" if len(zero) > 8 else ""
            out.append(
                finding(ZERO_WEIGHT, path, f"{key}: {names}{more} all zero ({len(zero)} of {len(stats.slices)} slices)")
            )
    return out


def _equal_experts(path: Path, model: dict[str, KeyStats]) -> list[Finding]:
    """Experts compared per layer by every expert tensor's fingerprint (and count, zeros, sums: equal slices
    agree on all of them)."""
    # (expert module, layer) -> expert -> [(key, signature, all zero)]
    groups: dict[tuple[str, int | None], dict[int, list[tuple[str, tuple, bool]]]] = {}
    for key, stats in sorted(model.items()):
        if "expert" not in stats.axes:
            continue
        module = key.split("experts.experts.")[0]
        for index, moments in stats.slices.items():
            layer = index[0] if stats.axes[0] == "layer" else None
            expert = index[stats.axes.index("expert")]
            tensors = groups.setdefault((module, layer), {}).setdefault(expert, [])
            tensors.append((key, _signature(moments), moments.all_zero))
    layers: dict[tuple[str, int | None], list[list[int]]] = {}  # the classes of equal experts of each layer
    for group, experts in groups.items():
        by_values: dict[tuple, list[int]] = {}
        for expert, tensors in sorted(experts.items()):
            if all(zero for _, _, zero in tensors):  # an all-zero expert: CKD501 says it
                continue
            by_values.setdefault(tuple(sorted(tensors)), []).append(expert)
        layers[group] = list(by_values.values())
    out = []
    for (module, layer), classes in layers.items():
        where = f"{module}experts (layer {layer})" if layer is not None else f"{module}experts"
        count = sum(len(members) for members in classes)
        if len(classes) == 1 and count > 1:
            others_differ = any(len(c) > 1 for g, c in layers.items() if g != (module, layer))
            rule = EXPERTS_EQUAL_IN_LAYER if others_differ else EXPERTS_ALL_EQUAL
            why = "while other layers' experts differ" if others_differ else "(upcycled or never trained?)"
            out.append(finding(rule, path, f"{where}: all {count} experts are equal in every tensor {why}"))
            continue
        for members in classes:
            if len(members) > 1:
                names = ", ".join(map(str, members))
                out.append(finding(DUPLICATE_EXPERTS, path, f"{where}: experts {names} are equal in every tensor"))
    return out


def _layers_at_init(path: Path, model: dict[str, KeyStats], flavour: str | None) -> list[Finding]:
    """Layers whose every norm scale is exactly one and every bias exactly zero, where other layers' norm scales
    are not all one (a model at its initialisation throughout is not flagged: nothing moved)."""
    # layer -> whether each of its norm-scale slices is all one, each of its bias slices all zero
    scales: dict[int, list[bool]] = {}
    biases: dict[int, list[bool]] = {}
    for key, stats in model.items():
        name = _parameter(key, flavour)
        norm, bias = _NORM_SCALE.search(name) is not None, name.endswith("bias")
        if not (norm or bias) or "expert" in stats.axes:
            continue
        per_key = _LAYER_IN_KEY.search(key)
        for index, moments in stats.slices.items():
            if stats.axes[:1] == ("layer",):
                layer = index[0]
            elif per_key is not None:
                layer = int(per_key.group(1))
            else:
                continue  # not a layer's (final_layernorm)
            if norm:
                ones = moments.finite == moments.count > 0 and moments.low == moments.high == 1
                scales.setdefault(layer, []).append(ones)
            else:
                biases.setdefault(layer, []).append(moments.all_zero)
    at_init = sorted(layer for layer, ones in scales.items() if all(ones) and all(biases.get(layer, [])))
    moved = sorted(layer for layer, ones in scales.items() if not all(ones))
    if not at_init or not moved:
        return []
    names = ", ".join(map(str, moved[:8])) + (f" and {len(moved) - 8} more" if len(moved) > 8 else "")
    return [
        finding(
            LAYER_AT_INIT,
            path,
            f"layer {layer}: every norm scale exactly 1 and every bias 0, as initialised, while layer(s) {names} "
            "moved (never trained?)",
        )
        for layer in at_init
    ]


def _signature(moments: Moments) -> tuple:
    return (moments.fingerprint, moments.count, moments.zeros, moments.total, moments.total_sq, moments.nan)


def _optimizer(state: Scanned, scan: HealthScan) -> list[Finding]:
    assert state.checkpoint is not None
    path = state.shown
    out = []
    flavour = state.checkpoint.flavour
    moments: dict[str, Moments] = {}
    for key, stats in scan.keys.items():
        model_space = _moment(key, flavour)
        if model_space is None and _BUCKET_MOMENT.match(key) is None:
            continue
        whole = stats.whole()
        moments[key] = whole
        kind = model_space[0] if model_space else key.rsplit(".", 1)[1]
        # a bucket's padding is never written (torch.empty): only model-space moments are read element-wise
        if model_space and kind == "exp_avg_sq" and whole.low is not None and whole.low < 0:
            negative = f"smallest {whole.low:g}"
            out.append(finding(SECOND_MOMENT_NEGATIVE, path, f"{key}: negative values ({negative})"))
    iteration = (state.common or {}).get("iteration")
    if iteration is None and flavour is not None:  # FSDP2 / TorchTitan keep no Megatron items: the dir's step-<N>
        iteration = state.checkpoint.location.iteration
    if moments and all(m.all_zero for m in moments.values()) and isinstance(iteration, int) and iteration > 0:
        out.append(
            finding(
                MOMENTS_ZERO,
                path,
                f"all {len(moments)} exp_avg/exp_avg_sq tensors are zero at iteration {iteration} "
                "(optimizer re-initialised?)",
            )
        )
    out += _missing_moments(state)
    return out


def _missing_moments(state: Scanned) -> list[Finding]:
    """Model-space parameters with one Adam moment and not the other (from the keys: no values needed)."""
    assert state.checkpoint is not None
    flavour = state.checkpoint.flavour
    present: dict[str, dict[str, str]] = {}  # parameter -> moment -> key
    for key in state.checkpoint.entries:
        match = _moment(key, flavour)
        if match is not None:
            present.setdefault(match[1], {})[match[0]] = key
    out = []
    for parameter, kinds in sorted(present.items()):
        if len(kinds) == 1:
            ((has, key),) = kinds.items()
            lacks = "exp_avg_sq" if has == "exp_avg" else "exp_avg"
            held = f"optimizer.state.{has}" if flavour is None else key
            out.append(finding(MOMENT_MISSING, state.shown, f"{parameter}: {held} without {lacks}"))
    return out
