"""Value commands (``check --deep``, ``diff --values``) of two source trees side by side, beside ``cat``.

    python bench/make_synthetic.py --out /tmp/syn4G --total-bytes 4G --keys 20000 --files 2000 --tp 2 --shape-tp 2
    cp -r /tmp/syn4G /tmp/syn4G_copy
    git worktree add --detach /tmp/wt_before <commit>; git worktree add --detach /tmp/wt_after <commit>
    python bench/bench_deep_before_after.py --before /tmp/wt_before --after /tmp/wt_after --rounds 3 \\
        --case deep-4G=check:/tmp/syn4G --case values-4G=diff:/tmp/syn4G,/tmp/syn4G_copy \\
        --case tp64-tp8=diff:/tmp/bench_data/tp64,/tmp/bench_data/tp8 --out bench/results/values-before-after.json
    python bench/bench_deep_before_after.py /tmp/syn05 --before /tmp/wt_before --rounds 3   # the first form

Each case is one alternating group: ``cat`` of the data files the command reads (and ``.metadata``), then
the command of each tree with ``--jobs 1`` and ``--jobs 2``; one untimed warm-up round (page cache warm), then
``--rounds`` rounds with the order rotating. Every command is a child process (cwd ``/``, the tree on
``PYTHONPATH``), timed spawn to exit; CPU is user + sys of the child and its workers. Reported per command:
wall and CPU seconds, and ``cat``'s wall over the command's per round (the command's throughput as a fraction
of ``cat``'s over the same bytes), each median [min-max]. The outputs of the two trees are compared once
(``--format json``, timings masked): a difference fails the run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import harness  # noqa: E402

_TIMINGS = re.compile(r'"(seconds|peak_in_flight)": [0-9.e-]+')


def data_files(save: Path) -> list[str]:
    iteration = next(save.glob("iter_*"), save)
    return sorted(str(p) for p in iteration.glob("*.distcp")) + [str(iteration / ".metadata")]


def command(kind: str, saves: list[Path], jobs: int, fmt: str = "text") -> list[str]:
    base = [sys.executable, "-m", "ckptdoctor"]
    if kind == "check":
        return [*base, "check", "--deep", "--isolated", "--jobs", str(jobs), "--format", fmt, str(saves[0])]
    return [*base, "diff", "--values", "--jobs", str(jobs), "--format", fmt, *map(str, saves)]


def run_once(cmd: list[str], code: str | None) -> tuple[float, float]:
    if code:
        harness.build_extension(Path(code))
    env = {**os.environ, **({"PYTHONPATH": code} if code else {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def same_output(kind: str, saves: list[Path], trees: dict[str, str]) -> bool:
    outs = []
    for code in trees.values():
        env = {**os.environ, "PYTHONPATH": code}
        proc = subprocess.run(command(kind, saves, 1, "json"), env=env, cwd="/", capture_output=True, text=True)
        outs.append((proc.returncode, _TIMINGS.sub(r'"\1": <t>', proc.stdout)))
    return all(o == outs[0] for o in outs)


def run_case(name: str, kind: str, saves: list[Path], trees: dict[str, str], jobs: list[int], rounds: int) -> dict:
    files = [f for save in saves for f in data_files(save)]
    nbytes = sum(os.path.getsize(f) for f in files)
    commands: dict[str, tuple[list[str], str | None]] = {"cat": (["cat", *files], None)}
    for tree, code in trees.items():
        for j in jobs:
            commands[f"{tree} --jobs {j}"] = (command(kind, saves, j), code)
    names = list(commands)
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    for round_ in range(rounds + 1):  # round 0 warms the page cache and is not counted
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for n in order:
            measured = run_once(*commands[n])
            if round_:
                runs[n].append(measured)
        print(
            f"  {name} round {round_}: " + ", ".join(f"{n} {runs[n][-1][0]:.2f}" for n in names if runs[n]),
            file=sys.stderr,
            flush=True,
        )
    load.append(os.getloadavg()[0])
    out = {"kind": kind, "inputs": [str(s) for s in saves], "bytes": nbytes, "load_1min": load, "commands": {}}
    for n in names:
        walls = [w for w, _ in runs[n]]
        out["commands"][n] = {
            "wall_seconds": spread(walls),
            "cpu_seconds": spread([c for _, c in runs[n]]),
            "throughput_vs_cat": spread([runs["cat"][i][0] / walls[i] for i in range(rounds)]),
        }
    out["same_output"] = same_output(kind, saves, trees)
    return out


def table(results: dict) -> str:
    lines = ["| case | bytes | command | wall s | CPU s | throughput / `cat`'s |", "|---|---|---|---|---|---|"]

    def f(s: dict, digits: int = 2) -> str:
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"

    for name, case in results["cases"].items():
        for n, c in case["commands"].items():
            lines.append(
                f"| {name} | {case['bytes'] / 1e9:.2f} GB | {n} | {f(c['wall_seconds'])} | {f(c['cpu_seconds'])} "
                f"| {f(c['throughput_vs_cat'], 3)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, nargs="?", help="first form: check --deep of this checkpoint")
    parser.add_argument("--before", type=Path, help="a worktree of the commit to compare with")
    parser.add_argument("--after", type=Path, default=REPO, help="the tree measured after (default: this one)")
    parser.add_argument("--case", action="append", default=[], help="NAME=check:SAVE or NAME=diff:A,B")
    parser.add_argument("--jobs", default="1,2", help="--jobs values to run each tree with (default 1,2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the results (JSON) here")
    parser.add_argument("--table", type=Path, help="print the README table of a results file and stop")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    cases = list(args.case)
    if args.checkpoint is not None:
        cases.insert(0, f"deep=check:{args.checkpoint}")
    trees = {"before": str(args.before), "after": str(args.after)} if args.before else {"after": str(args.after)}
    jobs = [int(j) for j in args.jobs.split(",")]
    results: dict = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "trees": {
            t: subprocess.run(
                ["git", "-C", c, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            + (
                ""
                if not subprocess.run(
                    ["git", "-C", c, "status", "--short", "--untracked-files=no"], capture_output=True, text=True
                ).stdout
                else " (modified)"
            )
            for t, c in trees.items()
        },
        "cores": len(os.sched_getaffinity(0)),
        "rounds": args.rounds,
        "cases": {},
    }
    for spec in cases:
        name, rest = spec.split("=", 1)
        kind, paths = rest.split(":", 1)
        results["cases"][name] = run_case(name, kind, [Path(p) for p in paths.split(",")], trees, jobs, args.rounds)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    for name, case in results["cases"].items():
        print(
            f"{name}: load {case['load_1min'][0]:.1f} -> {case['load_1min'][1]:.1f}, same output: {case['same_output']}"
        )
    return 0 if all(c["same_output"] for c in results["cases"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
