"""Health rules (CKD5xx, ``check --health``): values that load without error but are not a trained model's.

They read the per-key and per-slice statistics of :mod:`ckptdoctor.values.health`, gathered during
``check --deep``'s one streaming pass (:mod:`.deep_decode`): an all-zero weight or an all-zero layer or expert of
a stacked weight, experts of one layer equal to each other, optimizer moments that contradict the iteration.
NaN and Inf stay CKD313. Padded vocab rows are never looked at alone: a weight is flagged only when a whole
key or a whole slice (one layer, one expert) is zero.

:class:`HealthSettings` holds what a repository may tune (``[tool.ckptdoctor.health-rules]``): keys the rules
leave out and the tolerances of the test for weights at Megatron's initialisation.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor.args import saved_config
from ckptdoctor.formats.plain_dcp import adam_moment, expert_key, parameter_name
from ckptdoctor.init_std import InitStds, megatron_init_stds
from ckptdoctor.optimizer_keys import chain_prefix, is_bucket_key, state_of
from ckptdoctor.rules import ERROR, WARNING, Finding, family_rule, finding
from ckptdoctor.rules.structure import Scanned
from ckptdoctor.values.health import HealthScan, KeyStats
from ckptdoctor.values.moments import KINDS, Moments, moment_values

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
    "--health: a layer is as Megatron initialises one (norm scales exactly one and biases zero, or weights "
    "matching its init for the saved init_method_std) while other layers have moved",
    "Megatron initialises norm scales to one, biases to zero and weights from normal(0, init_method_std), the "
    "output layers (linear_proj, linear_fc2) from normal(0, init_method_std / sqrt(2 num_layers)); training "
    "moves them in every layer. One layer still at those values beside layers that moved was never trained, or "
    "was replaced by a fresh initialisation (a conversion that skipped it, a partial load). The weights' test is "
    "statistical: each dense weight of the layer has a std within `init-std-tolerance` (relative, default 0.1) "
    "of its init std and a mean within `init-mean-tolerance` (x the init std, default 0.1) of zero, or five "
    "standard errors where a small tensor needs more, while in at least as many other layers a weight does not "
    "([tool.ckptdoctor.health-rules]). A model at its initialisation throughout is not flagged: nothing moved. "
    "Skipped where the saved args use another init (use_mup, init_method_xavier_uniform); experts and LoRA "
    "adapters are not tested.",
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

_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
_MAY_BE_ZERO = re.compile(r"(bias$|_bias$|\.adapter\.(.+\.)?linear_out\.weight$)")
_NORM_SCALE = re.compile(r"(norm\.weight|norm_weight)$")  # input_layernorm.weight, linear_qkv.layer_norm_weight, ...
_LAYER_IN_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DENSE_WEIGHT = re.compile(r"(?:^|\.)(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight$")
_OUTPUT_LAYERS = ("linear_proj", "linear_fc2")  # drawn by TransformerConfig's output_layer_init_method
# A slice at its init is within this many standard errors of the init std and zero mean (small tensors)
STANDARD_ERRORS = 5.0


@dataclass(frozen=True)
class HealthSettings:
    """The CKD5xx rules' settings (``[tool.ckptdoctor.health-rules]``; never read from a checkpoint)."""

    ignore_keys: list[str] = field(default_factory=list)  # fnmatch globs of checkpoint keys the rules leave out
    init_std_tolerance: float = 0.1  # relative: |std / init std - 1| at most this is "at its init"
    init_mean_tolerance: float = 0.1  # |mean| at most this times the init std is "at its init"

    def ignored(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, glob) for glob in self.ignore_keys)


def check_health(state: Scanned, scan: HealthScan, settings: HealthSettings | None = None) -> list[Finding]:
    """Every health rule on one iteration dir's statistics (keys matching ``settings.ignore_keys`` left out)."""
    if state.checkpoint is None:
        return []
    settings = settings or HealthSettings()
    path = state.shown
    kept = {k: s for k, s in scan.keys.items() if not settings.ignored(k)}
    flavour = state.checkpoint.flavour  # plain DCP: keys named the flavour's way; None for torch_dist
    model = {k: s for k, s in kept.items() if state.checkpoint.entries[k].section == "model"}
    out = _zero_weights(path, model, flavour)
    out += _equal_experts(path, _expert_tensors(model, flavour))
    out += _layers_at_init(path, model, flavour, _init_stds(state), settings)
    out += _optimizer(state, kept, settings)
    return out


def _init_stds(state: Scanned) -> InitStds | None:
    """Megatron's init stds for the saved args; None without args."""
    if state.common is None or state.checkpoint is None:
        return None
    args, _ = saved_config(state.common, state.checkpoint.iteration_dir)
    return megatron_init_stds(args)


