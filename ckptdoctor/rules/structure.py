"""Structure rules (CKD1xx): is the checkpoint complete and are its files where ``.metadata`` says?

Scanning never stops at the first problem: each file is probed on its own (``locate`` would refuse the
whole dir at the first one) and a :class:`Scanned` state is handed to the other families with whatever
could be read. Metadata only: no tensor bytes are read here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor.checkpoint import Checkpoint, Entry, checkpoint_from_index
from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError
from ckptdoctor.formats import torch_dist, zarr_meta
from ckptdoctor.formats.archive import ArchiveError
from ckptdoctor.formats.files import check_regular, list_names, read_json
from ckptdoctor.locate import (
    BACKEND_TORCH_DIST,
    BACKEND_ZARR,
    ITER_DIR_RE,
    TRACKER_NAME,
    CheckpointLocation,
    iteration_dir_name,
    list_iteration_dirs,
    read_tracker,
)
from ckptdoctor.rules import ERROR, WARNING, Finding, RuleInfo, finding
from ckptdoctor.rules.safety import refused_pickle, unlisted_globals


def _rule(code: str, name: str, severity: str, summary: str, rationale: str) -> RuleInfo:
    return RuleInfo(code, name, "structure", severity, summary, rationale)


NOT_A_CHECKPOINT = _rule(
    "CKD100",
    "not-a-checkpoint",
    ERROR,
    "directory is not a Megatron checkpoint",
    "No tracker, iteration dirs, metadata.json, .metadata, common.pt or .distcp files: nothing Megatron could load.",
)
METADATA_JSON_MISSING = _rule(
    "CKD101",
    "metadata-json-missing",
    ERROR,
    "metadata.json missing (incomplete save)",
    "Rank 0 writes metadata.json last, after every rank's data and .metadata; without it Megatron refuses "
    "the dir and the save was interrupted (or the tracker was updated before the data landed).",
)
METADATA_JSON_INVALID = _rule(
    "CKD102",
    "metadata-json-invalid",
    ERROR,
    "metadata.json is not valid JSON with a sharded_backend",
    "Megatron reads sharded_backend from metadata.json to pick the loader; a torn or edited file stops the load.",
)
UNSUPPORTED_FORMAT = _rule(
    "CKD103",
    "unsupported-format",
    ERROR,
    "not a distributed checkpoint ckptdoctor can check",
    "Legacy mp_rank_* checkpoints and backends other than torch_dist and zarr have a different layout; "
    "the other rules would report nonsense for them.",
)
DCP_METADATA_MISSING = _rule(
    "CKD110",
    "dcp-metadata-missing",
    ERROR,
    ".metadata missing",
    "The torch_dist index is written by the coordinator after all data files; without it no tensor can be found.",
)
DCP_METADATA_UNREADABLE = _rule(
    "CKD111",
    "dcp-metadata-unreadable",
    ERROR,
    ".metadata (or the zarr index) does not parse",
    "A truncated or garbage index is what an interrupted copy or a full disk leaves; torch.load fails on it.",
)
STORAGE_ENTRY_MISSING = _rule(
    "CKD112",
    "storage-entry-missing",
    ERROR,
    "a chunk or item has no storage entry in .metadata",
    "state_dict_metadata lists it but storage_data does not say where its bytes are: a badly merged or "
    "hand-edited .metadata; loading that key fails.",
)
DATA_FILE_MISSING = _rule(
    "CKD113",
    "data-file-missing",
    ERROR,
    "a data file referenced by .metadata does not exist",
    "A rank's .distcp file was not written, copied or uploaded; every key stored there is lost.",
)
DATA_FILE_TRUNCATED = _rule(
    "CKD114",
    "data-file-truncated",
    ERROR,
    "a data file is shorter than the byte ranges .metadata places in it",
    "An interrupted write or copy; the chunks past the end cannot be read.",
)
DATA_FILE_UNREFERENCED = _rule(
    "CKD115",
    "data-file-unreferenced",
    WARNING,
    "a .distcp file that no .metadata entry references",
    "Left over from another save into the same dir (or a .metadata from a different save): wasted space at "
    "best, a sign that .metadata and the data do not belong together at worst.",
)
TRACKER_INVALID = _rule(
    "CKD120",
    "tracker-invalid",
    ERROR,
    "latest_checkpointed_iteration.txt is unreadable or not a number",
    "Megatron parses the tracker to find the checkpoint to resume from; garbage there fails the resume.",
)
TRACKER_TARGET_MISSING = _rule(
    "CKD121",
    "tracker-target-missing",
    ERROR,
    "the tracker points to an iteration dir that does not exist",
    "The tracker was updated but the iteration dir was never written, deleted, or not copied along.",
)
TRACKER_MISSING = _rule(
    "CKD122",
    "tracker-missing",
    WARNING,
    "save dir with iteration dirs but no latest_checkpointed_iteration.txt",
    "Megatron finds nothing to resume from without the tracker and silently starts from scratch.",
)
COMMON_STATE_MISSING = _rule(
    "CKD130",
    "common-state-missing",
    ERROR,
    "no common state (neither common.pt nor a common_state item)",
    "The common state holds args, iteration and scheduler state; Megatron-LM cannot resume without it.",
)
COMMON_STATE_UNREADABLE = _rule(
    "CKD131",
    "common-state-unreadable",
    ERROR,
    "the common state does not deserialize",
    "A truncated or corrupt common.pt (or common_state item) fails torch.load before any tensor is read.",
)
ITERATION_MISMATCH = _rule(
    "CKD132",
    "iteration-mismatch",
    ERROR,
    "the common state's iteration differs from the iteration dir name",
    "A renamed or mis-copied dir: the run would resume at the saved iteration, not the one the name promises.",
)

RULES = [
    NOT_A_CHECKPOINT,
    METADATA_JSON_MISSING,
    METADATA_JSON_INVALID,
    UNSUPPORTED_FORMAT,
    DCP_METADATA_MISSING,
    DCP_METADATA_UNREADABLE,
    STORAGE_ENTRY_MISSING,
    DATA_FILE_MISSING,
    DATA_FILE_TRUNCATED,
    DATA_FILE_UNREFERENCED,
    TRACKER_INVALID,
    TRACKER_TARGET_MISSING,
    TRACKER_MISSING,
    COMMON_STATE_MISSING,
    COMMON_STATE_UNREADABLE,
    ITERATION_MISMATCH,
]


@dataclass
class Scanned:
    """What the structure pass could read of one iteration dir, for the other rule families."""

    iteration_dir: Path
    shown: Path  # the dir as the user named it, for messages
    checkpoint: Checkpoint | None = None  # None when the dir is not a checkable format
    common: dict | None = None  # None when missing or unreadable
    bad_files: set[str] = field(default_factory=set)  # data files missing or truncated

    def common_path(self) -> Path:
        """Where findings about the common state point: common.pt, or the dir for the DCP item."""
        if self.checkpoint is not None and self.checkpoint.common_source == "common.pt":
            return self.shown / "common.pt"
        return self.shown


def reason(error: Exception, *paths: object) -> str:
    """The message of a :class:`CkptError` without the leading ``<path>: `` (the finding names the path)."""
    text = str(error)
    for path in paths:
        prefix = f"{path}: "
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text


# --- save dirs and the tracker --------------------------------------------------------------------------


def check_save_dir(save_dir: Path, shown: Path, all_iterations: bool) -> tuple[list[Path], list[Finding]]:
    """Tracker findings, and the iteration dirs to check: the tracker's (else the newest), or all of them."""
    findings: list[Finding] = []
    iterations = list_iteration_dirs(save_dir)
    tracker = save_dir / TRACKER_NAME
    chosen: Path | None = None
    if tracker.is_file():
        try:
            value = read_tracker(tracker)
        except CkptError as exc:
            findings.append(finding(TRACKER_INVALID, shown / TRACKER_NAME, reason(exc, tracker)))
        else:
            target = save_dir / iteration_dir_name(value)
            if target.is_dir():
                chosen = target
            else:
                newest = f"newest present: {iterations[-1].name}" if iterations else "no iteration dirs present"
                findings.append(
                    finding(
                        TRACKER_TARGET_MISSING,
                        shown / TRACKER_NAME,
                        f"tracker says {value} but {target.name} does not exist ({newest})",
                    )
                )
    elif iterations:
        findings.append(
            finding(TRACKER_MISSING, shown, f"no {TRACKER_NAME}; Megatron would not resume from {iterations[-1].name}")
        )
    if all_iterations:
        return iterations, findings
    if chosen is None and iterations:
        chosen = iterations[-1]  # the tracker cannot be followed: check what a user would fall back to
    return ([chosen] if chosen is not None else []), findings


