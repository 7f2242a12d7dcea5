"""What a Transformer Engine ``_extra_state`` item holds, read through the safe unpickler (never through TE).

Megatron saves each TE module's ``get_extra_state()`` as a ShardedObject (``torch.save([obj])``); Megatron's
local spec saves None there. What ``obj`` is tells the TE generation that wrote it (TE's ``module/base.py``,
``get_extra_state``/``set_extra_state``, read in v1.13, v2.0, v2.5, v2.18-v2.20):

* TE 1.x: an ``io.BytesIO`` holding ``torch.save(state)``; ``state`` has the delayed-scaling tensors
  (``scale_fwd``, ``scale_inv_fwd``, ``amax_history_fwd`` and the ``_bwd`` three) and ``extra_fp8_variables``,
  no recipe (TE 1.x knew only delayed scaling).
* TE 2.0-2.3: a uint8 tensor of ``pickle.dumps(state)``, ``state`` None when FP8 is off. TE 2.0 and 2.1's
  DelayedScaling still has an ``interval`` field (TE 2.2 removed it): its pickled state tells those two apart.
* TE >= 2.4: an empty uint8 tensor when FP8 is off; otherwise ``pickle.dumps({"recipe": <recipe>, [the four
  delayed-scaling tensors,] "extra_fp8_variables": {...}})``.
* TE 2.16.1, 2.17.1 and >= 2.18: an empty uint8 tensor for stateless recipes too (current scaling, MXFP8, block
  scaling, NVFP4), which 2.0-2.17 pickled as ``{recipe, extra_fp8_variables}``.

TE PR #3123 (``pytorch/_extra_state.py``) classifies a uint8 payload by its pickle opcodes before unpickling it
and refuses the ones that need a real unpickle unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``
(:func:`te_refuses`); a ``BytesIO`` it always refuses without it. It shipped in 2.18.0 and was backported to the
2.16.1 and 2.17.1 patch releases; 2.16.0 and 2.17.0 have no classifier. The released wheels 2.16.1, 2.17.1,
2.18.0, 2.19.0 and 2.20.2 carry the same ``_extra_state.py`` byte for byte (sha256 580d8d32...) and the same
``get_extra_state``/``set_extra_state``, and the file has one commit in TE's history, so one model covers every
refusing release (:func:`refuses_pickled` decides which releases refuse); tests/test_te_classifier_live.py runs
each release's own classifier against it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickletools
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.errors import PickleLimitError, UnsafePickleError
from ckptdoctor.formats.archive import ArchiveError, is_torch_zip
from ckptdoctor.formats.legacy_torch import MAX_NESTED_SAVES, MAX_PAYLOAD, check_legacy_save
from ckptdoctor.formats.torch_zip import load_torch_zip
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.policy import UnlistedGlobal
from ckptdoctor.pickle.stand_ins import StandIn
from ckptdoctor.pickle.torch_stand_ins import TensorRef

EXTRA_STATE_SUFFIX = "._extra_state"
UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
TeVersion = tuple[int, int, int]  # a Transformer Engine release: (major, minor, patch)
REFUSING_TE: TeVersion = (2, 18, 0)  # from this release on, every set_extra_state refuses pickled state
# Older minor releases whose patch release got the classifier (#3123 backported): minor -> first refusing patch
REFUSING_PATCHES = {(2, 16): 1, (2, 17): 1}
REFUSING_RELEASES = "TE 2.16.1, 2.17.1 and >= 2.18"  # how messages name them
NEWEST_MODELLED_TE: TeVersion = (2, 20, 2)


def parse_te_version(text: str) -> TeVersion:
    """A Transformer Engine release from ``MAJOR.MINOR[.PATCH]`` (a suffix after the patch is ignored:
    ``2.19.0.dev0``; a missing patch is 0). 2.16 and 2.17 need their patch level: their .1 releases refuse what
    their .0 releases load. Raises ValueError naming the expected form."""
    parts = text.strip().split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]) or (len(parts) > 2 and not parts[2].isdigit()):
        raise ValueError(f"{text!r}: give MAJOR.MINOR[.PATCH], e.g. 2.18 or 2.17.1")
    major, minor = int(parts[0]), int(parts[1])
    if len(parts) == 2 and (major, minor) in REFUSING_PATCHES:
        first = REFUSING_PATCHES[(major, minor)]
        raise ValueError(
            f"{text!r}: give the patch release: {major}.{minor}.0 loads pickled extra state, "
            f"{major}.{minor}.{first} and later refuse it"
        )
    return major, minor, int(parts[2]) if len(parts) > 2 else 0


def format_te_version(version: TeVersion) -> str:
    return ".".join(str(part) for part in version)


def refuses_pickled(version: TeVersion | None) -> bool:
    """Whether TE ``version`` (None: the newest modelled) refuses pickled ``_extra_state`` without the opt-in."""
    major, minor, patch = version or NEWEST_MODELLED_TE
    first_patch = REFUSING_PATCHES.get((major, minor))
    return (major, minor, patch) >= REFUSING_TE or (first_patch is not None and patch >= first_patch)


# forms (what the item's object is)
FORM_NONE = "none"  # None: no TE module saved it (Megatron's local spec)
FORM_EMPTY = "empty"  # an empty uint8 tensor
FORM_PICKLED_NONE = "pickled-none"  # a uint8 tensor of pickle.dumps(None)
FORM_PICKLE = "pickle"  # a uint8 tensor of pickle.dumps(state)
FORM_BYTESIO = "bytesio"  # an io.BytesIO holding torch.save(state)
FORM_OTHER = "other"  # none of TE's forms

GEN_NONE = "no TE"
GEN_TE1 = "TE 1.x"
GEN_TE20 = "TE 2.0-2.3"
GEN_TE20_21 = "TE 2.0-2.1"  # a DelayedScaling with its ``interval`` field, which TE 2.2 removed
GEN_TE24 = "TE >= 2.4"
# a pickled stateless recipe: the refusing releases (2.16.1, 2.17.1, >= 2.18) save an empty tensor instead
GEN_TE2_STATELESS = "TE 2.0-2.17"
GEN_TE2 = "TE >= 2.0"
GEN_UNKNOWN = "unknown"

_RECIPE_MODULE = "transformer_engine.common.recipe"
DELAYED = "DelayedScaling"
STATELESS_RECIPES = ("Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling")
CUSTOM = "CustomRecipe"
# the classifier's policy by recipe class: stateful (needs the unsafe load) or not
_POLICY = {DELAYED: "stateful", **{name: "stateless" for name in STATELESS_RECIPES}, CUSTOM: "dynamic"}
DELAYED_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
# Megatron-LM's --ckpt-drop-redundant-extra-state (#5552) keeps an item only where its bytes hold one of these
NEEDED_KEYS = ("amax_history_fwd", "scale_fwd", "scale_bwd")
_FORMATS = {(448, 448): "E4M3", (57344, 57344): "E5M2", (448, 57344): "HYBRID", (6, 6): "E2M1"}
RECIPE_FIELDS = ("fp8_format", "margin", "interval", "amax_history_len", "amax_compute_algo", "fp8_dpa", "fp8_mha")


@dataclass
class ExtraState:
    """One ``_extra_state`` item as TE wrote it."""

    form: str
    generation: str
    fp8: bool  # FP8 state saved (a recipe or delayed-scaling tensors)
    payload_bytes: int  # the pickle's (or the BytesIO's) length
    recipe: str | None = None  # the recipe class's name (DelayedScaling, ...); None: no recipe saved
    recipe_fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, list[int]] = field(default_factory=dict)  # scale / amax / scale_inv shapes
    extra_fp8_variables: dict[str, Any] = field(default_factory=dict)
    needed: bool = False  # holds amax_history_fwd, scale_fwd or scale_bwd (Megatron-LM #5552's rule)
    # the refusing releases' action (TE 2.16.1, 2.17.1, >= 2.18; the name is the first minor that refuses):
    # "load", "ignore" (never unpickled) or "refuse" (needs the env var)
    te_2_18: str = "load"
    custom_factory: str | None = None  # a CustomRecipe's qfactory global: refused, never decoded
    note: str | None = None


# The Transformer Engine module megatron-core's TE layer specs build at each module path (megatron-core 0.19.2,
# gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec; grouped experts with moe_grouped_gemm): the family
# whose get_extra_state wrote an item at that path.
TE_MODULE_FAMILIES = {
    "self_attention.linear_qkv": "TELayerNormColumnParallelLinear",
    "self_attention.linear_proj": "TERowParallelLinear",
    "self_attention.core_attention": "TEDotProductAttention",
    "mlp.linear_fc1": "TELayerNormColumnParallelLinear",
    "mlp.linear_fc2": "TERowParallelLinear",
    "mlp.shared_experts.linear_fc1": "TEColumnParallelLinear",
    "mlp.shared_experts.linear_fc2": "TERowParallelLinear",
    "mlp.experts.linear_fc1": "TEColumnParallelGroupedLinear",
    "mlp.experts.linear_fc2": "TERowParallelGroupedLinear",
}


def module_family(module: str) -> str | None:
    """The TE module class megatron-core's TE spec puts at ``module`` (a path), or None where it builds none."""
    for suffix, family in TE_MODULE_FAMILIES.items():
        if module == suffix or module.endswith(f".{suffix}"):
            return family
    return None


