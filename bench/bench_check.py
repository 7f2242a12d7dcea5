"""Benchmark ``ckptdoctor check`` on synthetic checkpoints of 2,000 data files and 20,000 keys, in one run.

Inputs: ``make_synthetic.py`` checkpoints (real PyTorch DCP writes), cached in ``bench/data/synth_<size>_...``
(the same cache ``run.py`` uses). Every command runs in its own child process; its wall time is spawn -> exit
(interpreter start, imports, work, exit) and its peak RSS that child's own (``run.run_once``). One untimed
warm-up round first (page cache warm), then ``--repeats`` rounds, the commands interleaved within each round so
that load from other work on the machine hits them alike; medians are reported.

Targets (issue 6):
- non-deep ``check`` of the 4 GB checkpoint <= 1 s for the whole process, and no torch import;
- time independent of data size: median(4 GB) / median(0.5 GB) <= 1.3;
- ``--deep`` throughput >= 60 % of ``cat`` of the same files (data files and .metadata) to /dev/null.

    python bench/bench_check.py                 # 0.5G and 4G
    python bench/bench_check.py --repeats 3

Prints a Markdown table and writes ``bench/results/check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from run import REPO, RESULTS, machine_info, synthetic  # noqa: E402  (run.py: no torch)

PROBE = """
import sys
from ckptdoctor.cli import main
rc = main(['check', '--isolated', '-q', sys.argv[1]])
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy'))
print('HEAVY:' + ','.join(heavy))
sys.exit(rc)
"""


def run_once(cmd: list[str], timeout: float) -> tuple[float, float, float, int | None]:
    """(wall s, CPU s = user + sys, peak RSS MB, rc) of one child, from spawn to exit (its own rusage)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    deadline = t0 + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            return time.perf_counter() - t0, 0.0, 0.0, None
        time.sleep(0.002)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, proc.returncode


