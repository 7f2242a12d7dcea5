"""Megatron-Bridge's ``run_config.yaml`` in an iteration dir: the run's config, where Megatron-LM saves ``args``.

Bridge saves no ``args`` in the common state; its resume reads the checkpoint's ``run_config.yaml`` instead, and
compares ``model.tensor_model_parallel_size`` / ``model.pipeline_model_parallel_size`` with the run's to decide
whether the RNG state is loaded (``training/checkpointing.py``, main as of 2026-08). A re-sharded checkpoint whose
``run_config.yaml`` still carries the source's sizes is the converter problem of Megatron-LM's args, here.

The file is a stranger's input read by ``check``: only the scalars directly under the top-level ``model:`` mapping
are read, by a linear line scan (block style, as Bridge's OmegaConf dump writes it), never by a YAML library, and
the file is capped at :data:`MAX_RUN_CONFIG_BYTES`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.storage.files import read_small_file

RUN_CONFIG = "run_config.yaml"
MAX_RUN_CONFIG_BYTES = 16 << 20  # Megatron-Bridge writes a few KB
_INT = re.compile(r"[+-]?[0-9]{1,30}\Z")
_FLOAT = re.compile(
    r"[+-]?(?:[0-9]{1,30}\.[0-9]{0,30}|\.[0-9]{1,30})(?:[eE][+-]?[0-9]{1,4})?\Z|[+-]?[0-9]{1,30}[eE][+-]?[0-9]{1,4}\Z"
)


def read_run_config(iteration_dir: Path) -> str | None:
    """The text of the iteration dir's ``run_config.yaml`` (None when there is none), read as a regular file of
    at most 16 MiB and UTF-8; else :class:`CkptError` naming it."""
    path = iteration_dir / RUN_CONFIG
    if not path.is_file():
        return None
    raw = read_small_file(path, MAX_RUN_CONFIG_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CkptError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def model_config(text: str) -> dict[str, Any]:
    """The scalars directly under the top-level ``model:`` mapping: name -> int, float, bool, None or str (nested
    mappings, lists and flow values are skipped; a repeated name keeps its last value, as YAML loaders do)."""
    return {key: _scalar(value) for _, key, value in model_fields(text)}


def model_field_lines(text: str) -> set[int]:
    """Indices (in ``text.splitlines()``) of the lines :func:`model_config` reads: the only ones a change of
    the model config may touch (a same-named field of another section or of a nested mapping is another thing)."""
    return {index for index, _, _ in model_fields(text)}


def model_fields(text: str) -> Iterator[tuple[int, str, str]]:
    """(line index, name, value text) of each scalar field directly under the top-level ``model:`` mapping."""
    in_model = False
    indent_of_fields: int | None = None
    for index, line in enumerate(text.splitlines()):
        content = line.rstrip()
        stripped = content.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(content) - len(stripped)
        if indent == 0:
            in_model = _uncommented(stripped) == "model:"
            indent_of_fields = None
            continue
        if not in_model:
            continue
        if indent_of_fields is None:
            indent_of_fields = indent
        if indent != indent_of_fields or stripped.startswith("-"):
            continue  # deeper (a nested mapping's fields) or a list item
        key, sep, value = stripped.partition(":")
        value = _uncommented(value)
        if sep and key.strip() and value:
            yield index, key.strip(), value


def _uncommented(text: str) -> str:
    if text.lstrip().startswith(("'", '"')):
        return text.strip()
    return text.split(" #", 1)[0].strip()


def _scalar(text: str) -> Any:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "~"):
        return None
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text