# --- one iteration dir ----------------------------------------------------------------------------------


def scan_iteration(directory: Path, shown: Path) -> tuple[Scanned, list[Finding]]:
    """Structure findings for one iteration dir, and what could be read of it."""
    state = Scanned(directory, shown)
    findings: list[Finding] = []
    try:
        names = set(list_names(directory))
    except OSError as exc:
        raise CkptError(f"{directory}: cannot list ({exc.strerror})") from None
    if any(n.startswith("mp_rank_") for n in names):
        findings.append(finding(UNSUPPORTED_FORMAT, shown, "legacy non-distributed checkpoint (mp_rank_* dirs)"))
        return state, findings

    backend, metadata_json = _check_metadata_json(directory, shown, names, findings)
    if backend is None:
        return state, findings
    match = ITER_DIR_RE.match(directory.name)
    location = CheckpointLocation(
        input_path=directory,
        iteration_dir=directory,
        backend=backend,
        metadata_json=metadata_json,
        has_common_pt=backend == BACKEND_ZARR or "common.pt" in names,
        iteration=int(match.group(1)) if match else None,
        release=directory.name == "release",
    )
    if backend == BACKEND_ZARR:
        state.checkpoint = _zarr_checkpoint(location, shown, findings)
    else:
        index = _read_index(directory, shown, names, findings)
        state.checkpoint = checkpoint_from_index(location, index)
        if index is not None:
            state.bad_files = check_storage(state.checkpoint, shown, findings)
    _check_common(state, index_known=state.checkpoint.dcp is not None or backend == BACKEND_ZARR, findings=findings)
    return state, findings