def iteration_files(save: Path) -> tuple[Path, list[str], int]:
    iteration = save / json.loads((save / "synthetic.json").read_text())["iteration_dir"].rsplit("/", 1)[-1]
    names = sorted(p.name for p in iteration.iterdir() if p.suffix == ".distcp" or p.name == ".metadata")
    return iteration, names, sum((iteration / n).stat().st_size for n in names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.5G,4G", help="small,large data sizes (default 0.5G,4G)")
    p.add_argument("--keys", type=int, default=20000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=RESULTS / "check.json")
    o = p.parse_args(argv)
    small, large = [s.strip() for s in o.sizes.split(",")]
    ckptdoctor = str(Path(o.python).parent / "ckptdoctor")
    saves = {size: synthetic(o.python, size, o.keys, o.files) for size in (small, large)}

    # Untimed probe: the non-deep check imports neither torch nor megatron (nor numpy).
    probes = {}
    for size, save in saves.items():
        r = subprocess.run([o.python, "-c", PROBE, str(save)], capture_output=True, text=True, cwd=REPO)
        heavy = r.stdout.strip().rsplit("HEAVY:", 1)[-1]
        probes[size] = {"rc": r.returncode, "heavy_modules": heavy.split(",") if heavy else []}
        if r.returncode != 0:
            print(r.stdout, r.stderr)
            raise SystemExit(f"check reported findings or failed on {save} (rc {r.returncode})")

    commands: dict[str, list[str]] = {}
    data_bytes: dict[str, int] = {}
    for size, save in saves.items():
        iteration, names, nbytes = iteration_files(save)
        data_bytes[size] = nbytes
        commands[f"check {size}"] = [ckptdoctor, "check", "--isolated", "-q", str(save)]
        commands[f"cat {size}"] = [
            "sh",
            "-c",
            "cd " + shlex.quote(str(iteration)) + " && cat " + " ".join(shlex.quote(n) for n in names) + " > /dev/null",
        ]
        commands[f"check --deep {size}"] = [ckptdoctor, "check", "--isolated", "-q", "--deep", str(save)]

    walls: dict[str, list[float]] = {label: [] for label in commands}
    cpus: dict[str, list[float]] = {label: [] for label in commands}
    rss: dict[str, float] = {label: 0.0 for label in commands}
    loads = [os.getloadavg()[0]]
    for round_ in range(o.repeats + 1):  # round 0 is the warm-up
        for label, cmd in commands.items():
            wall, cpu, peak, rc = run_once(cmd, o.timeout)
            if rc != 0:
                raise SystemExit(f"{label}: rc {rc} (None: timed out after {o.timeout} s)")
            if round_:
                walls[label].append(wall)
                cpus[label].append(cpu)
                rss[label] = max(rss[label], peak)
        loads.append(os.getloadavg()[0])

    med = {label: statistics.median(w) for label, w in walls.items()}
    cpu_med = {label: statistics.median(c) for label, c in cpus.items()}
    best = {label: min(w) for label, w in walls.items()}
    gbps = {
        size: {
            "cat": data_bytes[size] / med[f"cat {size}"] / 1e9,
            "deep": data_bytes[size] / med[f"check --deep {size}"] / 1e9,
        }
        for size in saves
    }
    targets = [
        ("non-deep check, 4 GB, whole process (median)", med[f"check {large}"], "<=", 1.0, "s"),
        ("non-deep check, 0.5 GB, whole process (median)", med[f"check {small}"], "<=", 1.0, "s"),
        (f"time {large} / time {small} (medians)", med[f"check {large}"] / med[f"check {small}"], "<=", 1.3, "x"),
        (f"--deep throughput / cat throughput, {large}", gbps[large]["deep"] / gbps[large]["cat"], ">=", 0.6, "x"),
        (
            "torch / megatron / numpy imported by non-deep check",
            float(sum(len(v["heavy_modules"]) for v in probes.values())),
            "<=",
            0,
            "modules",
        ),
    ]

    def met(value: float, op: str, limit: float) -> bool:
        return value <= limit if op == "<=" else value >= limit

    lines = [
        f"machine: {machine_info()}",
        f"load average (1 min) per round: {', '.join(f'{x:.1f}' for x in loads)}",
        "",
        "| command | data | runs | wall best (s) | wall median (s) | CPU median (s) | GB/s (median wall) "
        "| peak RSS (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label in commands:
        size = label.rsplit(" ", 1)[1]
        rate = "-"
        if label.startswith("cat"):
            rate = f"{gbps[size]['cat']:.2f}"
        elif "--deep" in label:
            rate = f"{gbps[size]['deep']:.2f}"
        lines.append(
            f"| `{label}` | {data_bytes[size] / 1e9:.2f} GB | {len(walls[label])} | {best[label]:.3f} "
            f"| {med[label]:.3f} | {cpu_med[label]:.3f} | {rate} | {rss[label]:.0f} |"
        )
    pass_gbps = data_bytes[large] / (med[f"check --deep {large}"] - med[f"check {large}"]) / 1e9
    lines += [
        "",
        f"Informational: the deep pass alone (median deep minus median non-deep, {large}) reads "
        f"{pass_gbps:.2f} GB/s = {pass_gbps / gbps[large]['cat']:.2f} x cat; "
        f"at {small} (28 KB chunks on average) whole-process deep/cat is "
        f"{gbps[small]['deep'] / gbps[small]['cat']:.2f} x (per-chunk and metadata costs dominate).",
    ]
    lines += ["", "| target | measured | required | met |", "|---|---|---|---|"]
    for name, value, op, limit, unit in targets:
        verdict = "yes" if met(value, op, limit) else "**NO**"
        lines.append(f"| {name} | {value:.3f} {unit} | {op} {limit:g} {unit} | {verdict} |")
    md = "\n".join(lines)
    print(md)
    payload = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join(["python", "bench/bench_check.py", *(argv or sys.argv[1:])]),
        "machine": machine_info(),
        "loadavg_per_round": loads,
        "data_bytes": data_bytes,
        "probes": probes,
        "commands": {
            label: shlex.join(cmd) if len(shlex.join(cmd)) < 300 else shlex.join(cmd)[:300] + " ..."
            for label, cmd in commands.items()
        },
        "walls_s": walls,
        "cpu_s": cpus,
        "cpu_median_s": cpu_med,
        "median_s": med,
        "best_s": best,
        "peak_rss_mb": rss,
        "throughput_gbps": gbps,
        "targets": [
            {"name": n, "value": v, "op": op, "limit": lim, "unit": u, "met": met(v, op, lim)}
            for n, v, op, lim, u in targets
        ],
    }
    o.out.parent.mkdir(parents=True, exist_ok=True)
    o.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {o.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