def is_extra_state_key(key: str) -> bool:
    """A key (logical or ``.../shard_*``) of a TE ``_extra_state`` object; grouped linear saves ``_extra_state{i}``."""
    tail = key.split("/", 1)[0].rsplit(".", 1)[-1]
    suffix = tail[len("_extra_state") :]
    return tail.startswith("_extra_state") and (suffix == "" or suffix.isdigit())


def module_of(key: str) -> str:
    """The module path of an ``_extra_state`` key (``decoder.layers.mlp.linear_fc1``)."""
    return key.split("/", 1)[0].rsplit(".", 1)[0]


def describe_item(data: bytes, where: str, unlisted: list[UnlistedGlobal] | None = None) -> ExtraState:
    """:func:`describe` of a stored ``_extra_state`` item's bytes (``torch.save([obj])``, unwrapped here, so that
    a payload the gate refuses is still described: a CustomRecipe's factory)."""
    return describe(_unwrap(data, where, unlisted), where, unlisted)


def _unwrap(data: bytes, where: str, unlisted: list[UnlistedGlobal] | None) -> Any:
    """The object of a ShardedObject's bytes: ``torch.save([obj])``, or (PyTorch DCP re-saving what it loaded) a
    ``torch.save`` of a BytesIO holding that; TE 1.x's own BytesIO is the ``obj`` inside the list."""
    obj: Any = load_torch_zip(data, where, unlisted=unlisted) if is_torch_zip(data) else data
    if isinstance(obj, io.BytesIO) and is_torch_zip(obj.getvalue()[:4]):
        obj = load_torch_zip(obj.getvalue(), where, unlisted=unlisted)
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj


def comparable(data: bytes, where: str) -> dict[str, Any]:
    """An item as ``diff --values`` compares it: what :func:`describe` reads (not the payload's length) and a
    sha256 of each tensor's bytes, so two items that differ only in how they were pickled compare equal. Raises
    what the safe unpickler raises (the gate: a hostile item is never compared)."""
    obj = _unwrap(data, where, None)
    state = describe(obj, where)
    view = dataclasses.asdict(state)
    del view["payload_bytes"]
    view["tensor_data"] = _tensor_digests(obj, where)
    return view


def _tensor_digests(obj: Any, where: str) -> dict[str, str]:
    """sha256 of each tensor of the state by its key: the storage bytes of a TE 1.x archive, the raw data of
    the legacy save nested for each tensor of a TE 2.x pickle (in pickling order, the state's key order)."""
    if isinstance(obj, io.BytesIO):
        data = obj.getvalue()
        state = load_torch_zip(data, where) if is_torch_zip(data[:4]) else None
        if not isinstance(state, dict):
            return {}
        return {
            str(k): hashlib.sha256(v.storage.data()).hexdigest() for k, v in state.items() if isinstance(v, TensorRef)
        }
    if not isinstance(obj, TensorRef) or obj.dtype is None or obj.dtype.name != "uint8" or not obj.numel:
        return {}
    payload = bytes(obj.storage.data()[obj.storage_offset : obj.storage_offset + obj.numel])
    nested: list[bytes] = []
    state, _ = unpickler.loads_prefix(payload, None, None, nested_saves=nested)
    if len(nested) > MAX_NESTED_SAVES:
        raise PickleLimitError(f"{where}: extra state nests more than {MAX_NESTED_SAVES} torch saves")
    raw = [hashlib.sha256(save[check_legacy_save(save, where) :]).hexdigest() for save in nested]
    names = [str(k) for k, v in state.items() if isinstance(v, TensorRef)] if isinstance(state, dict) else []
    if len(names) != len(raw):  # shared or nested storages: compared as one list
        return {f"storage {i}": digest for i, digest in enumerate(raw)}
    return dict(zip(names, raw))