def _layer_of(key: str, stats: KeyStats, index: tuple[int, ...]) -> int | None:
    """The decoder layer of one slice: its stacked layer index, or the layer named in a per-layer key."""
    if stats.axes[:1] == ("layer",):
        return index[0]
    per_key = _LAYER_IN_KEY.search(key)
    return int(per_key.group(1)) if per_key is not None else None


def _is_expert(key: str, stats: KeyStats, flavour: str | None) -> bool:
    """Whether a key holds experts' tensors: stacked per expert, or one expert's in a plain DCP save."""
    return "expert" in stats.axes or (flavour is not None and expert_key(key) is not None)


def _never_zero(key: str) -> bool:
    """A parameter kind that is never all zero when trained: weights and norm scales, not biases or LoRA's B."""
    return key.endswith("weight") and not _MAY_BE_ZERO.search(key)


def _parameter(key: str, flavour: str | None) -> str:
    """The key as the parameter it holds (a plain DCP flavour's cut parameters by their parameter's name)."""
    return key if flavour is None else parameter_name(key, flavour)


def _moment(key: str, flavour: str | None) -> tuple[str, str] | None:
    """``(moment, parameter)`` of a model-space Adam moment: torch_dist's ``optimizer.state.<moment>.<param>`` (a
    chained optimizer's ``chained_<i>.`` in front), or the plain DCP flavour's naming (the moment last)."""
    if flavour is not None:
        return adam_moment(key, flavour)
    state = state_of(key)
    return state if state is not None and state[0] in _ADAM_MOMENTS else None


def _bucket_moment(key: str) -> bool:
    """A ``dp_reshardable`` bucket of an Adam moment (``...bucket_idx_<k>.exp_avg``), chained or not."""
    return is_bucket_key(key) and key.rsplit(".", 1)[1] in _ADAM_MOMENTS


def _slice_name(stats: KeyStats, index: tuple[int, ...]) -> str:
    return " ".join(f"{axis} {i}" for axis, i in zip(stats.axes, index))


def _zero_weights(path: Path, model: dict[str, KeyStats], flavour: str | None) -> list[Finding]:
    out = []
    for key, stats in model.items():
        if not _never_zero(_parameter(key, flavour)):
            continue
        whole = stats.whole()
        if whole.all_zero:
            out.append(
                finding(ZERO_WEIGHT, path, f"{key}: all {whole.count} values are zero{_expert_in(key, flavour)}")
            )
            continue
        zero = sorted(index for index, moments in stats.slices.items() if moments.all_zero and stats.axes)
        if zero:
            names = ", ".join(_slice_name(stats, index) for index in zero[:8])
            more = f" and {len(zero) - 8} more" if len(zero) > 8 else ""
            out.append(
                finding(ZERO_WEIGHT, path, f"{key}: {names}{more} all zero ({len(zero)} of {len(stats.slices)} slices)")
            )
    return out


def _expert_in(key: str, flavour: str | None) -> str:
    """`` (layer L expert E)`` for a plain DCP key holding one expert's tensor, as torch_dist's slices are named."""
    parsed = expert_key(key) if flavour is not None else None
    if parsed is None or parsed.expert is None:
        return ""
    layer = _LAYER_IN_KEY.search(key)
    return f" (layer {layer.group(1)} expert {parsed.expert})" if layer else f" (expert {parsed.expert})"


@dataclass(frozen=True)
class _ExpertTensor:
    """One expert's tensor: a slice of a stacked key (torch_dist's ``experts.experts.``, TorchTitan's ``[E, ...]``
    parameters) or a plain DCP key of its own (Megatron's ``local_experts.<E>.``, ``weight<E>``)."""

    module: str  # the experts module, as findings name it
    layer: int | None
    expert: int
    tensor: str  # the same name for this tensor in every expert of the layer
    moments: Moments


def _expert_tensors(model: dict[str, KeyStats], flavour: str | None) -> Iterator[_ExpertTensor]:
    """Every expert's tensors, each with the layer and expert it belongs to."""
    for key, stats in sorted(model.items()):
        if "expert" in stats.axes:
            parsed = expert_key(key) if flavour is not None else None
            module = parsed.module if parsed is not None else key.split("experts.experts.")[0] + "experts"
            for index, moments in stats.slices.items():
                yield _ExpertTensor(
                    module, _layer_of(key, stats, index), index[stats.axes.index("expert")], key, moments
                )
        elif flavour is not None and (parsed := expert_key(key)) is not None and parsed.expert is not None:
            # a per-expert key: its layer and expert from its name; fingerprinted as one slice, as its siblings
            yield _ExpertTensor(parsed.module, _layer_of(key, stats, ()), parsed.expert, parsed.tensor, stats.whole())


