"""Errors that reach the user as one line and exit code 2."""

from __future__ import annotations


class CkptError(Exception):
    """A problem with the user's input (path, file, checkpoint) worth one clear line.

    The CLI prints ``str(error)`` and exits with ``exit_code``; it never shows a traceback.
    """

    exit_code = 2


class UnsafePickleError(CkptError):
    """A pickle referenced a callable outside the allowlist; nothing was executed."""

    def __init__(self, module: str, name: str, where: str = "") -> None:
        self.module = module
        self.name = name
        self.where = where
        place = f"{where}: " if where else ""
        super().__init__(
            f"{place}refusing unsafe pickle: it references {module}.{name}, which is not on the "
            "allowlist (nothing was executed)"
        )

    def located(self, where: str) -> UnsafePickleError:
        """The same refusal, naming the file it came from."""
        return UnsafePickleError(self.module, self.name, where)


class MissingExtraError(CkptError):
    """An optional dependency (torch, zarr, megatron-core) is needed for this operation."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the '{package}' package, which is not installed: "
            f"pip install 'ckptdoctor[{extra}]'"
        )
