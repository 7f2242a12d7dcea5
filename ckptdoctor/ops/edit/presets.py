"""``edit --preset``: the norm keys of megatron-core's GPT layer specs, renamed between the Transformer Engine spec's
names and the local spec's module names, layer by layer.

From ``gpt_layer_specs.py`` (core 0.19.2; ``tests/mcore_te_spec.py`` prints the TE spec's submodules):

* The TE spec fuses the input norm into ``self_attention.linear_qkv`` (``TELayerNormColumnParallelLinear``:
  parameters ``layer_norm_weight`` / ``layer_norm_bias``); ``input_layernorm`` is ``IdentityOp``.
* The pre-MLP norm is fused into ``mlp.linear_fc1`` the same way in a dense layer, but is a norm module of its
  own (``pre_mlp_layernorm.weight``) in a MoE layer, whose MLP has no ``linear_fc1``.
* The local spec's modules are ``input_layernorm`` and ``pre_mlp_layernorm``. Its ``sharded_state_dict_keys_map``
  saves them under the fused names (also the pre-MLP norm of a MoE layer, where the TE spec does not). A layer
  without that map (MLA, older or third-party code) saves and requests the module names.

So ``te-to-local`` gives the module names, and ``local-to-te`` gives what the TE spec's model requests. That
depends on the layer: a layer's pre-MLP norm becomes ``mlp.linear_fc1.layer_norm_*`` where that layer has a
``mlp.linear_fc1.weight`` and ``pre_mlp_layernorm.*`` where it has a router. The input norm is fused only where
the layer has ``self_attention.linear_qkv.weight`` (MLA layers keep theirs). A layer is the part of a key before
``self_attention.`` or ``mlp.`` (``decoder.layers.`` of a stacked model, ``decoder.layers.3.`` of a per-layer one).
Optimizer keys (``optimizer.state.exp_avg.<key>``) follow the model key they end with.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

PRESET_NAMES = ("te-to-local", "local-to-te")

_TE_NAMES = {"input": "self_attention.linear_qkv.layer_norm_", "pre_mlp": "mlp.linear_fc1.layer_norm_"}
_LOCAL_NAMES = {"input": "input_layernorm.", "pre_mlp": "pre_mlp_layernorm."}
_NORM_RE = re.compile(
    r"(?P<layer>^|.*\.)(?:(?P<te>self_attention\.linear_qkv\.layer_norm_|mlp\.linear_fc1\.layer_norm_)"
    r"|(?P<local>input_layernorm\.|pre_mlp_layernorm\.))(?P<param>weight|bias)\Z"
)
_LAYER_RE = re.compile(r"(?:^|\.)(?=(?:self_attention|mlp)\.)")
_PARTS = ("self_attention.linear_qkv", "mlp.linear_fc1", "mlp.router")  # a layer is known by one of their weights


def _norm_of(name: str) -> str:
    return "input" if name in (_TE_NAMES["input"], _LOCAL_NAMES["input"]) else "pre_mlp"


class _Layers:
    """Which layers (key prefixes) have a fused-norm linear (``linear_qkv`` / ``linear_fc1`` weight) or a router."""

    def __init__(self, names: Iterable[str]) -> None:
        self.layers: set[str] = set()
        self.keys: set[str] = set()
        for name in names:
            self.keys.add(name)
            for match in _LAYER_RE.finditer(name):
                self.layers.add(name[: match.end()])

    def layer(self, prefix: str) -> str | None:
        """The layer a key's prefix names: the prefix itself, or (an optimizer key) the longest model layer it
        ends with; None where none is known."""
        while True:
            if prefix in self.layers and self._has_parts(prefix):
                return prefix
            if "." not in prefix.rstrip("."):
                return None
            prefix = prefix.split(".", 1)[1]

    def _has_parts(self, layer: str) -> bool:
        return any(f"{layer}{part}.weight" in self.keys for part in _PARTS)

    def has(self, layer: str, part: str) -> bool:
        return f"{layer}{part}.weight" in self.keys


def _to_te(norm: str, layer: str | None, layers: _Layers) -> str | None:
    """The TE spec's name for a norm of ``layer`` (a fused-linear prefix or a module name); None: unknown layer."""
    if layer is None:
        return None
    if norm == "input":
        return _TE_NAMES["input"] if layers.has(layer, "self_attention.linear_qkv") else _LOCAL_NAMES["input"]
    if layers.has(layer, "mlp.linear_fc1"):
        return _TE_NAMES["pre_mlp"]
    if layers.has(layer, "mlp.router"):
        return _LOCAL_NAMES["pre_mlp"]  # a MoE layer: the TE spec's pre-MLP norm is a TENorm module
    return None


def preset_renames(preset: str, names: Iterable[str]) -> dict[str, str]:
    """The renames (old -> new) that ``preset`` makes of ``names`` (the keys, after any ``--rename``)."""
    names = list(names)
    layers = _Layers(names) if preset == "local-to-te" else None
    renames: dict[str, str] = {}
    for name in names:
        match = _NORM_RE.match(name)
        if match is None:
            continue
        prefix, param = match["layer"], match["param"]
        current = match["te"] or match["local"]
        norm = _norm_of(current)
        if preset == "te-to-local":
            new = _LOCAL_NAMES[norm]
        else:
            assert layers is not None
            new = _to_te(norm, layers.layer(prefix), layers) or current
        if new != current:
            renames[name] = f"{prefix}{new}{param}"
    return renames