def describe(obj: Any, where: str, unlisted: list[UnlistedGlobal] | None = None) -> ExtraState:
    """What a decoded ``_extra_state`` object (``checkpoint.decode_object_bytes``) holds. Raises what the safe
    unpickler raises on the payload (:class:`UnsafePickleError`, :class:`PickleLimitError`), except for a
    CustomRecipe, whose factory is reported as refused."""
    if obj is None:
        return ExtraState(FORM_NONE, GEN_NONE, False, 0, te_2_18="ignore")
    if isinstance(obj, io.BytesIO):
        data = obj.getvalue()
        state = load_torch_zip(data, where, unlisted=unlisted) if is_torch_zip(data[:4]) else None
        out = ExtraState(FORM_BYTESIO, GEN_TE1, False, len(data), te_2_18="refuse")
        _read_state(out, state)
        return out
    if not isinstance(obj, TensorRef) or obj.dtype is None or obj.dtype.name != "uint8":
        return ExtraState(FORM_OTHER, GEN_UNKNOWN, False, 0, note=f"not a TE form: {type(obj).__name__}")
    if not obj.numel:
        return ExtraState(FORM_EMPTY, GEN_TE24, False, 0, te_2_18="ignore")
    if obj.numel > MAX_PAYLOAD:
        raise PickleLimitError(f"{where}: a uint8 extra state of {obj.numel} bytes exceeds the limit of {MAX_PAYLOAD}")
    payload = bytes(obj.storage.data()[obj.storage_offset : obj.storage_offset + obj.numel])
    action = te_refuses(payload)
    custom = _custom_factory(payload)
    if custom is not None:
        return ExtraState(
            FORM_PICKLE, GEN_TE2, True, len(payload), recipe=CUSTOM, te_2_18=action, custom_factory=custom
        )
    try:
        state, _ = unpickler.loads_prefix(payload, None, unlisted, nested_saves=[])
    except (UnsafePickleError, PickleLimitError) as exc:
        raise exc.located(f"{where}: Transformer Engine extra state") from None
    except Exception as exc:  # a corrupt pickle can raise almost anything: TE's pickle.loads would fail too
        raise ArchiveError(f"{where}: a uint8 extra state that is no pickle ({type(exc).__name__})") from None
    if state is None:
        return ExtraState(FORM_PICKLED_NONE, GEN_TE20, False, len(payload), te_2_18=action)
    out = ExtraState(FORM_PICKLE, GEN_TE2, False, len(payload), te_2_18=action)
    _read_state(out, state)
    if out.recipe in STATELESS_RECIPES:
        out.generation = GEN_TE2_STATELESS
    elif out.recipe == DELAYED and "interval" in out.recipe_fields:
        out.generation = GEN_TE20_21
    return out


