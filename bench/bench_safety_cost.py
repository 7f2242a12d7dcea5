"""What the pickle pre-pass of issue #9 costs: ``inspect`` and ``check`` before and after, alternating, one run.

``before`` is a git worktree of the commit before the hardening (default 91d3d74), ``after`` the tree given by
``--code`` (default this checkout); both run the same Python on the same synthetic checkpoint
(``bench/make_synthetic.py``). The four commands are one alternating group (``harness.alternate``: each its own
child process; wall, CPU and peak RSS from ``os.wait4``; one warm-up round); after / before per round.
Writes ``bench/results/safety-cost.json``.

    git worktree add /tmp/basewt 91d3d74
    python bench/make_synthetic.py --out /tmp/syn/s20k --total-bytes 0.2G --keys 20000 --files 200
    python bench/bench_safety_cost.py --before /tmp/basewt --ckpt /tmp/syn/s20k [--runs 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import Case, alternate, fmt_spread  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser)
    parser.add_argument("--before", type=Path, help="worktree of the commit before")
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--render", action="store_true", help="print the table of bench/results/safety-cost.json")
    opts = parser.parse_args(argv)
    harness.use_code(opts.code)
    if opts.render:
        print(render(json.loads((harness.RESULTS / "safety-cost.json").read_text())))
        return 0
    if opts.before is None or opts.ckpt is None:
        parser.error("--before and --ckpt are required")
    recorder = harness.Recorder("safety-cost", argv)
    before = opts.before.resolve()
    cases = {
        f"{command} {side}": Case(harness.ckptdoctor(command, str(opts.ckpt.resolve())), ok_rcs=(0, 1), cwd=cwd)
        for command in ("inspect", "check")
        for side, cwd in (("before", before), ("after", harness.CODE))
    }
    group = alternate(cases, opts.runs)
    before_commit = harness._git("rev-parse", "--short", "HEAD", cwd=before)
    doc = recorder.write(
        {"before": {"path": str(before), "commit": before_commit}, "ckpt": str(opts.ckpt), "group": group.summary()}
    )
    loaded = json.loads(doc.read_text())
    print(harness.header(loaded) + "\n\n" + render(loaded))
    return 0


def render(doc: dict) -> str:
    cases = doc["group"]["cases"]
    lines = [
        f"| command | before ({doc['before']['commit']}): wall s, CPU s | after: wall s, CPU s "
        "| after / before per round: wall; CPU | peak RSS before / after |",
        "|---|---|---|---|---|",
    ]
    for command in ("inspect", "check"):
        b, a = cases[f"{command} before"], cases[f"{command} after"]
        wall = harness.summary_ratio(cases, f"{command} after", f"{command} before", "wall_s")
        cpu = harness.summary_ratio(cases, f"{command} after", f"{command} before")
        lines.append(
            f"| `{command}` | {fmt_spread(b['seconds'])}, {fmt_spread(b['cpu_s'])} "
            f"| {fmt_spread(a['seconds'])}, {fmt_spread(a['cpu_s'])} | {fmt_spread(wall, '.2f')}; "
            f"{fmt_spread(cpu, '.2f')} | {b['peak_rss_mb']:.0f} / {a['peak_rss_mb']:.0f} MB |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
