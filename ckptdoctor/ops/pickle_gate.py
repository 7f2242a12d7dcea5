"""The gate every write command passes before copying a checkpoint's pickles to a new place.

Write commands hard-link or copy bytes items (rng state, ``_extra_state``, optimizer leftovers) unchanged;
Megatron unpickles them with ``weights_only=False`` on load. A bytes item holding a global outside the
allowlist (or breaking a limit, or an archive torch would read differently) is never carried to the next
loader: the write is refused, naming the file, the item and the global. ``--force`` does not override it.
"""

from __future__ import annotations

from collections.abc import Collection

from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError
from ckptdoctor.formats.archive import ArchiveError


def refuse_unsafe_pickles(checkpoint: Checkpoint, keys: Collection[str] | None = None) -> None:
    """Decode every bytes item (of ``keys``, when given: the items a write carries over) through the safe
    unpickler; raise :class:`CkptError` at the first refusal.

    Damaged items are not this gate's business (a garbage item executes nothing); only refusals stop it.
    The ``.metadata`` and the common state are read through the same unpickler before any write anyway.
    """
    for entry in checkpoint.entries.values():
        if keys is not None and entry.key not in keys:
            continue
        if entry.kind == "tensor" or not entry.chunks or entry.chunks[0].storage is None:
            continue
        try:
            checkpoint.read_bytes_item(entry.key)
        except (UnsafePickleError, PickleLimitError, ArchiveError) as exc:
            path = checkpoint.iteration_dir / entry.chunks[0].storage.relative_path
            detail = str(exc).split(": ", 2)[-1] if ": " in str(exc) else str(exc)
            raise CkptError(
                f"{path}: item {entry.key}: {detail}; refusing to copy a pickle that a real load "
                "would execute or choke on (--force does not override this)"
            ) from None
        except CkptError:
            continue
