"""``check --deep`` of one checkpoint: this checkout against another commit's worktree, beside ``cat``.

    python bench/make_synthetic.py --out /tmp/syn05 --total-bytes 0.5G --keys 2000 --files 64
    git worktree add /tmp/wt_before <commit>
    python bench/bench_deep_before_after.py /tmp/syn05 --before /tmp/wt_before --rounds 3

Alternating rounds after one warm-up of each (page cache warm); median [min-max] wall seconds per command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--before", type=Path, required=True, help="a worktree of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    files = sorted(str(p) for p in args.checkpoint.rglob("*.distcp"))
    deep = [sys.executable, "-m", "ckptdoctor", "check", "--deep", "--isolated", "--jobs", "1", str(args.checkpoint)]
    commands = {
        "cat": (["cat", *files], None),
        "before": (deep, str(args.before)),
        "after": (deep, str(REPO)),
    }
    walls: dict[str, list[float]] = {name: [] for name in commands}
    for round_ in range(args.rounds + 1):  # round 0 warms the page cache and is not counted
        for name, (cmd, code) in commands.items():
            env = {**os.environ, **({"PYTHONPATH": code} if code else {})}
            start = time.perf_counter()
            proc = subprocess.run(cmd, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if proc.returncode not in (0, 1):
                raise SystemExit(f"{name}: exit {proc.returncode}: {proc.stderr.decode()[-300:]}")
            if round_:
                walls[name].append(time.perf_counter() - start)
    for name, values in walls.items():
        print(f"{name:7s} {statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}] s")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
