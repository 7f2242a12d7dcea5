"""ckptdoctor: diagnose and repair Megatron-Core distributed checkpoints offline."""

import os
import signal
import sys

__version__ = "0.1.0"

_PENDING_SIGNALS: list[int] = []  # SIGINTs and SIGTERMs that arrived while the CLI process was still importing


def _defer_signal(signum: int, frame: object) -> None:
    _PENDING_SIGNALS.append(signum)


def _under_torchrun() -> bool:
    """One rank of a torchrun job (the one test; ``ckptdoctor.dist.under_torchrun`` is this)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _is_cli_process() -> bool:
    """This package is being imported by the ``ckptdoctor`` console script or ``python -m ckptdoctor``."""
    argv0 = sys.argv[0] if sys.argv else ""
    name, parent = os.path.basename(argv0), os.path.basename(os.path.dirname(argv0))
    if name in ("ckptdoctor", "ckptdoctor.exe") or (name == "__main__.py" and parent == "ckptdoctor"):
        return True
    if argv0 != "-m":  # argv[0] is "-m" only while runpy imports the package of ``python -m <module>``
        return False
    orig = getattr(sys, "orig_argv", [])
    for i, arg in enumerate(orig[1:], 1):
        if arg.startswith("-m"):  # the interpreter's options end at -m
            return (arg[2:] or (orig[i + 1] if i + 1 < len(orig) else "")) == "ckptdoctor"
    return False


# First thing in the process that is ours (``python -m ckptdoctor`` imports this package before its
# __main__.py, the console script before ckptdoctor.cli): a Ctrl-C (or a SIGTERM: a batch scheduler ending
# the job) from here on while the CLI starts is remembered and answered by ckptdoctor.cli.run() like any other
# interrupt, not a KeyboardInterrupt traceback. Signals the parent ignores (nohup) stay ignored, and so does
# SIGTERM under torchrun: its agent ends the other ranks with it once one rank exits non-zero (exit 1, findings,
# is one), a teardown of a run whose outcome the failing rank already reports.
if _is_cli_process():
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _defer_signal)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and not _under_torchrun():
        signal.signal(signal.SIGTERM, _defer_signal)
