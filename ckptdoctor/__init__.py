"""ckptdoctor: diagnose and repair Megatron-Core distributed checkpoints offline."""

# The C module under ``signal``, which the interpreter loaded at its start: importing ``signal`` itself builds its
# enums (and imports ``enum`` where nothing did yet), milliseconds in which a Ctrl-C was a KeyboardInterrupt traceback.
import _signal  # type: ignore[import-not-found]
import os
import sys

_PENDING_SIGNALS: list[int] = []  # SIGINTs and SIGTERMs that arrived while the CLI process was still importing

# What ``python -m <module>`` runs of this package as the CLI (``ckptdoctor.cli`` ends in ``run()`` too).
_CLI_MODULES = ("ckptdoctor", "ckptdoctor.__main__", "ckptdoctor.cli")


def _defer_signal(signum: int, frame: object) -> None:
    _PENDING_SIGNALS.append(signum)


def _under_torchrun() -> bool:
    """One rank of a torchrun job (the one test; ``ckptdoctor.dist.under_torchrun`` is this)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _is_cli_process() -> bool:
    """This package is being imported by the ``ckptdoctor`` console script or ``python -m ckptdoctor`` (torchrun
    starts each rank as ``python -u -m ckptdoctor``)."""
    argv0 = sys.argv[0] if sys.argv else ""
    name, parent = os.path.basename(argv0), os.path.basename(os.path.dirname(argv0))
    if name in ("ckptdoctor", "ckptdoctor.exe") or (name == "__main__.py" and parent == "ckptdoctor"):
        return True
    # argv[0] is "-m" only while runpy imports the package of ``python -m <module>``
    return argv0 == "-m" and _module_of_dash_m(getattr(sys, "orig_argv", [])) in _CLI_MODULES


def _module_of_dash_m(argv: list[str]) -> str | None:
    """The module of an interpreter command line ``python [options] -m <module> ...``, or None. Options may be
    clustered (``-um mod``, ``-Wignore``); -W and -X take a value, and so does --check-hash-based-pycs."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--check-hash-based-pycs":
            i += 1
        elif arg.startswith("--"):
            continue
        elif not arg.startswith("-") or arg == "-":  # a script, or stdin: the interpreter's options ended
            return None
        else:
            for k, flag in enumerate(arg[1:], 2):
                if flag in "cmWX":  # the rest of the argument, or the next one, is its value
                    value = arg[k:]
                    if not value:
                        value = argv[i] if i < len(argv) else ""
                        i += 1
                    if flag in "cm":
                        return value if flag == "m" else None
                    break
    return None


# First thing in the process that is ours (``python -m ckptdoctor`` imports this package before its
# __main__.py, the console script before ckptdoctor.cli): a Ctrl-C (or a SIGTERM: a batch scheduler ending
# the job) from here on while the CLI starts is remembered and answered by ckptdoctor.cli.run() like any other
# interrupt, not a KeyboardInterrupt traceback. Signals the parent ignores (nohup) stay ignored, and so does
# SIGTERM under torchrun: its agent ends the other ranks with it once one rank exits non-zero (exit 1, findings,
# is one), a teardown of a run whose outcome the failing rank already reports. What runs before this line is out
# of our reach: the interpreter's start (SIGINT kills the process, as Ctrl-C does a C program), its ``site``
# import with the .pth files of site-packages (a KeyboardInterrupt there is "Fatal Python error:
# init_import_site", exit 1), and runpy or the console script finding this package.
if _is_cli_process():
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _defer_signal)
    if _signal.getsignal(_signal.SIGTERM) == _signal.SIG_DFL and not _under_torchrun():
        _signal.signal(_signal.SIGTERM, _defer_signal)

__version__ = "0.1.0"


# Test hook (the one environment switch that changes what runs; README "Test hooks"): CKPTDOCTOR_NO_EXTENSIONS=1 makes
# the optional C extensions unimportable, so the pure-Python path runs as on a machine without a compiler
# (scripts/test.sh runs the fast tier once that way).
NATIVE_MODULES = (
    "ckptdoctor.pickle._native",
    "ckptdoctor.formats._dcp_index",
    "ckptdoctor.formats._crc32",
    "ckptdoctor.values._health",
)


class _NoExtensions:
    """A meta path finder that refuses the native modules (``find_spec`` raising ImportError is what a missing
    build looks like to ``import``)."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name in NATIVE_MODULES:
            raise ImportError(f"{name}: blocked by CKPTDOCTOR_NO_EXTENSIONS")
        return None


if os.environ.get("CKPTDOCTOR_NO_EXTENSIONS"):
    sys.meta_path.insert(0, _NoExtensions)  # type: ignore[arg-type]


def native(name: str) -> bool:
    """Whether the native module ``name`` (``ckptdoctor.pickle._native``, ...) was built and may be used here (found,
    not loaded: ``--version`` asks at every start)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # blocked (CKPTDOCTOR_NO_EXTENSIONS)
        return False
