"""Print megatron-core's Transformer Engine GPT layer spec, dense and MoE, as JSON {submodule path: module name}.

Run by tests/test_edit_mcore.py (``edit --preset local-to-te`` against the TE spec's own submodules). Without
Transformer Engine, megatron-core still defines its TE wrapper classes (``megatron.core.extensions.
transformer_engine``, not instantiable then) and ``TESpecProvider``, but ``gpt_layer_specs`` leaves the
provider out; it is put back here, and the spec is built (a tree of ModuleSpecs and classes; no module is
made). Wrapper classes are named by their attribute name there (without TE they are mocks, which have none).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from typing import Any

warnings.simplefilter("ignore")

from megatron.core.extensions import transformer_engine as te_wrappers  # noqa: E402
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

if gpt_layer_specs.TESpecProvider is None:  # imported without Transformer Engine
    gpt_layer_specs.TESpecProvider = TESpecProvider
    for name in ("TENorm", "TEFusedMLP", "TEFusedMLPWithGroupedLinear"):
        setattr(gpt_layer_specs, name, getattr(te_wrappers, name))

NAMES = {id(v): k for k, v in vars(te_wrappers).items() if k.startswith("TE") and v is not None}


def name_of(obj: Any) -> str:
    if obj is None:
        return "None"
    return NAMES.get(id(obj)) or getattr(obj, "__name__", None) or type(obj).__name__


def walk(obj: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(obj, ModuleSpec):
        out[prefix.rstrip(".")] = name_of(obj.module)
        if obj.submodules is not None:
            walk(obj.submodules, prefix, out)
    elif isinstance(obj, functools.partial):  # a builder (the dense MLP): its submodules keyword
        out[prefix.rstrip(".")] = name_of(obj.func)
        if "submodules" in obj.keywords:
            walk(obj.keywords["submodules"], prefix, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            walk(getattr(obj, field.name), f"{prefix}{field.name}.", out)
    elif not isinstance(obj, dict):
        out[prefix.rstrip(".")] = name_of(obj)


result = {}
for label, kwargs in [("dense", {}), ("moe", {"num_experts": 4})]:
    spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    walk(spec.submodules, "", result.setdefault(label, {}))
print(json.dumps(result, indent=1, sort_keys=True))