def _read_state(out: ExtraState, state: Any) -> None:
    if state is None:  # TE 1.x with FP8 off: torch.save(None)
        return
    if not isinstance(state, dict):
        out.note = f"a state that is no dict: {type(state).__name__}"
        return
    for key, value in state.items():
        if isinstance(value, TensorRef):
            out.tensors[str(key)] = [int(x) for x in value.size]
    extra = state.get("extra_fp8_variables")
    if isinstance(extra, dict):
        out.extra_fp8_variables = {str(k): _plain(v) for k, v in extra.items()}
    recipe = state.get("recipe")
    if isinstance(recipe, StandIn):
        out.recipe = type(recipe).qualified_name().rsplit(".", 1)[-1]
        fields = recipe.stand_in_state
        if isinstance(fields, dict):
            out.recipe_fields = {k: _plain(fields[k]) for k in RECIPE_FIELDS if k in fields}
    elif "recipe" not in state and out.form == FORM_PICKLE:
        out.note = "a pickled state without a recipe (TE 1.x's layout)"
    out.needed = any(k in state for k in NEEDED_KEYS)
    out.fp8 = out.recipe is not None or any(k in state for k in DELAYED_KEYS)


def _plain(value: Any) -> Any:
    """A recipe field or extra variable as JSON-able data: a Format as its name."""
    if isinstance(value, StandIn):
        args = value.stand_in_args
        helper = args[0] if args else None
        limits = tuple(helper.stand_in_args) if isinstance(helper, StandIn) else None
        return _FORMATS.get(limits, repr(value)) if limits is not None else repr(value)  # type: ignore[arg-type]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


# --- TE's classifier (#3123: 2.16.1, 2.17.1, >= 2.18), modelled ---------------------------------------


def _opcodes(payload: bytes) -> tuple[list[str], list[tuple[str, str]]]:
    """The strings and the globals (module, name) a pickle names, read by its opcodes only (nothing runs)."""
    strings: list[str] = []
    globals_: list[tuple[str, str]] = []
    for opcode, arg, _ in pickletools.genops(payload):
        if "STRING" in opcode.name or "UNICODE" in opcode.name:
            text = arg.decode("utf-8", "replace") if isinstance(arg, bytes) else arg
            if isinstance(text, str):
                strings.append(text)
        elif opcode.name == "GLOBAL" and isinstance(arg, str) and len(arg.split()) == 2:
            module, name = arg.split()
            globals_.append((module, name))
        elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
            globals_.append((strings[-2], strings[-1]))
    return strings, globals_


def te_refuses(payload: bytes) -> str:
    """What a refusing TE release's ``set_extra_state`` (:data:`REFUSING_RELEASES`) does with a uint8 payload
    without the opt-in: "ignore" (never unpickled) or "refuse" (a RuntimeError naming
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE). Its rules: a payload it
    cannot parse, one without a ``recipe`` string (TE 1.x's layout), one naming DelayedScaling or a delayed-scaling
    key, or one naming no known recipe needs the unsafe load; one that names no global and no delayed key, or a
    known stateless (or custom) recipe, is ignored."""
    if not payload:
        return "ignore"
    try:
        strings, globals_ = _opcodes(payload)
    except Exception:  # TE treats an unparsable payload as one to unpickle unsafely
        return "refuse"
    delayed_key = any(s in DELAYED_KEYS for s in strings)
    if not globals_ and not delayed_key:
        return "ignore"
    policies = {_POLICY[name] for module, name in globals_ if module == _RECIPE_MODULE and name in _POLICY}
    if "recipe" not in strings or "stateful" in policies or delayed_key or not policies:
        return "refuse"
    return "ignore"


def _custom_factory(payload: bytes) -> str | None:
    """A CustomRecipe's factory: the first global after it that is no TE recipe class; None without one."""
    try:
        _, globals_ = _opcodes(payload)
    except Exception:
        return None
    if (_RECIPE_MODULE, CUSTOM) not in globals_:
        return None
    after = globals_[globals_.index((_RECIPE_MODULE, CUSTOM)) + 1 :]
    others = [f"{m}.{n}" for m, n in after if m != _RECIPE_MODULE and m not in ("builtins", "collections")]
    return others[0] if others else "(unknown)"