def _equal_experts(path: Path, tensors: Iterator[_ExpertTensor]) -> list[Finding]:
    """Experts compared per layer by every expert tensor's fingerprint (and count, zeros, sums: equal slices
    agree on all of them)."""
    # (expert module, layer) -> expert -> [(tensor, signature, all zero)]
    groups: dict[tuple[str, int | None], dict[int, list[tuple[str, tuple, bool]]]] = {}
    for one in tensors:
        in_layer = groups.setdefault((one.module, one.layer), {}).setdefault(one.expert, [])
        in_layer.append((one.tensor, _signature(one.moments), one.moments.all_zero))
    layers: dict[tuple[str, int | None], list[list[int]]] = {}  # the classes of equal experts of each layer
    for group, experts in groups.items():
        by_values: dict[tuple, list[int]] = {}
        for expert, expert_tensors in sorted(experts.items()):
            if all(zero for _, _, zero in expert_tensors):  # an all-zero expert: CKD501 says it
                continue
            by_values.setdefault(tuple(sorted(expert_tensors)), []).append(expert)
        layers[group] = list(by_values.values())
    out = []
    differing = sum(len(classes) > 1 for classes in layers.values())  # layers whose experts differ (counted once)
    for (module, layer), classes in layers.items():
        named = layer is None or _LAYER_IN_KEY.search(module + ".") is not None  # a per-layer module names it
        where = module if named else f"{module} (layer {layer})"
        count = sum(len(members) for members in classes)
        if len(classes) == 1 and count > 1:
            others_differ = differing > 0  # this layer, one class, is not among them
            rule = EXPERTS_EQUAL_IN_LAYER if others_differ else EXPERTS_ALL_EQUAL
            why = "while other layers' experts differ" if others_differ else "(upcycled or never trained?)"
            out.append(finding(rule, path, f"{where}: all {count} experts are equal in every tensor {why}"))
            continue
        for members in classes:
            if len(members) > 1:
                names = ", ".join(map(str, members))
                out.append(finding(DUPLICATE_EXPERTS, path, f"{where}: experts {names} are equal in every tensor"))
    return out


def _layers_at_init(
    path: Path, model: dict[str, KeyStats], flavour: str | None, stds: InitStds | None, settings: HealthSettings
) -> list[Finding]:
    """Layers at Megatron's initialisation while other layers moved: by their norm scales and biases (exactly one
    and zero), and by their dense weights' mean and std (``stds`` from the saved args). A model at its
    initialisation throughout is not flagged: nothing moved."""
    by_norms, norms_moved = _norms_at_init(model, flavour)
    with_biases = any(_parameter(key, flavour).endswith("bias") for key in model)
    by_weights, weights_moved = _weights_at_init(model, flavour, stds, settings) if stds is not None else (set(), set())
    out = []
    named: dict[tuple[bool, bool], str] = {}  # the layers that moved, as named, per kind of evidence (computed once)
    for layer in sorted(by_norms | by_weights):
        evidence = []
        if layer in by_norms:
            evidence.append("every norm scale exactly 1" + (" and every bias 0" if with_biases else ""))
        if layer in by_weights:
            assert stds is not None
            evidence.append(
                f"every weight's mean and std those of Megatron's init for init_method_std {stds.weight:g} "
                f"(normal(0, {stds.weight:g}); linear_proj, linear_fc2: normal(0, {stds.output:.4g}))"
            )
        kinds = (layer in by_norms, layer in by_weights)
        names = named.get(kinds)
        if names is None:
            moved = sorted((norms_moved if kinds[0] else set()) | (weights_moved if kinds[1] else set()))
            names = named[kinds] = ", ".join(map(str, moved[:8])) + (
                f" and {len(moved) - 8} more" if len(moved) > 8 else ""
            )
        out.append(
            finding(
                LAYER_AT_INIT,
                path,
                f"layer {layer}: {'; '.join(evidence)}, as initialised, while layer(s) {names} moved (never trained?)",
            )
        )
    return out


def _norms_at_init(model: dict[str, KeyStats], flavour: str | None) -> tuple[set[int], set[int]]:
    """(layers whose every norm scale is exactly one and every bias exactly zero, layers whose norm scales are
    not all one); the first empty unless the second is not."""
    # layer -> whether each of its norm-scale slices is all one, each of its bias slices all zero
    scales: dict[int, list[bool]] = {}
    biases: dict[int, list[bool]] = {}
    for key, stats in model.items():
        name = _parameter(key, flavour)
        norm, bias = _NORM_SCALE.search(name) is not None, name.endswith("bias")
        if not (norm or bias) or _is_expert(key, stats, flavour):
            continue
        for index, moments in stats.slices.items():
            layer = _layer_of(key, stats, index)
            if layer is None:
                continue  # not a layer's (final_layernorm)
            if norm:
                ones = moments.finite == moments.count > 0 and moments.low == moments.high == 1
                scales.setdefault(layer, []).append(ones)
            else:
                biases.setdefault(layer, []).append(moments.all_zero)
    at_init = {layer for layer, ones in scales.items() if all(ones) and all(biases.get(layer, []))}
    moved = {layer for layer, ones in scales.items() if not all(ones)}
    return (at_init, moved) if at_init and moved else (set(), set())


