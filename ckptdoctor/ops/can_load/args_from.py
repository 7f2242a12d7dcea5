"""``can-load --args-from``: the loading run's model args from a YAML file (a Megatron-Bridge ``run_config.yaml``;
PyYAML where installed, else a safe subset parser) or from another checkpoint's saved args."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptdoctor.args import arg_group, args_as_dict
from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.ops.can_load.run import parse_value

# Megatron-Bridge model-config names -> Megatron-LM arg names.
_ARG_ALIASES = {
    "num_moe_experts": "num_experts",
    "gated_linear_unit": "swiglu",
    "vocab_size": "vocab_size",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
}


def _flatten_yaml(data: Any, path: Path) -> dict[str, Any]:
    """Model args from a YAML mapping: top-level scalars, then the ``model`` section's (Megatron-Bridge)."""
    if not isinstance(data, dict):
        raise CkptError(f"--args-from {path}: the YAML file is not a mapping")
    flat = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
    for section in ("model", "model_config"):
        if isinstance(data.get(section), dict):
            flat.update({k: v for k, v in data[section].items() if not isinstance(v, (dict, list))})
    return {_ARG_ALIASES.get(k, k): v for k, v in flat.items()}


def _mini_yaml(text: str) -> dict[str, Any]:
    """A safe subset of YAML without PyYAML: nested block mappings of scalars (lists and flow styles skipped)."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, root)]
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip()
        if not line.strip() or line.lstrip().startswith(("#", "-", "---")):
            continue
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        while stack[-1][0] >= indent:
            stack.pop()
        if value.strip() == "":
            child: dict[str, Any] = {}
            stack[-1][1][key.strip()] = child
            stack.append((indent, child))
        else:
            stack[-1][1][key.strip()] = parse_value(value.strip().strip("'\""))
    return root


def load_yaml_args(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        import yaml  # type: ignore[import-untyped]  # optional (pip install 'ckptdoctor[yaml]'); the subset parser covers run_config.yaml
    except ImportError:
        return _flatten_yaml(_mini_yaml(text), path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CkptError(f"--args-from {path}: not valid YAML ({exc})") from None
    except ValueError as exc:  # PyYAML's int() of a scalar past Python's 4300-digit limit
        raise CkptError(f"--args-from {path}: not valid YAML ({exc})") from None
    except RecursionError:  # PyYAML composes and constructs recursively: [[[[...]]]] a few thousand deep
        raise CkptError(f"--args-from {path}: not valid YAML (nested too deeply)") from None
    return _flatten_yaml(data, path)


def model_args_from(source: str) -> dict[str, Any]:
    """``--args-from``: a YAML file, or another checkpoint's saved model args."""
    path = Path(source)
    if path.is_file() and path.suffix.lower() in (".yaml", ".yml"):
        return load_yaml_args(path)
    args = args_as_dict(open_checkpoint(source).args)
    if not args:
        raise CkptError(f"--args-from {source}: that checkpoint saved no args")
    # The model args only: that run's layout, derived GTP args and training state stay the loading run's.
    return {k: v for k, v in args.items() if arg_group(k) not in ("parallelism", "parallelism-derived", "training")}
