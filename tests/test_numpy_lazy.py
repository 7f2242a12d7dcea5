"""numpy is imported with one OpenBLAS thread (ckptdoctor does no float linear algebra; OpenBLAS's idle threads spin
and cost CPU), the variable set only for the import: the environment afterwards, and a child process's, is the
user's, and a user's own ``OPENBLAS_NUM_THREADS`` is left as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytest.importorskip("numpy")

_VAR = "OPENBLAS_NUM_THREADS"

# Threads of this process (Linux: /proc/self/task) before and after importing numpy, the environment after, and what
# a child process sees. IMPORT is ckptdoctor's numpy_or_none() or a plain ``import numpy`` (the control).
_PROBE = """
import json, os, subprocess, sys
assert "numpy" not in sys.modules
def threads():
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
environ = dict(os.environ)
before = threads()
IMPORT
after = threads()
child = subprocess.run(
    [sys.executable, "-c", "import os; print(os.environ.get('OPENBLAS_NUM_THREADS'))"],
    capture_output=True, text=True, check=True,
).stdout.strip()
print(json.dumps({
    "extra_threads": None if before is None else after - before,
    "environ_unchanged": dict(os.environ) == environ,
    "getenv": os.getenv("OPENBLAS_NUM_THREADS"),
    "child": child,
}))
"""
_CKPTDOCTOR = "from ckptdoctor.numpy_lazy import numpy_or_none\nassert numpy_or_none() is not None"
_PLAIN = "import numpy"


def _probe(import_code: str, blas_threads: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != _VAR}
    if blas_threads is not None:
        env[_VAR] = blas_threads
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.replace("IMPORT", import_code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_numpy_is_imported_without_openblas_threads_and_the_environment_is_restored():
    found = _probe(_CKPTDOCTOR, None)
    assert found["environ_unchanged"]
    assert found["getenv"] is None
    assert found["child"] == "None"
    control = _probe(_PLAIN, None)
    if found["extra_threads"] is None or not control["extra_threads"]:
        pytest.skip("no thread count here, or this numpy starts no threads on import (one core, no OpenBLAS)")
    assert found["extra_threads"] == 0, (found, control)


def test_a_users_own_openblas_setting_is_kept():
    found = _probe(_CKPTDOCTOR, "2")
    assert found["environ_unchanged"]
    assert found["getenv"] == "2"
    assert found["child"] == "2"
    control = _probe(_PLAIN, "2")
    if found["extra_threads"] is not None:
        assert found["extra_threads"] == control["extra_threads"], (found, control)
