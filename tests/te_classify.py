"""Run one Transformer Engine release's own ``_classify_extra_state_pickle`` (``transformer_engine/pytorch/
_extra_state.py``) on payloads, in a child process: ``python te_classify.py TE_DIR < request.json``.

``TE_DIR`` holds the pure-Python ``transformer-engine`` wheel of one release, installed with ``pip install
--no-deps --target TE_DIR transformer-engine==X`` (scripts/test.sh). TE's package ``__init__`` files load its CUDA
extension and torch, so empty parent packages stand in for ``transformer_engine``, ``.common`` and ``.pytorch``:
``common/recipe/__init__.py`` (pydantic and the standard library) and ``pytorch/_extra_state.py`` (which imports
only the recipe module) then load as themselves. Nothing of torch or megatron-core is imported.

Request: ``{"payloads": [hex, ...], "corpus": bool}``. Answer on stdout: ``{"version": "2.20.2", "classifier":
bool (the release has ``_extra_state.py``), "verdicts": ["ignore" | "unsafe_load", ...] or null (no classifier:
the release ``pickle.loads`` every payload), "corpus": [hex, ...]}``, where ``corpus`` (on request) holds
payloads pickled here from the release's real recipe classes, every protocol, as ``get_extra_state`` lays them
out (lists stand in for the delayed-scaling tensors: the classifier reads names, not tensor data).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import pickle
import sys
import types


def quantizer_factory(role):  # a CustomRecipe's qfactory: pickled by name, never called
    raise AssertionError(role)


def _load(te_dir: str) -> tuple[str, types.ModuleType | None, types.ModuleType]:
    (dist,) = importlib.metadata.distributions(path=[te_dir], name="transformer_engine")
    sys.path.insert(0, te_dir)
    package = os.path.join(te_dir, "transformer_engine")
    for sub in ("", "common", "pytorch"):
        module = types.ModuleType(f"transformer_engine.{sub}" if sub else "transformer_engine")
        module.__path__ = [os.path.join(package, sub)]
        sys.modules[module.__name__] = module
    recipe = importlib.import_module("transformer_engine.common.recipe")
    has_classifier = os.path.exists(os.path.join(package, "pytorch", "_extra_state.py"))
    classifier = importlib.import_module("transformer_engine.pytorch._extra_state") if has_classifier else None
    return dist.version, classifier, recipe


def _corpus(recipe: types.ModuleType) -> list[bytes]:
    recipes = []
    for name in ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling"):
        recipes.append(getattr(recipe, name)())
    if hasattr(recipe, "NVFP4BlockScaling"):
        recipes.append(recipe.NVFP4BlockScaling())
    if hasattr(recipe, "CustomRecipe"):
        recipes.append(recipe.CustomRecipe(qfactory=quantizer_factory))
    extra = {"num_gemms": 1, "fp8_checkpoint": True, "global_fp8_buffer_pos_fwd": 0}
    delayed = {"scale_fwd": [1.0] * 3, "amax_history_fwd": [[0.0] * 3], "scale_bwd": [1.0] * 2}
    delayed["amax_history_bwd"] = [[0.0] * 2]
    states: list[object] = [None, {}, {"extra_fp8_variables": extra}, {**delayed, "extra_fp8_variables": extra}]
    for r in recipes:
        states += [{"recipe": r, "extra_fp8_variables": extra}, {"recipe": r, **delayed, "extra_fp8_variables": extra}]
    return [pickle.dumps(state, protocol=p) for state in states for p in range(pickle.HIGHEST_PROTOCOL + 1)]


def main() -> None:
    version, classifier, recipe = _load(sys.argv[1])
    request = json.load(sys.stdin)
    payloads = [bytes.fromhex(p) for p in request["payloads"]]
    corpus = _corpus(recipe) if request.get("corpus") else []
    verdicts = None
    if classifier is not None:
        verdicts = [classifier._classify_extra_state_pickle(p).value for p in payloads + corpus]
    answer = {"version": version, "classifier": classifier is not None, "verdicts": verdicts}
    answer["corpus"] = [p.hex() for p in corpus]
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
