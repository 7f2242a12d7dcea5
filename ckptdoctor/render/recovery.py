"""Text rendering of the recovery commands: ``latest-good``, ``history``, ``seal`` and ``repair``.

Kept apart from :mod:`ckptdoctor.render.common` so the recovery commands can change without touching it; every
renderer is :func:`~ckptdoctor.text_safety.text_safe` (values read from a checkpoint are escaped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptdoctor.render.common import human_bytes
from ckptdoctor.render.wrap import wrap_block, wrap_lines
from ckptdoctor.text_safety import text_safe

if TYPE_CHECKING:
    from ckptdoctor.ops.history import HistoryReport, IterationStatus
    from ckptdoctor.ops.latest_good import LatestGoodReport
    from ckptdoctor.ops.repair.report import RepairReport
    from ckptdoctor.ops.seal import SealResult


@text_safe
def render_skipped(report: LatestGoodReport, width: int | None = None) -> str:
    """Why each newer iteration dir was skipped (for stderr), each wrapped to ``width`` (None: not wrapped)."""
    lines = []
    for skipped in report.skipped:
        first = skipped.errors[0]
        n = len(skipped.errors) - 1
        more = f" (and {n} more error{'s' if n != 1 else ''})" if n else ""
        lines.append(f"skipped {skipped.iteration_dir}: {first.code} {first.message}{more}")
    return "\n".join(wrap_lines(lines, width))


HISTORY_HEADER = ("iteration", "status", "size", "sealed", "tracker", "why")


@text_safe
def render_history(report: HistoryReport, width: int | None = None) -> str:
    """One row per iteration dir (newest first): iteration, status, size, sealed, which tracker names it, and why
    (the first error, else the first warning); then the save dir's own findings and a summary. The why column
    wraps to ``width`` (None: not wrapped) under itself."""
    rows = [HISTORY_HEADER] + [_history_row(line) for line in report.iterations]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HISTORY_HEADER) - 1)]
    lines = []
    for row in rows:
        head = "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
        lines.append(wrap_block(f"{head}  {row[-1]}".rstrip(), width, " " * (len(head) + 2), head=len(head)))
    for f in report.findings:
        lines.append(wrap_block(f"{f.path}: {f.code} [{f.severity}] {f.message}", width))
    lines.append(wrap_block(_history_summary(report), width))
    return "\n".join(lines)


def _history_row(line: IterationStatus) -> tuple[str, ...]:
    markers = [name for name, named in (("tracker", line.tracker), ("bridge", line.bridge_tracker)) if named]
    why = ""
    if line.top is not None:
        more = line.errors + line.warnings - 1
        inside = line.iteration_dir.rstrip("/") + "/"
        where = line.top.path[len(inside) :] if line.top.path.startswith(inside) else ""  # the file it is about
        why = f"{line.top.code} {where + ': ' if where else ''}{line.top.message}" + (
            f" (and {more} more finding{'s' if more != 1 else ''})" if more else ""
        )
    return (
        "release" if line.release else str(line.iteration),
        line.status,
        human_bytes(line.bytes),
        "yes" if line.sealed else "no",
        ",".join(markers) or "-",
        why,
    )


def _history_summary(report: HistoryReport) -> str:
    counts = {status: sum(1 for line in report.iterations if line.status == status) for status in _STATUSES}
    n = len(report.iterations)
    said = f"{n} iteration dir{'s' if n != 1 else ''}: " + ", ".join(
        f"{counts[s]} {'with warnings' if s == 'warnings' else s}" for s in _STATUSES
    )
    tracked = next((line for line in report.iterations if line.tracker), None)
    if tracked is not None:
        said += f"; the tracker names {_name(tracked)} ({tracked.status})"
    elif report.tracker is not None:
        said += f"; the tracker names {report.tracker}, which is not here"
    else:
        said += "; no tracker that reads"
    good = next((line for line in report.iterations if line.status != "broken"), None)
    said += f"; latest good: {_name(good)}" if good is not None else "; none passes check"
    if good is not None and good.sealed and not report.integrity_verified:
        said += " (its integrity.json hashes not verified: --verify-integrity, or latest-good)"
    return said + "."


_STATUSES = ("good", "warnings", "broken")


def _name(line: IterationStatus) -> str:
    return "release" if line.release else str(line.iteration)


@text_safe
def render_seal(result: SealResult) -> str:
    if result.unchanged:
        return (
            f"already sealed, unchanged: {result.iteration_dir}: {result.manifest} lists {result.files} file(s) "
            "(--force re-seals it; `ckptdoctor check` verifies the hashes)"
        )
    verb = "re-sealed" if result.replaced else "sealed"
    rate = result.bytes / result.seconds / (1 << 20) if result.seconds > 0 else 0.0
    lines = [
        f"{verb} {result.iteration_dir}: {result.manifest} lists {result.files} file(s), "
        f"{human_bytes(result.bytes)} hashed with {result.jobs} worker(s) in {result.seconds:.2f} s "
        f"({rate:.0f} MiB/s)"
    ]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


@text_safe
def render_repair(report: RepairReport, width: int | None = None) -> str:
    """What repair does (or would do), refuses and leaves; each line wrapped to ``width`` (None: not wrapped)
    under its own text (a ``rm -rf``/``mv`` command or a backquoted one stays on one line)."""
    lines = [f"checkpoint      {report.checkpoint}"]
    if report.iteration_dir and report.iteration_dir != report.checkpoint:
        lines.append(f"iteration dir   {report.iteration_dir}")
    if not report.findings:
        lines.append("check finds nothing to repair")
    if report.actions:
        lines.append("repairs" + ("" if report.written else " (write them with -o DIR or --in-place)"))
        for action in report.actions:
            lines.append(f"  [{', '.join(action.fixes)}] {action.description}")
    for refusal in report.refused:
        lines.append(f"refused [{refusal.code}] {refusal.path}: {refusal.reason}")
    if report.unrepairable:
        lines.append("not repairable")
        for item in report.unrepairable:
            lines.append(f"  {item.path}: {item.code} {item.message}")
        lines.append(f"  {report.way_out}")
    for item in report.untouched:
        lines.append(f"left as is: {item.path}: {item.code} {item.message}")
    if report.written is not None:
        written = report.written
        lines.append(f"written ({written.mode}) {written.target}")
        lines += [f"  wrote {p}" for p in written.written]
        lines += [f"  moved {p}" for p in written.moved]
        lines += [f"  backup: {p}" for p in written.backups]
        if written.integrity_updated:
            lines.append("  integrity.json updated")
    if report.after is not None:
        if report.after:
            lines.append("after writing, check still finds:")
            lines += [f"  {f.path}: {f.code} {f.message}" for f in report.after]
        else:
            lines.append("after writing: the repaired findings are gone")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(wrap_lines(lines, width))
