"""numpy, imported once where it is installed (it comes with torch): ``check --deep``'s NaN/Inf count and
``diff --values`` use it where it is there and need neither numpy nor torch where it is not."""

from __future__ import annotations

import importlib
import os
from typing import Any

_NUMPY: list[Any] = []  # [numpy module or None], imported on the first scan

# numpy's OpenBLAS starts a thread per core when it loads, and those threads spin waiting for work: a fifth of the
# samples of a ``check --health`` run, 0.1-0.15 s of CPU per command. ckptdoctor does no float linear algebra (its
# one matmul is on uint64, which numpy does without BLAS), so numpy is imported with one OpenBLAS thread. OpenBLAS
# reads the variable once, as it loads: it is set only for the import (child processes see the user's environment),
# and a user's own setting is left as it is.
_BLAS_THREADS = "OPENBLAS_NUM_THREADS"


def numpy_or_none() -> Any:
    """numpy where installed (it comes with torch), else None (check --deep and diff --values need neither numpy
    nor torch: their pure-Python and torch paths); imported once."""
    if not _NUMPY:
        try:
            _NUMPY.append(_import_numpy())
        except ImportError:
            _NUMPY.append(None)
    return _NUMPY[0]


def _import_numpy() -> Any:
    if _BLAS_THREADS in os.environ:
        return importlib.import_module("numpy")
    os.environ[_BLAS_THREADS] = "1"
    try:
        return importlib.import_module("numpy")
    finally:
        os.environ.pop(_BLAS_THREADS, None)
