"""can-load prediction time on a synthetic 20,000-key checkpoint (metadata only, no torch imported).

    .venv/bin/python bench/bench_can_load.py [--keys 20000] [--out bench/results/can_load.json]

Writes the checkpoint with bench/make_synthetic.py (real PyTorch DCP writer, per-layer MoE keys, 64 MiB of data)
into a temporary dir, then times, best of 5: ``predict()`` in-process after the checkpoint is opened (the
modelling alone), ``open_checkpoint`` + ``predict()`` in-process, and the whole ``ckptdoctor can-load`` process
(interpreter start and imports included), for a few targets; and, as the baseline under the same machine load,
the whole ``ckptdoctor inspect`` process on the same checkpoint (the same metadata read). Results, machine load
and commit go to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGETS = (
    ("tp=4", ()),
    ("tp=1,pp=2", ()),
    ("tp=2", ("--set", "num_layers=3")),
    ("tp=2", ("--strictness", "raise_all")),
)


def best(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def child_cpu(cmd: list[str], repeats: int = 3) -> float:
    """Least CPU time (user + sys) of a child process over ``repeats`` runs: unlike wall time, hardly
    affected by other processes on a shared machine."""
    least = float("inf")
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        least = min(least, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return least


def open_and_predict(save: Path, target: str, run: object) -> None:
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.ops.can_load import LoadRun, predict

    assert isinstance(run, LoadRun)
    predict(open_checkpoint(save), target, run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "can_load.json")
    opts = parser.parse_args(argv)
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.ops.can_load import predict
    from ckptdoctor.ops.can_load_run import LoadRun, parse_sets

    with tempfile.TemporaryDirectory() as tmp:
        save = Path(tmp) / "synthetic"
        subprocess.run(
            [sys.executable, str(REPO / "bench" / "make_synthetic.py"), "--out", str(save), "--total-bytes", "16M"]
            + ["--keys", str(opts.keys), "--files", "16"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        ckpt = open_checkpoint(save)
        rows = []
        for target, extra in TARGETS:
            sets = parse_sets([extra[1]]) if extra[:1] == ("--set",) else {}
            strictness = extra[1] if extra[:1] == ("--strictness",) else "assume_ok_unexpected"
            run = LoadRun(sets=sets, strictness=strictness)
            report = predict(ckpt, target, run)
            cli = [sys.executable, "-m", "ckptdoctor", "can-load", str(save), "--target", target, *extra]
            rows.append(
                {
                    "target": " ".join([target, *extra]),
                    "verdict": report.verdict,
                    "failing": report.failing_sections,
                    "predict_s": round(best(functools.partial(predict, ckpt, target, run)), 4),
                    "open_and_predict_s": round(best(functools.partial(open_and_predict, save, target, run)), 4),
                    "cli_process_s": round(best(functools.partial(subprocess.run, cli, capture_output=True), 3), 4),
                    "cli_process_cpu_s": round(child_cpu(cli), 4),
                }
            )
            print(json.dumps(rows[-1]))
        keys = len(ckpt.entries)
        inspect_cli = [sys.executable, "-m", "ckptdoctor", "inspect", str(save)]
        inspect_s = round(best(functools.partial(subprocess.run, inspect_cli, capture_output=True), 3), 4)
        inspect_cpu = round(child_cpu(inspect_cli), 4)
        print(json.dumps({"inspect_process_s": inspect_s, "inspect_process_cpu_s": inspect_cpu}))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    result = {
        "bench": "can_load",
        "keys": keys,
        "rows": rows,
        "inspect_process_s": inspect_s,
        "inspect_process_cpu_s": inspect_cpu,
        "loadavg": os.getloadavg(),
        "cpus": len(os.sched_getaffinity(0)),
        "commit": commit.stdout.strip(),
        "python": sys.version.split()[0],
    }
    opts.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
