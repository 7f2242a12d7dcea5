"""seal throughput vs sha256sum of the same files, single and parallel, in one run.

    .venv/bin/python bench/bench_seal.py [--files 4] [--mib 256] [--jobs N]

Builds a checkpoint from fixtures/core019_tp1 plus FILES extra data files of MIB MiB each (random bytes; they are
unreferenced, a warning, so seal accepts them), then times, best of 3 with a warm page cache:
`ckptdoctor seal --force --jobs 1`, `--jobs N`, `sha256sum FILES...` and `xargs -P N sha256sum`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        save = Path(tmp) / "save"
        shutil.copytree(REPO / "fixtures" / "core019_tp1", save)
        iteration_dir = save / "iter_0000010"
        for i in range(opts.files):
            with open(iteration_dir / f"__{100 + i}_0.distcp", "wb") as f:
                for _ in range(opts.mib):
                    f.write(os.urandom(1 << 20))
        files = sorted(str(p) for p in iteration_dir.iterdir() if p.is_file())
        total = sum(os.path.getsize(p) for p in files)
        seal = [sys.executable, "-m", "ckptdoctor", "seal", str(save), "--force"]
        rows = {
            "ckptdoctor seal --jobs 1": timed(seal + ["--jobs", "1"]),
            f"ckptdoctor seal --jobs {opts.jobs}": timed(seal + ["--jobs", str(opts.jobs)]),
            "sha256sum (one process)": timed(["sha256sum", *files]),
            f"xargs -P {opts.jobs} sha256sum": timed(
                ["sh", "-c", f"printf '%s\\n' \"$@\" | xargs -P {opts.jobs} -n 1 sha256sum", "sh", *files]
            ),
        }
    print(f"{len(files)} files, {total / (1 << 20):.0f} MiB, {opts.jobs} jobs, warm page cache, best of 3")
    for name, seconds in rows.items():
        print(f"{name:32s} {seconds:7.2f} s  {total / seconds / (1 << 20):7.0f} MiB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
