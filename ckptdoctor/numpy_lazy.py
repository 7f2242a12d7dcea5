"""numpy, imported once where it is installed (it comes with torch): ``check --deep``'s NaN/Inf count and
``diff --values`` use it where it is there and need neither numpy nor torch where it is not."""

from __future__ import annotations

import importlib
from typing import Any

_NUMPY: list[Any] = []  # [numpy module or None], imported on the first scan


def numpy_or_none() -> Any:
    """numpy where installed (it comes with torch), else None (check --deep and diff --values need neither numpy
    nor torch: their pure-Python and torch paths); imported once."""
    if not _NUMPY:
        try:
            _NUMPY.append(importlib.import_module("numpy"))
        except ImportError:
            _NUMPY.append(None)
    return _NUMPY[0]
