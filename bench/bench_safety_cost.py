"""What the pickle pre-pass of issue #9 costs: ``inspect`` and ``check`` before and after, alternating, one run.

``before`` is a git worktree of the commit before the hardening (default 91d3d74), ``after`` this checkout; both
run the same Python on the same synthetic checkpoint (``bench/make_synthetic.py``). Each command is its own
child process; wall, CPU (user + sys) and peak RSS come from ``os.wait4``.

    git worktree add /tmp/basewt 91d3d74
    python bench/make_synthetic.py --out /tmp/syn/s20k --total-bytes 0.2G --keys 20000 --files 200
    python bench/bench_safety_cost.py --before /tmp/basewt --ckpt /tmp/syn/s20k [--runs 8]
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


def run(cwd: Path, args: list[str]) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ckptdoctor", *args], cwd=cwd, stdout=subprocess.DEVNULL)
    _, _, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="worktree of the commit before")
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=8)
    opts = parser.parse_args(argv)
    sides = (("before", opts.before), ("after", REPO))
    for command in (["inspect"], ["check"]):
        results: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _ in sides}
        for _ in range(opts.runs):  # alternate, so load on the machine hits both alike
            for label, cwd in sides:
                results[label].append(run(cwd, [*command, str(opts.ckpt)]))
        for label, runs in results.items():
            wall, cpu = [r[0] for r in runs], [r[1] for r in runs]
            print(
                f"{command[0]:8s} {label:7s} wall {statistics.median(wall):.3f} [{min(wall):.3f}-{max(wall):.3f}] s"
                f"  cpu {statistics.median(cpu):.3f} [{min(cpu):.3f}-{max(cpu):.3f}] s"
                f"  peak RSS {max(r[2] for r in runs):.0f} MB"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
