"""Command-line interface: parse options, call one operation, render. No file reading here."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

# A Ctrl-C or SIGTERM while the CLI process starts (click is most of it) was deferred by the package's __init__,
# before any of these imports: _defer_signal collects it in _PENDING_SIGNALS, which run() answers.
from ckptdoctor import _PENDING_SIGNALS, __version__, _defer_signal, _under_torchrun, native
from ckptdoctor.commands import LazyGroup
from ckptdoctor.errors import CkptError
from ckptdoctor.exit_codes import EXIT_ERROR
from ckptdoctor.gc_pause import gc_paused, short_lived_process
from ckptdoctor.text_safety import escape

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def _parse_size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip().upper()
    number = text.rstrip("KMGIB")
    unit = text[len(number) :]
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except (ValueError, KeyError, OverflowError):  # OverflowError: a number that is infinite as a float
        raise click.BadParameter(f"{value[:40]!r} is not a size (e.g. 2GiB, 500MB, 1000000)") from None
    if size <= 0:
        raise click.BadParameter("must be positive")
    return size


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    __version__,
    "--version",
    prog_name="ckptdoctor",
    # Which pickle pre-pass, index loops and health statistics run: the C extensions are optional (built at
    # install where a compiler was found); without them the Python (numpy) reference runs.
    message="%(prog)s, version %(version)s (pickle pre-pass: "
    + ("C" if native("ckptdoctor.pickle._native") else "Python, the C extension was not built or is blocked")
    + "; index loops: "
    + (
        "C"  # (its C reads the records through the pickle engine's native module)
        if native("ckptdoctor.formats._dcp_index") and native("ckptdoctor.pickle._native")
        else "Python, the C extension was not built or is blocked"
    )
    + "; health statistics: "
    + ("C" if native("ckptdoctor.values._health") else "numpy, the C extension was not built or is blocked")
    + "; CRC-32: "
    + (
        "C (zlib where the processor has no carry-less multiply)"
        if native("ckptdoctor.formats._crc32")
        else "zlib, the C extension was not built or is blocked"
    )
    + ")",
)
@click.option(
    "--max-pickle-bytes",
    callback=_parse_size,
    metavar="SIZE",
    expose_value=True,
    help="Largest pickle (.metadata, common state, data.pkl) read before refusing it "
    "[default: 1GiB; e.g. 4GiB for a legitimate giant].",
)
def cli(max_pickle_bytes: int | None) -> None:
    """Diagnose and repair Megatron-Core distributed checkpoints offline (no GPU, no Megatron)."""
    loaded = sys.modules.get("ckptdoctor.pickle.policy")
    if loaded is not None:  # an earlier command in this process (tests): its --trust-global ends with it
        loaded.set_trusted(frozenset())
    if max_pickle_bytes is not None:
        import dataclasses

        from ckptdoctor.pickle import limits

        limits.set_limits(dataclasses.replace(limits.DEFAULT_LIMITS, max_bytes=max_pickle_bytes))


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process killed by Ctrl-C
# The handlers a fresh interpreter has, restored when the block ends.
_DEFAULT_HANDLERS: dict[signal.Signals, Any] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: signal.SIG_DFL,
}


class _Interrupted(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM (a batch scheduler ending the job), raised by :func:`_on_interrupt`.

    Not a KeyboardInterrupt: click turns those into ``Abort`` (after printing a blank line), and not an
    Exception, so no ``except Exception`` on the way up swallows it. Every write cleans up on its way out.
    """

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_interrupt(signum: int, frame: object) -> None:
    for handled in _DEFAULT_HANDLERS:  # one is enough: the exit path runs undisturbed
        if signal.getsignal(handled) is _on_interrupt:
            signal.signal(handled, signal.SIG_IGN)
    raise _Interrupted(signum)