def _check_metadata_json(
    directory: Path, shown: Path, names: set[str], findings: list[Finding]
) -> tuple[str | None, dict]:
    """The backend to check the dir as (torch_dist when metadata.json cannot tell), or None to stop."""
    if "metadata.json" not in names:
        findings.append(
            finding(METADATA_JSON_MISSING, shown, "metadata.json missing (incomplete save: rank 0 writes it last)")
        )
        return (BACKEND_ZARR if _looks_like_zarr(directory, names) else BACKEND_TORCH_DIST), {}
    path = directory / "metadata.json"
    try:
        data: Any = read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        findings.append(finding(METADATA_JSON_INVALID, shown / "metadata.json", f"not valid JSON ({exc})"))
        return BACKEND_TORCH_DIST, {}
    if not isinstance(data, dict) or "sharded_backend" not in data:
        findings.append(finding(METADATA_JSON_INVALID, shown / "metadata.json", "no 'sharded_backend' field"))
        return BACKEND_TORCH_DIST, {}
    backend = data["sharded_backend"]
    if backend not in (BACKEND_TORCH_DIST, BACKEND_ZARR):
        findings.append(
            finding(
                UNSUPPORTED_FORMAT,
                shown / "metadata.json",
                f"sharded_backend {backend!r} (torch_dist and zarr are checked)",
            )
        )
        return None, data
    return backend, data


def _looks_like_zarr(directory: Path, names: set[str]) -> bool:
    """A legacy zarr save without its metadata.json: no DCP ``.metadata``, and array dirs with ``.zarray``."""
    if ".metadata" in names:
        return False
    return any((directory / name / ".zarray").is_file() for name in sorted(names) if (directory / name).is_dir())


def _read_index(directory: Path, shown: Path, names: set[str], findings: list[Finding]) -> torch_dist.DcpIndex | None:
    if ".metadata" not in names:
        findings.append(finding(DCP_METADATA_MISSING, shown, ".metadata missing: the torch_dist index cannot be read"))
        return None
    path = directory / ".metadata"
    try:
        index = torch_dist.read_metadata(path)
        findings.extend(unlisted_globals(list(index.unlisted), shown / ".metadata", "DCP metadata"))
        return index
    except (UnsafePickleError, PickleLimitError) as exc:
        findings.append(refused_pickle(exc, shown / ".metadata", "DCP metadata"))
    except CkptError as exc:
        findings.append(finding(DCP_METADATA_UNREADABLE, shown / ".metadata", reason(exc, path)))
    return None


def _zarr_checkpoint(location: CheckpointLocation, shown: Path, findings: list[Finding]) -> Checkpoint:
    try:
        entries, sizes = zarr_meta.read_index(location.iteration_dir)
    except CkptError as exc:
        findings.append(finding(DCP_METADATA_UNREADABLE, shown, reason(exc)))
        entries, sizes = {}, {}
    return Checkpoint(location, {k: Entry(*v) for k, v in entries.items()}, sizes)


