"""The fast test tier's time, both passes (with the C extensions, and with them blocked), old tree against new.

    .venv/bin/python bench/bench_fast_tier.py --before /tmp/old-tree [--code /tmp/new-tree] [--rounds 1]

Each tree's pass runs as scripts/test.sh runs it: ``python -m pytest -q -n 2 --dist loadgroup -m "not mcore"
-p no:cacheprovider`` from the tree (``PYTHONPATH`` the tree, so its own package and tests), then again with
``CKPTDOCTOR_NO_EXTENSIONS=1``, both with ``PYTHONDONTWRITEBYTECODE=1`` (no caches written into the trees). The
four commands are one alternating group of ``harness.py`` (no warm-up round: a pass is minutes long; the order
rotates each round). Wall is what a developer waits; CPU (user + sys of pytest
and its workers) is what other load on the machine inflates least. Issue #34's budget: the new tree's two passes
together take at most 1.2x the old tree's. Writes bench/results/fast-tier.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import PYTHON, Case, alternate, fmt_spread  # noqa: E402

PYTEST = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-m", "not mcore", "-p", "no:cacheprovider"]
PASSES = {"C": [], "no C": ["CKPTDOCTOR_NO_EXTENSIONS=1"]}


def cases(trees: dict[str, Path]) -> dict[str, Case]:
    out = {}
    for name, tree in trees.items():
        harness.build_extension(tree)
        for label, extra in PASSES.items():
            # env: the tree's own package first (the venv's editable install points at one checkout)
            cmd = ["env", "PYTHONDONTWRITEBYTECODE=1", f"PYTHONPATH={tree}", *extra, PYTHON, *PYTEST]
            out[f"{name}, {label}"] = Case(cmd, cwd=tree)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_options(parser)
    parser.add_argument("--before", type=Path, required=False, help="the baseline tree (a clean git worktree)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--render", action="store_true", help="print the table of bench/results/fast-tier.json")
    opts = parser.parse_args(argv)
    if opts.render:
        print(render(json.loads((harness.RESULTS / "fast-tier.json").read_text())))
        return 0
    if opts.before is None:
        parser.error("--before is required")
    harness.use_code(opts.code)
    recorder = harness.Recorder("fast-tier", argv)
    trees = {"old": opts.before.resolve(), "new": harness.CODE}
    group = alternate(cases(trees), opts.rounds, opts.timeout, warm_up=False)
    doc = recorder.write({"trees": {k: str(v) for k, v in trees.items()}, "group": group.summary()})
    print(render(json.loads(doc.read_text())))
    return 0


def render(doc: dict) -> str:
    runs = doc["group"]["cases"]
    lines = [
        harness.header(doc),
        "",
        "| tree | pass | wall s, median [min–max] | CPU s, median |",
        "|---|---|---|---|",
    ]
    totals: dict[str, dict[str, float]] = {}
    for name, case in runs.items():
        tree, label = name.split(", ", 1)
        wall = case["seconds"]
        cpu = [r["cpu_s"] for r in case["runs"]]
        cpu_median = sorted(cpu)[len(cpu) // 2] if cpu else float("nan")
        lines.append(f"| {tree} ({doc['trees'][tree]}) | {label} | {fmt_spread(wall, '.0f')} | {cpu_median:.0f} |")
        t = totals.setdefault(tree, {"wall": 0.0, "cpu": 0.0, "passes": 0})
        if wall:
            t["passes"] += 1
            t["wall"] += wall["median"]
            t["cpu"] += cpu_median
    if set(totals) == {"old", "new"} and all(t["passes"] == len(PASSES) for t in totals.values()):
        lines += [
            "",
            f"Both passes: old {totals['old']['wall']:.0f} s wall / {totals['old']['cpu']:.0f} s CPU, new "
            f"{totals['new']['wall']:.0f} s / {totals['new']['cpu']:.0f} s: new / old = "
            f"{totals['new']['wall'] / totals['old']['wall']:.2f} (wall), "
            f"{totals['new']['cpu'] / totals['old']['cpu']:.2f} (CPU); budget <= 1.2.",
        ]
    else:
        lines += ["", "A pass failed (see its row): no ratio of both passes."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
