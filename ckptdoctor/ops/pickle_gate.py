"""The gate every write command passes before copying a checkpoint's pickles to a new place.

Write commands hard-link or copy bytes items (rng state, ``_extra_state``, optimizer leftovers) unchanged;
Megatron unpickles them with ``weights_only=False`` on load. A bytes item holding a global outside the
allowlist (or breaking a limit, or an archive torch would read differently) is never carried to the next
loader: the write is refused, naming the file, the item and the global. ``--force`` does not override it.
"""

from __future__ import annotations

from collections.abc import Collection

from ckptdoctor.checkpoint import Checkpoint, decode_object_bytes
from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError
from ckptdoctor.formats.archive import ArchiveError, is_torch_zip
from ckptdoctor.formats.files import open_regular


def refuse_unsafe_pickles(checkpoint: Checkpoint, keys: Collection[str] | None = None) -> None:
    """Decode every bytes item (of ``keys``, when given: the items a write carries over) through the safe
    unpickler; raise :class:`CkptError` at the first refusal.

    Damaged archives are not this gate's business (torch reads nothing of a damaged zip); only refusals stop it,
    and an item that is no zip archive at all (torch.load unpickles it as a legacy-format save).
    The ``.metadata`` is read through the same unpickler before any write anyway; so is a ``common.pt``, here
    (``edit`` links it unchanged, reading it only when it changes args).
    """
    if checkpoint.common_source == "common.pt":
        _refuse_unsafe_common_pt(checkpoint)
    for entry in checkpoint.entries.values():
        if keys is not None and entry.key not in keys:
            continue
        location = entry.chunks[0].storage if entry.chunks else None
        if entry.kind == "tensor" or location is None:
            continue
        try:
            data, where = checkpoint.bytes_item_data(entry.key)
            if data and not is_torch_zip(data):
                # torch.load reads it as a legacy save: pickle.load from its first byte, which runs what the
                # pickle names before anything checks the format (even where the rest is garbage)
                raise ArchiveError(f"{where}: not a torch.save archive, which torch.load unpickles as a legacy save")
            decode_object_bytes(data, where)
        except (UnsafePickleError, PickleLimitError, ArchiveError) as exc:
            path = checkpoint.iteration_dir / location.relative_path
            detail = str(exc).split(": ", 2)[-1] if ": " in str(exc) else str(exc)
            raise CkptError(
                f"{path}: item {entry.key}: {detail}; refusing to copy a pickle that a real load "
                "would execute or choke on (--force does not override this)"
            ) from None
        except CkptError:
            continue


def _refuse_unsafe_common_pt(checkpoint: Checkpoint) -> None:
    path = checkpoint.iteration_dir / "common.pt"
    try:
        with open_regular(path) as f:
            head = f.read(4)
        if head and not is_torch_zip(head):  # torch.load unpickles it as a legacy save, as a bytes item above
            raise ArchiveError(f"{path}: not a torch.save archive, which torch.load unpickles as a legacy save")
        checkpoint.common_state()
    except (UnsafePickleError, PickleLimitError, ArchiveError) as exc:
        why = "not copied: a real load would execute or choke on it (--force does not override this)"
        raise CkptError(f"{exc}; {why}") from None
    except CkptError:
        return
