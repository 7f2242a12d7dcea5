"""Benchmark ``ckptdoctor convert`` (torch_dist <-> fsdp_dtensor) against ``cp -r`` of the same bytes, in one run.

Input: a synthetic torch_dist save made by ``make_synthetic.py`` (real PyTorch DCP, ``--layout stacked``: Megatron's
dense GPT keys with a leading layer axis, one chunk per layer and TP rank, fp32 optimizer states with the
parameters' chunking), cached in ``bench/data``. Measured through ``harness.py`` as one alternating group (one
untimed warm-up round, then ``--rounds`` rounds, the order rotating; each command its own child process: wall
spawn -> exit, CPU, peak RSS of the largest process):

- ``convert SRC --to fsdp_dtensor -o OUT`` at ``--jobs 1`` and at the default (the available cores);
- ``convert FSDP --to torch_dist -o BACK`` (the reverse, from a conversion made once before the rounds);
- ``cp -r`` of the source's iteration dir (the bytes a conversion reads and writes at least once).

Every output dir is removed before each run (``before``), so each run writes all its bytes.

    python bench/bench_convert.py                    # 1G, 24 layers, 16 data files, 3 rounds
    python bench/bench_convert.py --size 2G --rounds 5

Prints a Markdown table and writes ``bench/results/convert.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (no torch)
from harness import DATA, Case, alternate, ckptdoctor, fmt_spread  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="synthetic checkpoint size (make_synthetic --total-bytes)")
    parser.add_argument(
        "--keys", type=int, default=187, help="make_synthetic --keys (stacked: 27 + 64 + 4 per layer: 24 layers)"
    )
    parser.add_argument("--files", type=int, default=16, help="data files of the synthetic")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200)
    opts = parser.parse_args(argv)
    recorder = harness.Recorder("convert", argv)
    save = harness.synthetic(opts.size, opts.keys, opts.files, layout="stacked")
    iteration, _names, data_bytes = harness.iteration_files(save)
    scratch = DATA / "tmp" / "convert"
    scratch.mkdir(parents=True, exist_ok=True)
    fsdp, out, back, copy = (scratch / name for name in ("fsdp", "out", "back", "copy"))
    shutil.rmtree(fsdp, ignore_errors=True)
    subprocess.run(
        ckptdoctor("convert", str(save), "--to", "fsdp_dtensor", "-o", str(fsdp)), check=True, cwd=harness.CODE
    )

    def clear(path: Path):
        return lambda: shutil.rmtree(path, ignore_errors=True)

    cases = {
        "convert --jobs 1": Case(
            ckptdoctor("convert", str(save), "--to", "fsdp_dtensor", "-o", str(out), "--jobs", "1"), before=clear(out)
        ),
        "convert": Case(ckptdoctor("convert", str(save), "--to", "fsdp_dtensor", "-o", str(out)), before=clear(out)),
        "convert back": Case(
            ckptdoctor("convert", str(fsdp), "--to", "torch_dist", "-o", str(back)), before=clear(back)
        ),
        "cp -r": Case(["cp", "-r", str(iteration), str(copy)], before=clear(copy)),
    }
    group = alternate(cases, opts.rounds, opts.timeout)
    summary = group.summary()
    for path in (fsdp, out, back, copy):
        shutil.rmtree(path, ignore_errors=True)
    ratios = {label: group.ratio(label, "cp -r") for label in cases if label != "cp -r"}
    path = recorder.write(
        {
            "input": {"save": str(save.relative_to(harness.REPO)), "data_bytes": data_bytes},
            "group": summary,
            "ratio_to_cp": ratios,
        }
    )
    print(f"\n{harness.header(json.loads(path.read_text()))}\n")
    print(f"input: {save.name}, {data_bytes / 2**30:.2f} GiB of data files and .metadata\n")
    print("| command | wall s | CPU s | peak RSS MiB | wall / cp -r |")
    print("|---|---|---|---|---|")
    for label in cases:
        rss = group.peak_rss_mb(label)
        print(
            f"| {label} | {fmt_spread(group.seconds(label), '.2f')} | {fmt_spread(group.cpu(label), '.2f')} | "
            f"{rss:.0f} | {fmt_spread(ratios.get(label), '.2f') if label != 'cp -r' else '1'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
