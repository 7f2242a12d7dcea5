"""``ckptdoctor`` as one torchrun rank, with test hooks (tests/test_parallel.py).

- ``CKD_TEST_LOG=<dir>``: each rank appends the data files ``check --deep`` reads to ``<dir>/rank<N>.txt``.
- ``CKD_TEST_FAIL=unit``: rank 1 fails inside the work of its share (a read error on its first file);
  ``CKD_TEST_FAIL=early``: rank 1 fails before any exchange (while scanning the checkpoint).
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptdoctor.errors import CkptError
from ckptdoctor.rules import deep_decode, structure

RANK = int(os.environ["RANK"])
LOG = os.environ.get("CKD_TEST_LOG")
FAIL = os.environ.get("CKD_TEST_FAIL")
_check_file = deep_decode._check_file
_scan_iteration = structure.scan_iteration


def check_file(state, file, *args, **kwargs):
    if LOG:
        with open(Path(LOG) / f"rank{RANK}.txt", "a") as f:
            f.write(file[0].name + "\n")
    if FAIL == "unit" and RANK == 1:
        raise CkptError(f"{file[0]}: cannot read (rank 1: Input/output error)")
    return _check_file(state, file, *args, **kwargs)


def scan_iteration(*args, **kwargs):
    if FAIL == "early" and RANK == 1:
        raise CkptError("rank 1: stale file handle while scanning")
    return _scan_iteration(*args, **kwargs)


deep_decode._check_file = check_file
structure.scan_iteration = scan_iteration

if __name__ == "__main__":
    from ckptdoctor.cli import run

    # The console entry's own exit (os._exit after the flush): a plain interpreter exit runs gloo's C++ static
    # destructors, which now and then abort (SIGABRT, "terminate called without an active exception") under load.
    run()