def check_storage(checkpoint: Checkpoint, shown: Path, findings: list[Finding]) -> set[str]:
    """Missing and truncated data files, chunks without storage, unreferenced files; returns the bad files.

    The one storage check: ``check`` (CKD112-115) and the write commands' refusal of a damaged source
    (:func:`ckptdoctor.ops.strip.structural_problems`) both read these findings."""
    ends: dict[str, int] = {}
    unplaced: list[str] = []
    for entry in checkpoint.entries.values():
        for chunk in entry.chunks:
            storage = chunk.storage
            if storage is None:
                unplaced.append(entry.key)
                continue
            end = storage.offset + storage.length
            if end > ends.get(storage.relative_path, -1):
                ends[storage.relative_path] = end
    if unplaced:
        keys = sorted(set(unplaced))
        example = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        findings.append(
            finding(
                STORAGE_ENTRY_MISSING, shown / ".metadata", f"{len(unplaced)} chunk(s) have no storage entry: {example}"
            )
        )
    bad = _unreadable(checkpoint, shown, sorted(ends), findings)
    sizes = checkpoint.data_files
    by_file: dict[str, list[tuple[int, str]]] | None = None
    for relative, end in sorted(ends.items()):
        if relative in bad:
            continue
        size = sizes.get(relative)
        if size is None:
            try:
                size = (checkpoint.iteration_dir / relative).stat().st_size
            except OSError:
                bad.add(relative)
                by_file = by_file or _keys_by_file(checkpoint)
                keys = _keys_in(by_file, relative)
                findings.append(
                    finding(
                        DATA_FILE_MISSING,
                        shown,
                        f"{relative} missing: {len(keys)} key(s) stored there (e.g. {keys[0]})",
                    )
                )
                continue
        if end > size:
            bad.add(relative)
            by_file = by_file or _keys_by_file(checkpoint)
            lost = _keys_in(by_file, relative, past=size)
            findings.append(
                finding(
                    DATA_FILE_TRUNCATED,
                    shown / relative,
                    f"truncated: {size} bytes, but .metadata places data up to byte {end}; "
                    f"{len(lost)} key(s) cut off (e.g. {lost[0]})",
                )
            )
    for name in sorted(set(sizes) - set(ends)):
        findings.append(finding(DATA_FILE_UNREFERENCED, shown / name, "no .metadata entry references this file"))
    return bad


def _unreadable(checkpoint: Checkpoint, shown: Path, relatives: list[str], findings: list[Finding]) -> set[str]:
    """Referenced data files present but not readable as regular files (permissions, a dir, ...)."""
    bad: set[str] = set()
    for relative in relatives:
        try:  # never blocks: a FIFO named like a data file must not hang the check
            check_regular(checkpoint.iteration_dir / relative)
        except FileNotFoundError:
            continue  # missing: reported by the caller
        except OSError as exc:
            bad.add(relative)
            keys = _keys_in(_keys_by_file(checkpoint), relative)
            findings.append(
                finding(
                    DATA_FILE_MISSING,
                    shown / relative,
                    f"unreadable ({exc.strerror or exc}): {len(keys)} key(s) stored there (e.g. {keys[0]})",
                )
            )
    return bad


def _keys_by_file(checkpoint: Checkpoint) -> dict[str, list[tuple[int, str]]]:
    """relative data file -> (range end, key) for each chunk stored there (built only when a file is bad)."""
    by_file: dict[str, list[tuple[int, str]]] = {}
    for entry in checkpoint.entries.values():
        for c in entry.chunks:
            if c.storage is not None:
                by_file.setdefault(c.storage.relative_path, []).append((c.storage.offset + c.storage.length, entry.key))
    return by_file


def _keys_in(by_file: dict[str, list[tuple[int, str]]], relative: str, past: int = -1) -> list[str]:
    """Keys with a chunk in ``relative`` whose byte range ends after ``past``."""
    return sorted({key for end, key in by_file.get(relative, ()) if end > past})


def _check_common(state: Scanned, index_known: bool, findings: list[Finding]) -> None:
    checkpoint = state.checkpoint
    assert checkpoint is not None
    source = checkpoint.common_source
    if source is None:
        if index_known:  # without an index a common_state item cannot be ruled out
            findings.append(
                finding(
                    COMMON_STATE_MISSING,
                    state.shown,
                    "no common state: neither common.pt nor a common_state item in .metadata",
                )
            )
        return
    path = state.common_path()
    what = "common state" if source == "common.pt" else f"common state (item {source})"
    try:
        state.common = checkpoint.common_state()
        findings.extend(unlisted_globals(checkpoint.common_unlisted, path, what))
    except (UnsafePickleError, PickleLimitError, ArchiveError) as exc:
        findings.append(refused_pickle(exc, path, what))
        return
    except CkptError as exc:
        detail = reason(
            exc,
            checkpoint.iteration_dir / "common.pt",
            f"{checkpoint.iteration_dir}: item {source}",
            checkpoint.iteration_dir,
        )
        findings.append(finding(COMMON_STATE_UNREADABLE, path, f"{what} unreadable: {detail}"))
        return
    saved = state.common.get("iteration")
    location = checkpoint.location
    if location.iteration is not None and isinstance(saved, int) and saved != location.iteration:
        findings.append(
            finding(ITERATION_MISMATCH, path, f"common state says iteration {saved}, the dir name {location.iteration}")
        )
