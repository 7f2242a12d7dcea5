"""Find the checkpoint a user means and tell which backend and Megatron era wrote it.

Accepted: a save dir holding ``latest_checkpointed_iteration.txt`` (followed, or overridden by
``iteration``), an iteration dir (``iter_0000010`` or ``release``), any file inside one, or a NeMo 2 style
checkpoint dir whose ``weights/`` subdir is the distributed checkpoint; each as a local path or a URL
(``s3://...``, ``msc://profile/...``: :func:`ckptdoctor.storage.dispatch.as_path` chooses the storage).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.formats import BACKEND_DCP, BACKEND_TORCH_DIST, BACKEND_ZARR, BACKENDS, ERA_DCP, era, guess_backend
from ckptdoctor.formats.plain_dcp import FLAVOUR_NAMES, STEP_DIR_RE, step_number
from ckptdoctor.formats.train_state import BRIDGE_TRACKER_NAME as BRIDGE_TRACKER_NAME  # re-exported
from ckptdoctor.formats.train_state import read_train_state_step
from ckptdoctor.problems import METADATA_JSON_INVALID, METADATA_JSON_MISSING, UNSUPPORTED_FORMAT, Problem
from ckptdoctor.storage.dispatch import as_path
from ckptdoctor.storage.files import list_names, open_regular, read_json
from ckptdoctor.storage.remote import RemotePath

TRACKER_NAME = "latest_checkpointed_iteration.txt"
NEMO_WEIGHTS_DIR = "weights"
# ASCII digits only and no trailing newline (``$`` would allow one): Megatron writes ``iter_{:07d}``.
ITER_DIR_RE = re.compile(r"^iter_([0-9]{7,})\Z")


@dataclass
class CheckpointLocation:
    """Where a checkpoint lives on disk and what wrote it (no tensor data read).

    :func:`locate` fills in where; :func:`read_backend` (called by :func:`ckptdoctor.checkpoint.scan`) what wrote it
    (backend, metadata.json)."""

    input_path: Path
    iteration_dir: Path
    save_dir: Path | None = None
    tracker_path: Path | None = None
    tracker_value: str | None = None
    iteration: int | None = None  # from the dir name; None for ``release``
    release: bool = False
    backend: str = BACKEND_TORCH_DIST
    metadata_json: dict = field(default_factory=dict)
    has_common_pt: bool = False
    flavour: str | None = None  # plain DCP only: whose conventions its state dict follows (formats.plain_dcp)

    @property
    def era(self) -> str:
        if self.backend == BACKEND_DCP and self.flavour is not None:
            return f"{FLAVOUR_NAMES[self.flavour]} ({ERA_DCP})"
        return era(self.backend, self.has_common_pt)

    @property
    def name(self) -> str:
        return str(self.input_path)


def iteration_dir_name(iteration: str | int) -> str:
    if str(iteration) == "release":
        return "release"
    try:
        number = int(iteration)
    except ValueError:
        raise CkptError(f"not an iteration number: {iteration!r}") from None
    if number < 0:
        raise CkptError(f"not an iteration number: {iteration!r} (iterations count from 0)")
    return f"iter_{number:07d}"


_TRACKER_MAX = 4096  # Megatron writes a number or 'release'


def read_tracker(tracker: Path) -> str:
    """The tracker's verdict as Megatron-LM reaches it: an iteration number as a plain decimal string, or 'release'.

    Megatron reads ``int(f.read().strip())``, falls back to ``release`` when the stripped text is exactly that,
    and asserts ``iteration > 0 or release``; so ``+10``, `` 10\\n`` and ``1_0`` all mean iteration 10 (returned
    as ``"10"``). Non-ASCII digits, which ``int()`` also accepts (``'\\u0661\\u0660'`` is 10), are refused: no
    Megatron save writes them, so they are garbage or hostile.
    """
    try:
        with open_regular(tracker) as f:  # a FIFO is an error, not a hang
            data = f.read(_TRACKER_MAX + 1)
    except OSError as exc:
        raise CkptError(f"{tracker}: cannot read tracker ({exc.strerror})") from None
    if len(data) > _TRACKER_MAX:
        raise CkptError(
            f"{tracker}: tracker holds more than {_TRACKER_MAX} bytes, not an iteration number or 'release'"
        )
    value = data.decode("utf-8", errors="replace").strip()
    if value == "release":
        return value
    shown = repr(value[:40])
    if not value.isascii():
        raise CkptError(
            f"{tracker}: tracker holds {ascii(value[:40])}: non-ASCII characters, not an iteration number or 'release'"
        )
    try:
        iteration = int(value)
    except ValueError:
        raise CkptError(f"{tracker}: tracker holds {shown}, not an iteration number or 'release'") from None
    if iteration <= 0:
        raise CkptError(f"{tracker}: tracker holds {shown}; Megatron needs an iteration > 0 or 'release'")
    return str(iteration)


def list_dir(directory: Path) -> list[str]:
    """Names in ``directory``; a dir that cannot be listed is one clear error naming it."""
    try:
        return list_names(directory)
    except OSError as exc:
        raise CkptError(f"{directory}: cannot list ({exc.strerror or exc})") from None


def iteration_number(name: str) -> int | None:
    """The iteration of a checkpoint dir's name: Megatron's ``iter_0000010`` or TorchTitan's ``step-10``. Only the
    name the writer gives that iteration (``iter_{:07d}``, ``step-{}``): ``iter_00000010`` is no dir Megatron loads,
    and read as 10 it made two dirs of one iteration (history listed both, latest-good and inspect -i chose apart)."""
    match = ITER_DIR_RE.match(name)
    if match:
        number = int(match.group(1))
        return number if name == iteration_dir_name(number) else None
    step = step_number(name)
    return step if step is not None and name == f"step-{step}" else None


RELEASE = "release"  # Megatron's iteration dir of a converted (not trained) checkpoint; its tracker says "release"


def is_iteration_dir_name(name: str) -> bool:
    return iteration_number(name) is not None or name == RELEASE


def list_iteration_dirs(save_dir: Path) -> list[Path]:
    """Iteration dirs in a save dir (Megatron's ``iter_*`` and ``release``, TorchTitan's ``step-N``), oldest
    first (``release`` last; only where it is one: see :func:`looks_like_iteration_dir`)."""
    found = [save_dir / n for n in list_dir(save_dir) if is_iteration_dir_name(n)]
    return sorted(
        (p for p in found if p.is_dir() and (p.name != RELEASE or looks_like_iteration_dir(p))),
        key=lambda p: (p.name == RELEASE, iteration_number(p.name) or 0, p.name),
    )


def looks_like_iteration_dir(directory: Path) -> bool:
    """An iteration dir by its name (``iter_0000010``, ``step-10``), or by holding checkpoint files (a bare
    metadata.json must name a backend). ``release`` is a common word (a repository's release/ folder): by name only
    beside a tracker, else by its files."""
    if iteration_number(directory.name) is not None:
        return True
    if directory.name == RELEASE and (directory.parent / TRACKER_NAME).is_file():
        return True
    try:
        names = list_names(directory)
    except OSError:
        return False
    if any(n == "common.pt" or n.endswith(".distcp") or n.startswith("mp_rank_") for n in names):
        return True
    # DCP's index is a file (an Eclipse workspace keeps a .metadata/ folder beside its projects)
    if ".metadata" in names and (isinstance(directory, RemotePath) or not (directory / ".metadata").is_dir()):
        return True
    if "metadata.json" in names:
        try:
            return "sharded_backend" in read_json(directory / "metadata.json")
        except (OSError, UnicodeDecodeError, ValueError, TypeError):
            return False
    return False


def locate(path: str | Path, iteration: str | int | None = None) -> CheckpointLocation:
    """Resolve ``path`` to one iteration dir; raises :class:`CkptError` with one clear message."""
    input_path = as_path(path)
    if not input_path.exists():
        raise CkptError(f"{input_path}: no such file or directory")
    save_dir: Path | None = None
    tracker_path: Path | None = None
    tracker_value: str | None = None

    if input_path.is_file():
        if input_path.name == TRACKER_NAME:
            candidate = input_path.parent
        else:
            candidate = _enclosing_iteration_dir(input_path)
    else:
        candidate = input_path
    if candidate.is_dir():
        list_dir(candidate)  # a dir that cannot be listed: one error naming it, before a stat inside it fails
    # NeMo 2 / Megatron-Bridge export layout: <ckpt>/weights/ holds the distributed checkpoint, <ckpt>/context/
    # the configs. Accept the outer dir too.
    nested = candidate / NEMO_WEIGHTS_DIR
    if (
        candidate.is_dir()
        and not looks_like_iteration_dir(candidate)
        and nested.is_dir()
        and looks_like_iteration_dir(nested)
    ):
        candidate = nested

    if (candidate / TRACKER_NAME).is_file() or (iteration is not None and not looks_like_iteration_dir(candidate)):
        save_dir = candidate
        if (candidate / TRACKER_NAME).is_file():
            tracker_path = candidate / TRACKER_NAME
            tracker_value = read_tracker(tracker_path)
        chosen = str(iteration) if iteration is not None else tracker_value
        iteration_dir = save_dir / iteration_dir_name(chosen)  # type: ignore[arg-type]
        if not iteration_dir.is_dir() and (save_dir / f"step-{chosen}").is_dir():  # TorchTitan's step-N
            iteration_dir = save_dir / f"step-{chosen}"
        if not iteration_dir.is_dir():
            what = "--iteration" if iteration is not None else f"tracker {tracker_path}"
            raise CkptError(f"{iteration_dir}: {what} points to an iteration dir that does not exist")
    elif looks_like_iteration_dir(candidate):
        if iteration is not None and candidate.name not in (iteration_dir_name(iteration), f"step-{iteration}"):
            # --iteration picks one of a save dir's iteration dirs; naming another dir is a mistake to say, not
            # to ignore (a write would go to the dir the user did not ask for)
            raise CkptError(
                f"{candidate}: an iteration dir, not the {iteration_dir_name(iteration)} that --iteration "
                f"{iteration} asks for (--iteration picks one dir of a save dir: give {candidate.parent}, or "
                "drop --iteration)"
            )
        iteration_dir = candidate
        if candidate.parent.joinpath(TRACKER_NAME).is_file():
            save_dir = candidate.parent
            tracker_path = save_dir / TRACKER_NAME
            tracker_value = read_tracker(tracker_path)
    else:
        iters = list_iteration_dirs(candidate) if candidate.is_dir() else []
        bridge = candidate / BRIDGE_TRACKER_NAME
        if iters and bridge.is_file():  # Megatron-Bridge resumes from its own tracker where the text one is missing
            save_dir, tracker_path, tracker_value = candidate, bridge, str(read_train_state_step(bridge))
            iteration_dir = save_dir / iteration_dir_name(tracker_value)
            if not iteration_dir.is_dir():
                what = f"Megatron-Bridge's tracker {bridge}"
                raise CkptError(f"{iteration_dir}: {what} points to an iteration dir that does not exist")
        elif iters and all(STEP_DIR_RE.match(p.name) for p in iters):  # TorchTitan: no tracker, the newest step
            save_dir, iteration_dir = candidate, iters[-1]
        elif iters:
            names = ", ".join(p.name for p in iters[-5:])
            # Megatron, too, reads the tracker only when it is a regular file (os.path.isfile)
            tracker = candidate / TRACKER_NAME
            what = f"whose {TRACKER_NAME} is not a regular file" if tracker.exists() else f"without {TRACKER_NAME}"
            raise CkptError(f"{candidate}: save dir {what}; choose one with --iteration N ({names})")
        elif candidate != input_path:  # a file in no checkpoint dir: the file is named, not the dir it is in
            raise CkptError(
                f"{input_path}: not a Megatron checkpoint file (no metadata.json, .metadata or tracker beside it)"
            )
        else:
            raise CkptError(f"{candidate}: not a Megatron checkpoint (no metadata.json, .metadata or tracker)")

    location = iteration_location(iteration_dir, input_path)
    location.save_dir, location.tracker_path, location.tracker_value = save_dir, tracker_path, tracker_value
    return location


def iteration_location(iteration_dir: Path, input_path: Path | None = None) -> CheckpointLocation:
    """The location of one iteration dir, its iteration number read from the name (None for ``release``)."""
    return CheckpointLocation(
        input_path=iteration_dir if input_path is None else input_path,
        iteration_dir=iteration_dir,
        iteration=iteration_number(iteration_dir.name),
        release=iteration_dir.name == "release",
    )


def _enclosing_iteration_dir(file_path: Path) -> Path:
    # A file inside an iteration dir, or inside a zarr array dir one level deeper.
    for parent in list(file_path.parents)[:3]:
        if looks_like_iteration_dir(parent) or (parent / TRACKER_NAME).is_file():
            return parent
    return file_path.parent


def read_backend(location: CheckpointLocation, names: set[str], problems: list[Problem]) -> str | None:
    """The backend to read ``location``'s iteration dir (holding ``names``) as: metadata.json's, checked against the
    files (guessed from them when metadata.json cannot tell or contradicts them), or None: not one we read. Fills in
    ``location.metadata_json``; what is wrong goes to ``problems``."""
    directory = location.iteration_dir
    if "metadata.json" not in names:
        problems.append(
            Problem(METADATA_JSON_MISSING, directory, "metadata.json missing (incomplete save: rank 0 writes it last)")
        )
        return guess_backend(directory, names)
    path = directory / "metadata.json"
    try:
        data: Any = read_json(path)
    except OSError as exc:  # a FIFO, a dir, no permission: unreadable, whatever it holds
        problems.append(Problem(METADATA_JSON_INVALID, path, f"cannot read ({exc.strerror})"))
        return guess_backend(directory, names)
    except json.JSONDecodeError as exc:  # read_json reports bad UTF-8 as one too
        problems.append(Problem(METADATA_JSON_INVALID, path, f"not valid JSON ({exc})"))
        return guess_backend(directory, names)
    if not isinstance(data, dict) or "sharded_backend" not in data:
        problems.append(
            Problem(METADATA_JSON_INVALID, path, "no 'sharded_backend' field; not a Megatron dist checkpoint")
        )
        return guess_backend(directory, names)
    location.metadata_json = data
    backend = data["sharded_backend"]
    if backend not in BACKENDS:
        problems.append(
            Problem(
                UNSUPPORTED_FORMAT,
                path,
                f"sharded_backend {backend!r} is not supported (ckptdoctor reads {' and '.join(BACKENDS)})",
            )
        )
        return None
    files_say = guess_backend(directory, names)
    if files_say != backend and (backend == BACKEND_TORCH_DIST or ".metadata" in names):
        held = "zarr arrays and no .metadata" if files_say == BACKEND_ZARR else "a DCP .metadata and no zarr array"
        problems.append(
            Problem(
                METADATA_JSON_INVALID,
                path,
                f"sharded_backend {backend!r}, but the dir holds {held}: Megatron picks its loader by this field "
                f"and would find no tensor (read here as {files_say})",
            )
        )
        return files_say
    return str(backend)
