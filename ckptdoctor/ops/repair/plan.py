"""``ckptdoctor repair``: fix what ``check`` finds, each repair only when it is provably safe.

* CKD120/121/122 tracker (and a tracker whose checkpoint fails check with errors no repair fixes): point it to
  :func:`~ckptdoctor.ops.latest_good.find_latest_good` (never to a dir that fails check; ``release`` handled).
* CKD101 ``metadata.json`` missing: written only when ``.metadata`` reads, every referenced data file is present
  and long enough, and the common state reads; content follows the era (core <= 0.18 with ``common.pt``: four
  fields; core >= 0.19: the two ``sharded_backend`` fields). An incomplete save stays incomplete
  (:mod:`ckptdoctor.ops.repair.metadata_json`).
* CKD115 unreferenced ``.distcp`` files: moved into ``<iter>.quarantine-<stamp>/`` beside the iteration dir,
  never deleted.
* CKD151 leftovers of an interrupted ckptdoctor write (unfinished staging dirs beside the iteration dir, temp
  files inside it): moved into the same quarantine dir (never deleted; with ``--output`` they are not carried
  over). Each is classified again under the lock just before it is moved. CKD150 (the original displaced or
  partly rewritten) is never touched: the report repeats check's restore commands and nothing else is written
  to that iteration dir until it is resolved.
* CKD2xx args findings: delegated to fix-args (:mod:`ckptdoctor.ops.fix_args`).
* Anything else (truncated or missing data, garbage ``.metadata``): not repairable; the report says what is lost
  and names the latest good checkpoint.

This module plans (reads only); :mod:`ckptdoctor.ops.repair.write` writes, by fix-args' rules. The report
they fill is :class:`~ckptdoctor.ops.repair.report.RepairReport`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor import arg_rules
from ckptdoctor.checkpoint import Checkpoint, refuse_plain_dcp
from ckptdoctor.errors import CkptError
from ckptdoctor.locate import (
    NEMO_WEIGHTS_DIR,
    TRACKER_NAME,
    iteration_dir_name,
    list_iteration_dirs,
    looks_like_iteration_dir,
    read_tracker,
)
from ckptdoctor.ops.check import CheckOptions, scan_and_check
from ckptdoctor.ops.fix_args import plan as fix_args
from ckptdoctor.ops.latest_good import LatestGoodReport, find_latest_good, iteration_value
from ckptdoctor.ops.repair import metadata_json
from ckptdoctor.ops.repair.bridge import plan_bridge
from ckptdoctor.ops.repair.report import SCHEMA, Action, Refusal, RepairReport
from ckptdoctor.ops.staging import QUARANTINE_MARK
from ckptdoctor.problems import lost_count
from ckptdoctor.rules import ERROR, Finding, bridge, is_safety, leftovers, structure
from ckptdoctor.rules.integrity import INTEGRITY_NAME, LISTED_FILE_MISSING
from ckptdoctor.storage.dispatch import as_path
from ckptdoctor.storage.files import read_json

TRACKER_CODES = (structure.TRACKER_INVALID.code, structure.TRACKER_TARGET_MISSING.code, structure.TRACKER_MISSING.code)
METADATA_JSON_CODE = structure.METADATA_JSON_MISSING.code
UNSUPPORTED_CODE = structure.UNSUPPORTED_FORMAT.code
UNSUPPORTED_WAY_OUT = "not a format ckptdoctor repairs (see CKD103): nothing is changed, and no data is lost by that"
ORPHAN_CODE = structure.DATA_FILE_UNREFERENCED.code
INTERRUPTED_CODE = leftovers.INTERRUPTED_WRITE.code
LEFTOVER_CODE = leftovers.WRITE_LEFTOVER.code
ARG_CODES = frozenset({r.code for r in arg_rules.RULES} | {"CKD204"})


@dataclass
class RepairWork:
    """What plan() decided, for the writer: the chosen iteration dir and the changes to make there."""

    save_dir: Path | None
    candidate: Path | None
    tracker_value: str | None = None  # the new tracker value (tracker action)
    bridge_value: str | None = None  # the step Megatron-Bridge's tracker is to name (bridge-tracker action)
    metadata_json: dict | None = None
    orphans: list[str] = field(default_factory=list)
    leftovers: list[Path] = field(default_factory=list)  # CKD151 paths (inside or beside the iteration dir)
    changes: list[fix_args.ArgChange] = field(default_factory=list)
    checkpoint: Checkpoint | None = None  # the candidate as read by the plan's check (its pickles gate the write)


# --- planning ---------------------------------------------------------------------------------------------


def _resolve(path: Path, iteration: str | None) -> tuple[Path | None, Path | None, list[Finding]]:
    """(save dir, the iteration dir to repair, tracker findings)."""
    if not path.exists():
        raise CkptError(f"{path}: no such file or directory")
    if path.is_file():
        path = path.parent
    is_save_dir = not looks_like_iteration_dir(path) and ((path / TRACKER_NAME).is_file() or list_iteration_dirs(path))
    if is_save_dir:
        chosen, tracker_findings = structure.check_save_dir(path, path, False)
        if iteration is not None:
            candidate = path / iteration_dir_name(iteration)
            if not candidate.is_dir():
                raise CkptError(f"{candidate}: --iteration points to an iteration dir that does not exist")
            return path, candidate, tracker_findings
        if any(f.code in TRACKER_CODES for f in tracker_findings):
            return path, None, tracker_findings
        if not (path / TRACKER_NAME).is_file():  # TorchTitan's step-N dirs: no tracker, the newest is resumed
            return path, chosen[-1] if chosen else None, tracker_findings
        # the text tracker's dir (Megatron-Bridge's tracker may name another: repair follows the text one)
        tracked = path / iteration_dir_name(read_tracker(path / TRACKER_NAME))
        return path, (tracked if tracked in chosen else None), tracker_findings
    if iteration is not None:
        raise CkptError(f"{path}: --iteration needs a save dir")
    if looks_like_iteration_dir(path):
        return None, path, []
    if looks_like_iteration_dir(path / NEMO_WEIGHTS_DIR):
        return None, path / NEMO_WEIGHTS_DIR, []
    raise CkptError(f"{path}: not a Megatron checkpoint (no tracker, iteration dirs, metadata.json or .metadata)")


def plan(
    path: str | Path, iteration: str | None = None, options: CheckOptions | None = None
) -> tuple[RepairReport, RepairWork]:
    options = options or CheckOptions()
    save_dir, candidate, tracker_findings = _resolve(as_path(path), iteration)
    report = RepairReport(
        SCHEMA,
        str(path),
        None if save_dir is None else str(save_dir),
        None if candidate is None else str(candidate),
        list(tracker_findings),
    )
    work = RepairWork(save_dir, candidate)
    target_broken = False
    if candidate is not None:
        target_broken = _plan_iteration(candidate, options, report, work)
    unsupported = bool(report.unrepairable) and all(f.code == UNSUPPORTED_CODE for f in report.unrepairable)
    if unsupported:  # a format ckptdoctor does not read (legacy torch, torch_dcp): not a reason to move the tracker
        target_broken = False
    for f in tracker_findings:
        if f.code not in TRACKER_CODES and f.code not in bridge.TRACKER_CODES:
            report.untouched.append(f)
    tracker_codes = [f.code for f in tracker_findings if f.code in TRACKER_CODES]
    latest: LatestGoodReport | None = None
    if save_dir is not None and tracker_codes and candidate is None:
        # A tracked iteration dir that is missing may be one an interrupted write displaced: restore it, never
        # point the tracker away from it.
        displaced = [f for f in leftovers.scan_beside(save_dir, save_dir) if f.code == INTERRUPTED_CODE]
        if displaced:
            report.findings += displaced
            report.refused += [
                Refusal(
                    f.code,
                    f.path,
                    "an interrupted ckptdoctor write: the tracker is not "
                    f"changed until it is resolved; {f.message}; then run repair again",
                )
                for f in displaced
            ]
            return report, work
    if save_dir is not None and (tracker_codes or target_broken):
        latest = find_latest_good(save_dir, options)
        report.latest_good = latest.iteration_dir
        if latest.found:
            fixes = tracker_codes or sorted({f.code for f in report.unrepairable})
            work.tracker_value = latest.tracker_value
            why = (
                "its checkpoint fails check"
                if not tracker_codes
                else "; ".join(f.message for f in tracker_findings if f.code in TRACKER_CODES)
            )
            report.actions.append(
                Action(
                    "tracker",
                    fixes,
                    str(save_dir / TRACKER_NAME),
                    f"point {TRACKER_NAME} to {latest.tracker_value} ({Path(latest.iteration_dir).name}, the newest "  # type: ignore[arg-type]
                    f"iteration dir that passes check): {why}",
                    latest.tracker_value,
                )
            )
        else:
            for f in tracker_findings:
                if f.code in TRACKER_CODES:
                    report.unrepairable.append(f)
            # the code of a finding check made: the tracker's own, or the first that fails its iteration dir
            code = tracker_codes[0] if tracker_codes else sorted({f.code for f in report.unrepairable})[0]
            what = "nothing to point it to" if tracker_codes else "nothing to point it to instead of the failing one"
            report.refused.append(
                Refusal(code, str(save_dir / TRACKER_NAME), f"no iteration dir of the save dir passes check: {what}")
            )
        report.notes += [
            f"latest-good skipped {Path(s.iteration_dir).name}: {s.errors[0].code} {s.errors[0].message}"
            for s in latest.skipped
        ]
    if save_dir is not None:  # Megatron-Bridge's tracker follows the text one (ops/repair/bridge.py)
        moved = work.tracker_value is not None
        good = candidate is not None and not target_broken and not unsupported  # nothing changes in CKD103's
        text_value = work.tracker_value if moved else (iteration_value(candidate) if good else None)  # type: ignore[arg-type]
        work.bridge_value = plan_bridge(save_dir, tracker_findings, text_value, moved, report)
    if report.unrepairable:
        report.way_out = UNSUPPORTED_WAY_OUT if unsupported else _way_out(report.unrepairable, save_dir, latest)
    return report, work


# What no repair fixes, by what it means for the data: missing or damaged bytes are lost; a tracker or an unsafe
# pickle loses nothing (the data is all there), and other findings are said to be unfixed, no more.
LOST_CODES = frozenset(
    {"CKD101", "CKD110", "CKD111", "CKD112", "CKD113", "CKD114", "CKD116", "CKD130", "CKD131", "CKD220"}
    | {"CKD301", "CKD302", "CKD310", "CKD311", "CKD312", "CKD313"}
)


def _way_out(unrepairable: list[Finding], save_dir: Path | None, latest: LatestGoodReport | None) -> str:
    """What the unrepairable findings mean and where to go from here: "lost" only for data that is."""
    codes = sorted({f.code for f in unrepairable})
    lost = [c for c in codes if c in LOST_CODES]
    tracker = [c for c in codes if c in TRACKER_CODES or c in bridge.TRACKER_CODES]
    unsafe = [c for c in codes if is_safety(c)]
    other = [c for c in codes if c not in lost and c not in tracker and c not in unsafe]
    said = []
    if lost:
        # the chunks the data-file findings list (their JSON ``lost``; each finding's message names the keys)
        chunks = [chunk for f in unrepairable for chunk in f.lost or ()]
        summary = f" ({lost_count(chunks)})" if chunks else ""
        said.append(f"the data of {', '.join(lost)} is lost from this checkpoint{summary}")
    if unsafe:
        said.append(
            f"{', '.join(unsafe)}: no data is lost, but loading it would run the code the gate refused "
            "(no repair rewrites a pickle)"
        )
    if tracker:
        said.append(f"{', '.join(tracker)}: the tracker loses no data")
    if other:
        said.append(f"{', '.join(other)}: no repair fixes this")
    if latest is not None and latest.found:
        where = f"resume from the latest good one: {latest.iteration_dir} (`ckptdoctor latest-good {save_dir}`)"
    elif save_dir is not None:
        notes = " (see the notes)" if latest is not None and latest.skipped else ""
        where = f"no iteration dir of the save dir passes check{notes}"
    else:
        where = "resume from an older one (`ckptdoctor latest-good SAVE_DIR` finds the newest that passes check)"
    return "; ".join([*said, where])


def _plan_iteration(candidate: Path, options: CheckOptions, report: RepairReport, work: RepairWork) -> bool:
    """Plan the repairs of one iteration dir; True when it keeps errors no repair fixes."""
    state, found = scan_and_check(candidate, candidate, options)
    if state.checkpoint is not None:
        refuse_plain_dcp(state.checkpoint, "repair")
    work.checkpoint = state.checkpoint
    found += leftovers.scan_beside(candidate.parent, candidate.parent, candidate.name)
    found = list(dict.fromkeys(found))
    report.findings += found
    missing_json = [
        f
        for f in found
        if f.code == METADATA_JSON_CODE
        or (f.code == LISTED_FILE_MISSING.code and f.message.startswith(f"metadata.json listed in {INTEGRITY_NAME}"))
    ]
    orphans = [f for f in found if f.code == ORPHAN_CODE]
    arg_findings = [f for f in found if f.code in ARG_CODES]
    left = [f for f in found if f.code == LEFTOVER_CODE]
    interrupted = [f for f in found if f.code == INTERRUPTED_CODE]
    if interrupted:  # the original is displaced or partly rewritten: only the user's restore undoes that
        for f in interrupted:
            report.refused.append(
                Refusal(
                    f.code,
                    f.path,
                    "an interrupted ckptdoctor write: nothing is repaired "
                    f"until it is resolved; {f.message}; then run repair again",
                )
            )
        for f in found:
            if f not in interrupted:
                report.refused.append(
                    Refusal(
                        f.code,
                        f.path,
                        f"not repaired until the interrupted write ({INTERRUPTED_CODE}) is resolved: {f.message}",
                    )
                )
        return False  # not a reason to point the tracker elsewhere: restoring the original is the way out
    fixable = missing_json + orphans + arg_findings + left
    others = [f for f in found if f not in fixable]
    blocking = [f for f in others if f.severity == ERROR]
    report.unrepairable += blocking
    report.untouched += [f for f in others if f.severity != ERROR]
    if missing_json:
        refusal = metadata_json.refusal(state, blocking)
        if refusal is not None:
            report.refused.append(Refusal(METADATA_JSON_CODE, str(candidate / "metadata.json"), refusal))
            blocking = blocking or missing_json
            report.unrepairable += [] if report.unrepairable else missing_json
        else:
            assert state.checkpoint is not None
            written = metadata_json.for_era(state.checkpoint.location)
            content = written.content
            recorded = recorded_hash(candidate, "metadata.json")
            if recorded is not None and recorded != hashlib.sha256(json.dumps(content).encode()).hexdigest():
                report.refused.append(
                    Refusal(
                        METADATA_JSON_CODE,
                        str(candidate / "metadata.json"),
                        f"{INTEGRITY_NAME} records another metadata.json than this era's",
                    )
                )
                report.unrepairable += missing_json
                return True
            work.metadata_json = content
            report.actions.append(
                Action(
                    "metadata-json",
                    sorted({f.code for f in missing_json}),
                    str(candidate / "metadata.json"),
                    f"write metadata.json as saved by {written.era}: {written.proof}",
                    content,
                )
            )
    if blocking:
        for f in orphans + arg_findings + left:
            report.refused.append(Refusal(f.code, f.path, "not repaired: the checkpoint has errors no repair fixes"))
        return True
    if orphans:
        work.orphans = sorted(Path(f.path).name for f in orphans)
        report.actions.append(
            Action(
                "quarantine",
                [ORPHAN_CODE],
                str(candidate),
                f"move {len(work.orphans)} unreferenced data file(s) ({', '.join(work.orphans)}) into "
                f"{candidate.name}{QUARANTINE_MARK}<stamp>/ beside the iteration dir (nothing is deleted)",
                work.orphans,
            )
        )
    if left:
        work.leftovers = [Path(f.path) for f in left]
        report.actions.append(
            Action(
                "quarantine-leftovers",
                [LEFTOVER_CODE],
                str(candidate),
                f"move {len(left)} leftover(s) of an interrupted ckptdoctor write "
                f"({', '.join(p.name for p in work.leftovers)}) into {candidate.name}{QUARANTINE_MARK}<stamp>/ "
                "beside the iteration dir (nothing is deleted)",
                [str(p) for p in work.leftovers],
            )
        )
    if arg_findings:
        assert state.checkpoint is not None
        args_report = fix_args.build_report(state.checkpoint, None, [], force=False)
        work.changes = args_report.changes
        if work.changes:
            report.actions.append(
                Action(
                    "fix-args",
                    sorted({f.code for f in arg_findings}),
                    str(candidate),
                    "fix args (as `ckptdoctor fix-args`): "
                    + ", ".join(f"{c.arg} {c.old!r} -> {c.new!r}" for c in work.changes),
                    work.changes,
                )
            )
        else:
            report.untouched += arg_findings
    return False


# --- writing ----------------------------------------------------------------------------------------------


def recorded_hash(iteration_dir: Path, name: str) -> str | None:
    try:
        files = read_json(iteration_dir / INTEGRITY_NAME)["files"]
        return str(files[name]).lower() if name in files else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
