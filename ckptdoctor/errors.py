"""Errors that reach the user as one line and exit code 2."""

from __future__ import annotations


class CkptError(Exception):
    """A problem with the user's input (path, file, checkpoint) worth one clear line.

    The CLI prints ``str(error)`` and exits with ``exit_code``; it never shows a traceback.
    """

    exit_code = 2


class GateRefusal(CkptError):
    """A write refused because its output would carry something that runs code in the next loader (a global off
    the allowlist, an unsafe ``_target_``): a finding about the checkpoint, so exit 1, not a usage error."""

    exit_code = 1


class UnsafePickleError(CkptError):
    """A pickle referenced a callable outside the allowlist; nothing was executed."""

    def __init__(self, module: str, name: str, where: str = "", detail: str = "") -> None:
        self.module = module
        self.name = name
        self.where = where
        self.detail = detail
        place = f"{where}: " if where else ""
        why = f" {detail}" if detail else ", which is not on the allowlist"
        super().__init__(f"{place}refusing unsafe pickle: it references {self.global_name}{why} (nothing was executed)")

    @property
    def global_name(self) -> str:
        """``module.name`` as a safe one-line string (a hostile name may hold newlines or escapes)."""
        if isinstance(self.module, str) and isinstance(self.name, str):
            text = f"{self.module}.{self.name}"
            if text.isprintable() and text.isascii():
                return text
        return ascii((self.module, self.name))

    def located(self, where: str) -> UnsafePickleError:
        """The same refusal, naming the file it came from."""
        return UnsafePickleError(self.module, self.name, where, self.detail)


class UnlistedGlobalError(UnsafePickleError):
    """A pickle that names a global off the allowlist (read as an inert stand-in) and then fails to read: the
    failure is the stand-in's, the real object would have run. A gate failure (CKD402), not damage."""

    def __init__(self, module: str, name: str, where: str = "", detail: str = "") -> None:
        super().__init__(module, name, where, detail)

    def located(self, where: str) -> UnlistedGlobalError:
        return UnlistedGlobalError(self.module, self.name, where, self.detail)


class MissingExtraError(CkptError):
    """An optional dependency (torch, zarr, megatron-core) is needed for this operation."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        hint = ""
        if package == "torch":  # the default Linux wheel pulls ~16 CUDA packages (multi-GB); values need none
            hint = (
                " (that pulls the multi-GB CUDA build of torch on Linux; the CPU-only wheel is enough and "
                "under 1 GB: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
            )
        super().__init__(
            f"{purpose} needs the '{package}' package, which is not installed: pip install 'ckptdoctor[{extra}]'{hint}"
        )


class PickleLimitError(CkptError):
    """A pickle broke a resource or shape limit (nesting, memo, string size, opcode); nothing was built.
    ``global_name``: the global a refused BUILD or item assignment would have changed, where known."""

    global_name: str | None = None

    def located(self, where: str) -> PickleLimitError:
        """The same refusal, naming the file it came from."""
        error = PickleLimitError(f"{where}: {self}")
        error.global_name = self.global_name
        return error


def without_path(error: Exception | str, *paths: object) -> str:
    """An error's message without its leading ``<path>: `` for each of ``paths`` in turn (where a finding or a
    problem names the path itself)."""
    text = str(error)
    for path in paths:
        prefix = f"{path}: "
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text