def _weights_at_init(
    model: dict[str, KeyStats], flavour: str | None, stds: InitStds, settings: HealthSettings
) -> tuple[set[int], set[int]]:
    """(layers whose every dense weight (linear_qkv, linear_proj, linear_fc1, linear_fc2; not experts, not LoRA
    adapters) has the mean and std of its Megatron init, layers where some does not); both empty unless at least
    as many layers moved as look at their init (an early checkpoint, where most layers have barely moved yet and a
    few have, is no layer left behind)."""
    per_layer: dict[int, list[bool]] = {}
    for key, stats in model.items():
        match = _DENSE_WEIGHT.search(_parameter(key, flavour))
        kind = KINDS.get(stats.dtype)
        if match is None or _is_expert(key, stats, flavour) or ".adapter." in key or kind is None or not kind.is_float:
            continue  # experts, LoRA adapters, and FP8 bytes (uint8) are not drawn from a normal init
        expected = stds.output if match.group(1) in _OUTPUT_LAYERS else stds.weight
        for index, moments in stats.slices.items():
            layer = _layer_of(key, stats, index)
            if layer is not None and moments.count >= 2 and moments.finite == moments.count:  # NaN/Inf: CKD313's
                per_layer.setdefault(layer, []).append(_at_init(moments, stats.dtype, expected, settings))
    at_init = {layer for layer, flags in per_layer.items() if all(flags)}
    moved = {layer for layer, flags in per_layer.items() if not all(flags)}
    return (at_init, moved) if at_init and len(moved) >= len(at_init) else (set(), set())


def _at_init(moments: Moments, dtype: str, expected: float, settings: HealthSettings) -> bool:
    """Whether one slice's values look drawn from normal(0, expected): std and mean within the tolerances, or
    within :data:`STANDARD_ERRORS` standard errors of a sample of its size where that is wider."""
    n = moments.count
    mean, std, _ = moment_values(moments, dtype)
    if mean is None or std is None:
        return False
    std_tolerance = max(settings.init_std_tolerance, STANDARD_ERRORS / math.sqrt(2 * n))
    mean_tolerance = max(settings.init_mean_tolerance, STANDARD_ERRORS / math.sqrt(n))
    return abs(std / expected - 1) <= std_tolerance and abs(mean) <= mean_tolerance * expected


def _signature(moments: Moments) -> tuple:
    return (moments.fingerprint, moments.count, moments.zeros, moments.total, moments.total_sq, moments.nan)


def _optimizer(state: Scanned, keys: dict[str, KeyStats], settings: HealthSettings) -> list[Finding]:
    assert state.checkpoint is not None
    path = state.shown
    out = []
    flavour = state.checkpoint.flavour
    moments: dict[str, Moments] = {}
    for key, stats in keys.items():
        model_space = _moment(key, flavour)
        if model_space is None and not _bucket_moment(key):
            continue
        whole = stats.whole()
        moments[key] = whole
        kind = model_space[0] if model_space else key.rsplit(".", 1)[1]
        # a bucket's padding (never written: torch.empty) is not measured, so its exp_avg_sq is read like any other
        if kind == "exp_avg_sq" and whole.low is not None and whole.low < 0:
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
    out += _missing_moments(state, settings)
    return out


def _missing_moments(state: Scanned, settings: HealthSettings) -> list[Finding]:
    """Model-space parameters with one Adam moment and not the other (from the keys: no values needed)."""
    assert state.checkpoint is not None
    flavour = state.checkpoint.flavour
    present: dict[str, dict[str, str]] = {}  # parameter -> moment -> key
    for key in state.checkpoint.entries:
        match = _moment(key, flavour)
        if match is not None and not settings.ignored(key):
            present.setdefault(match[1], {})[match[0]] = key
    out = []
    for parameter, kinds in sorted(present.items()):
        if len(kinds) == 1:
            ((has, key),) = kinds.items()
            lacks = "exp_avg_sq" if has == "exp_avg" else "exp_avg"
            held = f"{chain_prefix(key)}optimizer.state.{has}" if flavour is None else key
            out.append(finding(MOMENT_MISSING, state.shown, f"{parameter}: {held} without {lacks}"))
    return out