@contextmanager
def _signals_raise_interrupted() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`_Interrupted` inside the block (where a fresh interpreter's handler is
    in place). A signal the parent ignores (``nohup``, a background job) stays ignored, and a thread other
    than the main one cannot set handlers: both leave signals alone.
    """
    installed = []
    try:
        for signum, default in _DEFAULT_HANDLERS.items():
            if signum == signal.SIGTERM and _under_torchrun():  # torchrun's teardown: see ckptdoctor/__init__.py
                continue
            if signal.getsignal(signum) in (default, _defer_signal):
                signal.signal(signum, _on_interrupt)
                installed.append(signum)
    except ValueError:  # not the main thread
        pass
    previous_hook = sys.unraisablehook

    def lost(hook: Any) -> None:
        """Raised where Python ignores exceptions (a weakref callback, like the one of an import's module lock), an
        interrupt is lost: it is answered once the command returns and its handlers, disarmed, are armed again."""
        if not isinstance(hook.exc_value, _Interrupted):
            previous_hook(hook)
            return
        _PENDING_SIGNALS.append(hook.exc_value.signum)
        for signum in installed:
            signal.signal(signum, _on_interrupt)

    if installed:
        sys.unraisablehook = lost
    try:
        yield
    finally:
        for signum in installed:
            signal.signal(signum, _DEFAULT_HANDLERS[signum])
        if installed:
            sys.unraisablehook = previous_hook


def _say(line: str) -> None:
    """One line on stderr, control characters escaped (messages quote what a checkpoint holds)."""
    click.echo(escape(line), err=True)


def _interrupted(signum: int = signal.SIGINT) -> int:
    """One line, and the exit code a shell shows for that signal (130 for Ctrl-C, 143 for SIGTERM)."""
    try:
        click.echo("ckptdoctor: interrupted" if signum == signal.SIGINT else "ckptdoctor: terminated", err=True)
    except (OSError, _Interrupted):
        pass
    return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum


class _QuietPipe(io.RawIOBase):
    """The file descriptor under ``sys.stdout`` while a command runs: once the reader closes the
    pipe (``ckptdoctor inspect CKPT | head -c 100``), the rest of the output is discarded quietly, as ``cat`` ends on
    SIGPIPE, and the command finishes with its own exit code (it prints only after its work is done). Every write
    of every command reaches the descriptor here: the one place a broken pipe is handled. Below the text and
    buffer layers (both C), so only the buffer's flushes (8 KiB each) pass through Python."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.gone = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data: Any) -> int:
        size = len(memoryview(data).cast("B"))
        if self.gone:
            return size
        try:
            return os.write(self._fd, data)
        except BrokenPipeError:
            self.gone = True
            return size


def _quiet_on_broken_pipe(stream: Any) -> Any:
    """``stream`` written through :class:`_QuietPipe`, or as it is when it has no descriptor (a test's capture)."""
    try:
        fd = stream.fileno()
        stream.flush()
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return stream
    return io.TextIOWrapper(
        io.BufferedWriter(_QuietPipe(fd)),
        encoding=stream.encoding,
        errors=stream.errors,
        line_buffering=stream.line_buffering,
        write_through=getattr(stream, "write_through", False),
    )


# The wrapping streams of every run, never collected before the process ends: no finalizer of ours runs where an
# interrupt would be lost (a SIGINT in a __del__ is unraisable), and closing one would not close its descriptor.
_QUIET_STREAMS: list[Any] = []


@contextmanager
def _broken_pipes_quiet() -> Iterator[None]:
    saved = sys.stdout, sys.stderr
    sys.stdout = _quiet_on_broken_pipe(sys.stdout)  # stderr stays as it is: unbuffered, in order with signals' lines
    if sys.stdout is not saved[0]:
        _QUIET_STREAMS.append(sys.stdout)
    try:
        yield
    finally:
        quiet = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = saved
        for stream, original in zip(quiet, saved):
            if stream is not original:
                stream.flush()  # never a broken pipe; an interrupt here is answered as any other


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: runs the CLI and turns every failure into one line and exit code 2 (130 for SIGINT, 143 for
    SIGTERM). A reader that closes the pipe early ends the output, not the command (:class:`_QuietPipe`)."""
    from ckptdoctor import dist

    try:
        with _signals_raise_interrupted(), _broken_pipes_quiet():
            try:
                if dist.under_torchrun():  # one rank of a torchrun job: rank 0 prints, all agree on the exit code
                    return dist.run_main(lambda: _main(argv))
                code = _main(argv)
                if _PENDING_SIGNALS:  # one that Python lost where it was raised (see _signals_raise_interrupted)
                    raise _Interrupted(_PENDING_SIGNALS.pop(0))
                return code
            except (_Interrupted, KeyboardInterrupt) as exc:  # also when it lands while an error is being reported
                return _interrupted(getattr(exc, "signum", signal.SIGINT))
    except _Interrupted as exc:  # while the block armed or restored its handlers, outside its try
        return _interrupted(exc.signum)


_GROUP_OPTIONS_WITH_VALUE = ("--max-pickle-bytes",)  # before the command name: its value is not the command


def _asks_json(argv: Sequence[str]) -> tuple[str | None, bool]:
    """The command named in ``argv`` and whether it asked for ``--format json`` (read from the words alone: an
    error can come before click has parsed them)."""
    command = None
    words = iter(argv)
    for word in words:  # the first word that is not an option of the group (or the value of one)
        if word in _GROUP_OPTIONS_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            command = word
            break
    for i, word in enumerate(argv):
        if word == "--":
            break
        name, _, value = word.partition("=")
        if (
            name in ("--format", "--output-format")
            and (value or (argv[i + 1] if i + 1 < len(argv) else "")).lower() == "json"
        ):
            return command, True
    return command, False


def _configured_json(argv: Sequence[str]) -> bool:
    """``check`` with no --format of its own and ``format = "json"`` in its [tool.ckptdoctor] (not --isolated): its
    errors are the JSON error object too. A config that cannot be read (perhaps the error itself) says nothing."""
    if "--isolated" in argv or any(w.partition("=")[0] in ("--format", "--output-format") for w in argv):
        return False
    from ckptdoctor.commands.options import normalize_format
    from ckptdoctor.config import load_tool_config

    try:
        table, _ = load_tool_config()
    except Exception:  # noqa: BLE001 - the config's own error is being reported already
        return False
    configured = table.get("format")
    return isinstance(configured, str) and normalize_format(configured) == "json"


def _json_error(argv: Sequence[str], message: str, code: int) -> None:
    """In ``--format json`` mode an error is also one JSON object on stdout, so that a pipeline reading stdout
    sees what happened, not nothing."""
    command, json_mode = _asks_json(argv)
    if not json_mode and not (command == "check" and _configured_json(argv)):
        return
    error = {"schema": "ckptdoctor.error/1", "command": command, "error": message, "exit_code": code}
    try:
        click.echo(json.dumps(error))
    except OSError:
        pass


def _main(words: Sequence[str] | None) -> int:
    argv = list(words) if words is not None else sys.argv[1:]
    try:
        # Commands return their exit code (0 clean, 1 findings); errors raise CkptError (exit 2).
        result = cli.main(args=argv, prog_name="ckptdoctor", standalone_mode=False)
    except CkptError as exc:
        _say(f"ckptdoctor: error: {exc}")
        _json_error(argv, escape(str(exc)), exc.exit_code)
        return exc.exit_code
    except click.exceptions.Abort as exc:
        if isinstance(exc.__context__, (KeyboardInterrupt, _Interrupted)):  # click wraps a KeyboardInterrupt
            return _interrupted(getattr(exc.__context__, "signum", signal.SIGINT))
        click.echo("ckptdoctor: aborted", err=True)
        return EXIT_ERROR
    except click.ClickException as exc:
        exc.show()
        _json_error(argv, exc.format_message(), EXIT_ERROR)
        return EXIT_ERROR
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except BrokenPipeError:
        return EXIT_ERROR
    except OSError as exc:
        # An I/O error no reader turned into a CkptError (a dir that cannot be listed, a file that cannot be
        # opened): the file and the reason, like every other error.
        if os.environ.get("CKPTDOCTOR_DEBUG") or exc.filename is None:
            return _internal_error(exc, argv)
        _say(f"ckptdoctor: error: {exc.filename}: {exc.strerror or exc}")
        _json_error(argv, escape(f"{exc.filename}: {exc.strerror or exc}"), EXIT_ERROR)
        return EXIT_ERROR
    except Exception as exc:
        if isinstance(exc.__cause__, _Interrupted):  # wrapped by Python (3.11: a __set_name__ in a class statement)
            return _interrupted(exc.__cause__.signum)
        return _internal_error(exc, argv)
    return result if isinstance(result, int) else 0


def _internal_error(exc: Exception, argv: Sequence[str]) -> int:
    """Last resort: a one-line message, the traceback only on request."""
    if os.environ.get("CKPTDOCTOR_DEBUG"):
        raise exc
    _say(f"ckptdoctor: internal error: {type(exc).__name__}: {exc} (set CKPTDOCTOR_DEBUG=1 for a traceback)")
    _json_error(argv, escape(f"internal error: {type(exc).__name__}: {exc}"), EXIT_ERROR)
    return EXIT_ERROR


def run() -> None:
    """The console entry point (``ckptdoctor``, ``python -m ckptdoctor``): :func:`main` in a short-lived process.

    A metadata-only command builds ~10^5 small objects and exits: cyclic garbage collection only rescans
    them (they hold no cycles; reference counting frees what is dropped) and tearing the interpreter down
    frees them one by one. Together that was ~15 % of an ``inspect`` of a 20,000-key checkpoint, so the
    process runs without the cyclic collector and ends with ``os._exit`` once its output is flushed
    (nothing of ours is left to clean up at exit: every file is closed by then). SIGINT and SIGTERM are handled
    for the whole run, the final flush included. (:mod:`ckptdoctor.gc_pause` holds the one switch.)
    """
    code = EXIT_ERROR
    short_lived_process()
    try:
        with gc_paused(), _signals_raise_interrupted():
            try:
                if _PENDING_SIGNALS:  # interrupted while starting
                    raise _Interrupted(_PENDING_SIGNALS[0])
                code = main()
                sys.stdout.flush()
                sys.stderr.flush()
            except _Interrupted as exc:
                code = _interrupted(exc.signum)
            except (BrokenPipeError, OSError):
                code = code or EXIT_ERROR
            os._exit(code)  # inside the block: the signals stay handled (or ignored, once seen) up to the exit
    except _Interrupted as exc:  # raised while the block armed its handlers, before its try: was a traceback, exit 1
        code = _interrupted(exc.signum)
    os._exit(code)


if __name__ == "__main__":
    run()
