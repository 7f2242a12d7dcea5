"""Structure rules (CKD1xx): is the checkpoint complete and are its files where ``.metadata`` says?

The problems are found by :func:`ckptdoctor.checkpoint.scan` and :func:`ckptdoctor.data_files.storage_problems`
(where ``open_checkpoint`` refuses at the first fatal one, check reports them all); this module gives each code its
rule and rationale, and checks the save dir's tracker and the common state. A :class:`Scanned` state is handed to
the other families with whatever could be read. Metadata only: no tensor bytes are read here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor import problems
from ckptdoctor.checkpoint import Checkpoint, scan_iteration_dir
from ckptdoctor.data_files import storage_problems
from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError, without_path
from ckptdoctor.formats import BACKEND_DCP
from ckptdoctor.formats.archive import ArchiveError
from ckptdoctor.formats.plain_dcp import STEP_DIR_RE
from ckptdoctor.formats.train_state import BRIDGE_TRACKER_NAME
from ckptdoctor.locate import TRACKER_NAME, iteration_dir_name, list_iteration_dirs, read_tracker
from ckptdoctor.problems import Problem
from ckptdoctor.rules import ERROR, WARNING, Finding, bridge, family_rule, finding
from ckptdoctor.rules.safety import (
    ARCHIVE_ANOMALY,
    PICKLE_LIMIT,
    UNLISTED_GLOBAL,
    UNSAFE_PICKLE,
    refused_pickle,
    run_config_findings,
    saved_spec_findings,
    unlisted_globals,
)
from ckptdoctor.storage.interface import StorageUnavailable

_rule = family_rule("structure")


NOT_A_CHECKPOINT = _rule(
    "CKD100",
    "not-a-checkpoint",
    ERROR,
    "directory is not a Megatron checkpoint",
    "No tracker, iteration dirs, metadata.json, .metadata, common.pt or .distcp files: nothing Megatron could load.",
)
METADATA_JSON_MISSING = _rule(
    problems.METADATA_JSON_MISSING,
    "metadata-json-missing",
    ERROR,
    "metadata.json missing (incomplete save)",
    "Rank 0 writes metadata.json last, after every rank's data and .metadata; without it Megatron refuses "
    "the dir and the save was interrupted (or the tracker was updated before the data landed).",
)
METADATA_JSON_INVALID = _rule(
    problems.METADATA_JSON_INVALID,
    "metadata-json-invalid",
    ERROR,
    "metadata.json is not valid JSON with a sharded_backend, or names a backend the files are not",
    "Megatron reads sharded_backend from metadata.json to pick the loader; a torn or edited file stops the load, "
    "and so does a backend the dir's files are not (zarr over a DCP .metadata, torch_dist over zarr arrays).",
)
UNSUPPORTED_FORMAT = _rule(
    problems.UNSUPPORTED_FORMAT,
    "unsupported-format",
    ERROR,
    "not a distributed checkpoint ckptdoctor can check",
    "Legacy mp_rank_* checkpoints and backends other than torch_dist and zarr named by metadata.json have a "
    "different layout; the other rules would report nonsense for them. (Plain PyTorch DCP saves without "
    "metadata.json, Megatron-LM torch_dcp / fsdp_dtensor, FSDP2, TorchTitan, are read as the dcp backend.)",
)
DCP_METADATA_MISSING = _rule(
    problems.INDEX_MISSING,
    "dcp-metadata-missing",
    ERROR,
    ".metadata missing",
    "The torch_dist index is written by the coordinator after all data files; without it no tensor can be found.",
)
DCP_METADATA_UNREADABLE = _rule(
    problems.INDEX_UNREADABLE,
    "dcp-metadata-unreadable",
    ERROR,
    ".metadata (or the zarr index) does not parse",
    "A truncated or garbage index is what an interrupted copy or a full disk leaves; torch.load fails on it.",
)
STORAGE_ENTRY_MISSING = _rule(
    problems.STORAGE_ENTRY_MISSING,
    "storage-entry-missing",
    ERROR,
    "a chunk or item has no storage entry in .metadata",
    "state_dict_metadata lists it but storage_data does not say where its bytes are: a badly merged or "
    "hand-edited .metadata; loading that key fails.",
)
DATA_FILE_MISSING = _rule(
    problems.DATA_FILE_MISSING,
    "data-file-missing",
    ERROR,
    "a data file referenced by .metadata does not exist",
    "A rank's .distcp file was not written, copied or uploaded; every key stored there is lost.",
)
DATA_FILE_TRUNCATED = _rule(
    problems.DATA_FILE_TRUNCATED,
    "data-file-truncated",
    ERROR,
    "a data file is shorter than the byte ranges .metadata places in it",
    "An interrupted write or copy; the chunks past the end cannot be read.",
)
DATA_FILE_UNREFERENCED = _rule(
    problems.DATA_FILE_UNREFERENCED,
    "data-file-unreferenced",
    WARNING,
    "a .distcp file that no .metadata entry references",
    "Left over from another save into the same dir (or a .metadata from a different save): wasted space at "
    "best, a sign that .metadata and the data do not belong together at worst. A file a .metadata.bak-<stamp> "
    "references (an in-place fix-args run's backup) is not counted: restoring that backup needs it.",
)
NO_MODEL_TENSORS = _rule(
    "CKD116",
    "no-model-tensors",
    ERROR,
    "the index lists no tensor of the model section",
    "Every Megatron save holds the model's parameters (a --save-trainable-params-only save, its trainable ones); "
    "an index without any is empty or belongs to another save, and a load finds nothing to restore.",
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
STAGED_DIFFERS = _rule(
    "CKD160",
    "staged-differs",
    ERROR,
    "check --staged read a file of the checkpoint that the commit will not hold as read",
    "check reads the working tree; a file there that is not staged (untracked, ignored, or removed with git rm "
    "--cached) is left out of the commit, and a file changed since it was staged is committed as staged. Either "
    "way what was checked is not what is committed (a partial checkpoint, or staged bytes nobody read), so the "
    "gate cannot pass it: stage the files, move them out, or check with the changes stashed. Always reported, "
    "as the gate is: --select, --ignore and per-path-ignores do not hide it. Dot files no loader reads "
    "(.DS_Store, a .metadata.bak-<stamp> backup) and Thumbs.db or desktop.ini are not counted.",
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
    NO_MODEL_TENSORS,
    TRACKER_INVALID,
    TRACKER_TARGET_MISSING,
    TRACKER_MISSING,
    COMMON_STATE_MISSING,
    COMMON_STATE_UNREADABLE,
    ITERATION_MISMATCH,
    STAGED_DIFFERS,
]
_RULES_BY_CODE = {rule.code: rule for rule in RULES}
_REFUSAL_CODES = frozenset({UNSAFE_PICKLE.code, UNLISTED_GLOBAL.code, PICKLE_LIMIT.code, ARCHIVE_ANOMALY.code})


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


# --- save dirs and the tracker --------------------------------------------------------------------------


def check_save_dir(save_dir: Path, shown: Path, all_iterations: bool) -> tuple[list[Path], list[Finding]]:
    """Tracker findings (Megatron-LM's and Megatron-Bridge's), and the iteration dirs to check: each tracker's
    (else the newest), or all of them."""
    findings: list[Finding] = []
    iterations = list_iteration_dirs(save_dir)
    tracker = save_dir / TRACKER_NAME
    chosen: Path | None = None
    text_value: str | None = None
    if tracker.is_file():
        try:
            value = read_tracker(tracker)
        except StorageUnavailable:
            raise  # the storage failed, not the tracker (exit 2)
        except CkptError as exc:
            findings.append(finding(TRACKER_INVALID, shown / TRACKER_NAME, without_path(exc, tracker)))
        else:
            target = save_dir / iteration_dir_name(value)
            if target.is_dir():
                chosen, text_value = target, value
            else:
                newest = f"newest present: {iterations[-1].name}" if iterations else "no iteration dirs present"
                findings.append(
                    finding(
                        TRACKER_TARGET_MISSING,
                        shown / TRACKER_NAME,
                        f"tracker says {value} but {target.name} does not exist ({newest})",
                    )
                )
    bridge_target, bridge_findings = bridge.check_bridge_tracker(save_dir, shown, text_value, iterations)
    titan = bool(iterations) and all(STEP_DIR_RE.match(p.name) for p in iterations)  # resumes from the newest
    if not tracker.is_file() and iterations and not titan:
        also = (
            f" (Megatron-Bridge resumes from {bridge_target.name}: {BRIDGE_TRACKER_NAME})"
            if bridge_target is not None
            else ""
        )
        what = (
            f"{TRACKER_NAME} is not a regular file"
            if tracker.exists() or tracker.is_symlink()
            else f"no {TRACKER_NAME}"
        )
        message = f"{what}; Megatron would not resume from {iterations[-1].name}{also}"
        findings.append(finding(TRACKER_MISSING, shown, message))
    findings += bridge_findings
    if all_iterations:
        return iterations, findings
    if chosen is None and iterations:
        chosen = iterations[-1]  # the tracker cannot be followed: check what a user would fall back to
    resumed = {p for p in (chosen, bridge_target) if p is not None}  # both where Megatron-LM and Bridge disagree
    return sorted(resumed, key=lambda p: (p.name == "release", p.name)), findings


# --- one iteration dir ----------------------------------------------------------------------------------


def scan_iteration(directory: Path, shown: Path) -> tuple[Scanned, list[Finding]]:
    """Structure findings for one iteration dir, and what could be read of it."""
    state = Scanned(directory, shown)
    result = scan_iteration_dir(directory)
    findings = [_finding(problem, directory, shown) for problem in result.problems]
    state.checkpoint = result.checkpoint
    if state.checkpoint is None:
        return state, findings
    if state.checkpoint.dcp is not None:
        findings.extend(unlisted_globals(list(state.checkpoint.dcp.unlisted), shown / ".metadata", "DCP metadata"))
    if result.index_known:
        on_disk, state.bad_files = storage_problems(state.checkpoint)
        findings += [_finding(problem, directory, shown) for problem in on_disk]
        if not any(entry.kind == "tensor" for entry in state.checkpoint.section_entries("model")):
            index = shown / ".metadata" if state.checkpoint.dcp is not None else shown
            keys = len(state.checkpoint.entries)
            findings.append(
                finding(
                    NO_MODEL_TENSORS,
                    index,
                    f"no model tensor among its {keys} key{'s' if keys != 1 else ''}: a load finds nothing to restore",
                )
            )
    _check_common(state, index_known=result.index_known, findings=findings)
    findings += bridge.check_train_state(directory, shown)
    findings += run_config_findings(directory, shown)  # Megatron-Bridge instantiates its _target_ entries
    return state, findings


def _finding(problem: Problem, directory: Path, shown: Path) -> Finding:
    """A scan problem as a finding, its path as the user named the dir."""
    try:
        path = shown / problem.path.relative_to(directory)
    except ValueError:
        path = problem.path
    if problem.error is not None and problem.code in _REFUSAL_CODES:
        return refused_pickle(problem.error, path, "DCP metadata")
    made = finding(_RULES_BY_CODE[problem.code], path, problem.detail)
    return dataclasses.replace(made, lost=problem.lost) if problem.lost else made


def _check_common(state: Scanned, index_known: bool, findings: list[Finding]) -> None:
    checkpoint = state.checkpoint
    assert checkpoint is not None
    source = checkpoint.common_source
    if source is None:
        if checkpoint.location.backend == BACKEND_DCP:  # FSDP2, TorchTitan, generic DCP: nothing but the state dict
            return
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
        findings.extend(saved_spec_findings(state.common.get("args"), path, what))
    except (UnsafePickleError, PickleLimitError, ArchiveError) as exc:
        findings.append(refused_pickle(exc, path, what))
        return
    except StorageUnavailable:
        raise
    except CkptError as exc:
        detail = without_path(
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
