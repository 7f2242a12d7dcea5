"""seal throughput vs sha256sum of the same files, single and parallel, in one run.

    .venv/bin/python bench/bench_seal.py [--files 4] [--mib 256] [--jobs N]

Builds a checkpoint from fixtures/core019_tp1 plus FILES extra data files of MIB MiB each (random bytes; they are
unreferenced, a warning, so seal accepts them), then measures, as one alternating group of `harness.py` (one
warm-up round, --repeats rounds, median [min-max], page cache warm): `ckptdoctor seal --force --jobs 1`,
`--jobs N`, `sha256sum FILES...` and `xargs -P N sha256sum`. Writes bench/results/seal.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import REPO, Case, alternate, ckptdoctor, fmt_spread  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--render", action="store_true", help="print the table of bench/results/seal.json")
    harness.add_common_options(parser)
    opts = parser.parse_args(argv)
    harness.use_code(opts.code)
    if opts.render:
        print(render(json.loads((harness.RESULTS / "seal.json").read_text())))
        return 0
    recorder = harness.Recorder("seal", argv)
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
        seal = ckptdoctor("seal", str(save), "--force")
        xargs = f"printf '%s\\n' \"$@\" | xargs -P {opts.jobs} -n 1 sha256sum"
        cases = {
            "ckptdoctor seal --jobs 1": Case(seal + ["--jobs", "1"]),
            f"ckptdoctor seal --jobs {opts.jobs}": Case(seal + ["--jobs", str(opts.jobs)]),
            "sha256sum (one process)": Case(["sha256sum", *files]),
            f"xargs -P {opts.jobs} sha256sum": Case(["sh", "-c", xargs, "sh", *files]),
        }
        group = alternate(cases, opts.repeats)
    doc = recorder.write({"files": len(files), "bytes": total, "jobs": opts.jobs, "group": group.summary()})
    print(render(json.loads(doc.read_text())))
    return 0


def render(doc: dict) -> str:
    total = doc["bytes"]
    lines = [
        f"{doc['files']} files, {total / (1 << 20):.0f} MiB, {doc['jobs']} jobs, warm page cache",
        "",
        "| command | wall s, median [min–max] | MiB/s (median) |",
        "|---|---|---|",
    ]
    for name, case in doc["group"]["cases"].items():
        s = case["seconds"]
        rate = f"{total / s['median'] / (1 << 20):.0f}" if s else "-"
        lines.append(f"| `{name}` | {fmt_spread(s, '.2f')} | {rate} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
