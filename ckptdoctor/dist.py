"""Runs under torchrun: ``torch.distributed`` on gloo (CPU), results exchanged, rank 0 speaks for all.

``torchrun --nnodes N --nproc-per-node M -m ckptdoctor check --deep CKPT`` starts one ckptdoctor per rank with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set. :func:`run_main` then joins the process group,
runs the command on every rank (metadata work is repeated on each: it is small; byte-bound work is split by
:func:`ckptdoctor.parallel.map_units`), and ends with one exchange in which the ranks agree on the exit code.
Only rank 0 writes to stdout and stderr; the others' output is captured, and when a rank fails while rank 0
did not, rank 0 prints that rank's message and every rank exits with its code. (torchrun itself then exits 1
whenever a rank exits non-zero, findings included, and adds its own failure summary on stderr.)

Every collective is one ``all_gather_object`` of a tagged payload, so a rank that failed early (and sends its
final ``("exit", ...)`` payload) meets the others in whichever exchange they are in; they see its failure
there and stop with its message instead of waiting for it. torch is imported only in this mode.
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ckptdoctor import _under_torchrun
from ckptdoctor.errors import CkptError, MissingExtraError

_GROUP: Group | None = None
TIMEOUT_ENV = "CKPTDOCTOR_DIST_TIMEOUT"  # seconds a rank waits for the others in one exchange (default 1800)
LINGER_SECONDS = 5.0  # on a failure, how long ranks other than 0 wait for rank 0 to exit first


def under_torchrun() -> bool:
    """One rank of a torchrun job (the test lives in the package's __init__, which needs it before any import)."""
    return _under_torchrun()


def group() -> Group | None:
    """The process group while a command runs under torchrun, else None."""
    return _GROUP


class RankFailed(BaseException):
    """Another rank ended with an error; it has left, so this rank stops exchanging and exits with its code.

    A BaseException: it passes every ``except Exception`` of the command on its way to :func:`run_main`."""

    def __init__(self, rank: int, code: int, message: str) -> None:
        super().__init__(message)
        self.rank, self.code, self.message = rank, code, message


class Group:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.left = False  # another rank has ended: no more exchanges

    def _gather(self, payload: tuple) -> list[tuple]:
        import torch.distributed as td

        out: list[Any] = [None] * self.world
        td.all_gather_object(out, payload)
        return out

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order; raises :class:`RankFailed` when a rank has ended instead."""
        payloads = self._gather(("data", value))
        for rank, payload in enumerate(payloads):
            if payload[0] == "exit":
                self.left = True
                raise RankFailed(rank, payload[1], payload[2])
        return [payload[1] for payload in payloads]

    def agree(self, code: int, message: str) -> tuple[int, int, str]:
        """The final exchange: (exit code, rank whose message to show, message). The highest code wins; among
        ranks with that code, the lowest rank's message."""
        payloads = self._gather(("exit", code, message))
        codes = [p[1] if p[0] == "exit" else 0 for p in payloads]  # "data": still working, this rank's failure counts
        worst = max(codes)
        rank = codes.index(worst)
        return worst, rank, payloads[rank][2] if payloads[rank][0] == "exit" else ""


def refuse_write(command: str) -> None:
    """A write runs in one process: under torchrun every rank would write the same output (one of them then finds
    it exists, or takes the others' lock, or backs the source up twice)."""
    if group() is not None:
        raise CkptError(f"{command} writes from one process, not under torchrun (use --jobs for parallel workers)")


def _init() -> Group:
    try:
        import torch.distributed as td
    except ImportError:
        raise MissingExtraError("torch", "torch", "running under torchrun") from None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "1800")))
    td.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return Group(rank, world)


def run_main(main: Callable[[], int]) -> int:
    """``main()`` as one rank of a torchrun job (see the module doc); returns the agreed exit code."""
    global _GROUP
    try:
        _GROUP = own = _init()
    except (CkptError, RuntimeError, ValueError) as exc:
        print(f"ckptdoctor: error: cannot join the torchrun process group: {exc}", file=sys.stderr)
        return 2
    quiet = own.rank != 0
    saved = sys.stdout, sys.stderr
    captured = io.StringIO()
    if quiet:
        sys.stdout, sys.stderr = io.StringIO(), captured
    try:
        try:
            code = main()
        except RankFailed as exc:
            code, shown, message = exc.code, exc.rank, exc.message
        else:
            code, shown, message = own.agree(code, captured.getvalue() if code else "")
        sys.stdout, sys.stderr = saved
        if own.rank == 0 and shown != 0 and message:
            sys.stderr.write(message if message.endswith("\n") else message + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        # torchrun stops every rank as soon as one exits non-zero: no rank leaves before rank 0 has spoken, and
        # on a failure rank 0 leaves first (torchrun's summary then names rank 0 and the agreed code)
        own._gather(("done",))
        if code and own.rank != 0:
            time.sleep(LINGER_SECONDS)
    finally:
        sys.stdout, sys.stderr = saved
        _finish()
    return code


def _finish() -> None:
    global _GROUP
    import torch.distributed as td

    group, _GROUP = _GROUP, None
    if group is not None and not group.left and td.is_initialized():
        td.destroy_process_group()
