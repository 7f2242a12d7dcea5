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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import Case, alternate, fmt_spread  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_options(parser)
    parser.add_argument("--before", type=Path, required=True, help="worktree of the commit before")
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=8)
    opts = parser.parse_args(argv)
    harness.use_code(opts.code)
    recorder = harness.Recorder("safety-cost", argv)
    before = opts.before.resolve()
    cases = {
        f"{command} {side}": Case(harness.ckptdoctor(command, str(opts.ckpt.resolve())), ok_rcs=(0, 1), cwd=cwd)
        for command in ("inspect", "check")
        for side, cwd in (("before", before), ("after", harness.CODE))
    }
    group = alternate(cases, opts.runs)
    rows = []
    for command in ("inspect", "check"):
        b, a = f"{command} before", f"{command} after"
        ratio = group.ratio(a, b)
        rows.append(
            f"| `{command}` | {fmt_spread(group.seconds(b))} s, {fmt_spread(group.cpu(b))} s CPU "
            f"| {fmt_spread(group.seconds(a))} s, {fmt_spread(group.cpu(a))} s CPU | {fmt_spread(ratio, '.2f')} "
            f"| {group.peak_rss_mb(b):.0f} / {group.peak_rss_mb(a):.0f} MB |"
        )
    print("| command | before: wall, CPU | after: wall, CPU | after / before per round | peak RSS before / after |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    before_commit = harness._git("rev-parse", "--short", "HEAD", cwd=before)
    recorder.write(
        {"before": {"path": str(before), "commit": before_commit}, "ckpt": str(opts.ckpt), "group": group.summary()}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
