"""Value work across chunk layouts and in parallel, next to ``cat`` of the same bytes (issues #16 §2, #15).

Cases (synthetic checkpoints of one model at several TP sizes, ``make_synthetic.py --values global``: equal
shapes and equal values, so ``diff --values`` compares every element and finds them equal):

- **cross-layout** ``diff --values`` TP64 vs TP8, TP64 vs TP1, TP2 vs TP4: the value engine before this change
  (``--before``: a worktree of the earlier commit) and after it, each with one worker (``--jobs 1``; the
  earlier engine has no ``--jobs``: it ran two threads), next to ``cat`` of both checkpoints' data files;
- **parallel** ``check --deep`` (TP8) and ``diff --values`` (TP2 vs TP4): ``--jobs 1`` and ``--jobs 2``, torchrun
  with 1, 2 and 4 ranks, next to ``cat`` and a parallel ``cat`` (two ``cat`` processes over halves of the files).

Every group of commands runs in alternating rounds (one untimed warm-up round, then ``--rounds``; the order
rotates each round) so that load from other work on the machine hits them alike; each command is a child
process, timed spawn to exit. Reported per command: median [min-max] seconds, and the ratio of ``cat``'s time
to the command's time per round (= the command's throughput as a fraction of ``cat``'s over the same bytes),
median [min-max], and the CPU seconds (user + sys of the command's process tree: on a machine shared with other
work, wall time also measures the others). The cross-layout cases also time the value engine alone
(``compare_values`` in-process, after opening both checkpoints and importing torch: ``ENGINE``), wall and CPU,
before and after. Results: ``bench/results/values.json``.

Usage::

    python bench/bench_values.py --data /tmp/bench_data --before /tmp/ckd_before --rounds 3
    python bench/bench_values.py --data . --table bench/results/values.json    # the README tables
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PYTHON = sys.executable


def data_files(save: Path) -> list[Path]:
    return sorted(next(save.glob("iter_*")).glob("*.distcp"))


def ckptdoctor(code: Path, *args: str) -> list[str]:
    """``python -m ckptdoctor`` of the source tree ``code`` (its dir is the working dir: first on sys.path)."""
    return ["env", f"--chdir={code}", PYTHON, "-m", "ckptdoctor", *map(str, args)]


def torchrun(code: Path, ranks: int, *args: str) -> list[str]:
    run = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return ["env", f"--chdir={code}", f"PYTHONPATH={code}", *run, "-m", "ckptdoctor", *map(str, args)]


def cat(files: list[Path], parts: int = 1) -> list[str]:
    if parts == 1:
        return ["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, files)]
    shares = [files[i::parts] for i in range(parts)]
    script = " ".join(f"cat {' '.join(map(str, s))} > /dev/null &" for s in shares) + " wait"
    return ["sh", "-c", script]


def run_once(cmd: list[str], timeout: float) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + sys of the child and every descendant it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)}: exit {result.returncode}\n{result.stderr.decode()[-2000:]}")
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


# The value engine alone, in a child whose working dir is the measured tree (so its ckptdoctor is imported):
# both checkpoints opened and torch imported first, then the wall and CPU seconds of compare_values only.
ENGINE = """
import inspect, json, sys, time
import torch
from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.ops.diff.compare import diff_checkpoints
import ckptdoctor.values.diff as values_diff
measured = {}
inner = values_diff.compare_values
def timed(*args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    report = inner(*args, **kwargs)
    measured.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu, report=report)
    return report
values_diff.compare_values = timed
a, b = open_checkpoint(sys.argv[1]), open_checkpoint(sys.argv[2])
extra = {"jobs": 1} if "jobs" in inspect.signature(diff_checkpoints).parameters else {}
diff_checkpoints(a, b, values=True, **extra)
r = measured["report"]
print(json.dumps({"wall": measured["wall"], "cpu": measured["cpu"], "bytes": r.bytes_read["a"] + r.bytes_read["b"],
                  "equal": r.equal, "compared": r.compared, "workers": r.workers}))
"""


def engine(code: Path, a: Path, b: Path, rounds: int) -> dict:
    """``compare_values`` alone (see ENGINE), ``rounds`` runs: wall and CPU seconds, MB/s of CPU."""
    runs = []
    for _ in range(rounds):
        out = subprocess.run(
            [PYTHON, "-c", ENGINE, str(a), str(b)], cwd=code, capture_output=True, text=True, check=True
        ).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"  engine {code.name}: {runs[-1]}", file=sys.stderr, flush=True)
    return {
        "wall_seconds": spread([r["wall"] for r in runs]),
        "cpu_seconds": spread([r["cpu"] for r in runs]),
        "bytes": runs[0]["bytes"],
        "equal": runs[0]["equal"],
        "compared": runs[0]["compared"],
        "workers": runs[0]["workers"],
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def alternate(commands: dict[str, list[str]], rounds: int, timeout: float, reference: str = "cat") -> dict:
    """Each command once per round (order rotating), after one untimed warm-up round."""
    names = list(commands)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            seconds, used = run_once(commands[name], timeout)
            if r:
                times[name].append(seconds)
                cpu[name].append(used)
            print(f"  round {r} {name}: {seconds:.2f} s wall, {used:.2f} s CPU", file=sys.stderr, flush=True)
    out = {}
    for name in names:
        ratios = [c / t for c, t in zip(times[reference], times[name])]
        out[name] = {
            "seconds": spread(times[name]),
            "cpu_seconds": spread(cpu[name]),
            "of_cat_throughput": spread(ratios),
            "cmd": commands[name],
        }
    return out


def machine(code: Path) -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=code, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") + (" (uncommitted changes)" if git("status", "--porcelain", "ckptdoctor") else "")
    return {
        "cores": len(os.sched_getaffinity(0)),
        "load_1min": os.getloadavg()[0],
        "python": sys.version.split()[0],
        "commit": commit,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def info(save: Path) -> dict:
    meta = save.parent / f"{save.name}.json"
    doc = json.loads(meta.read_text()) if meta.exists() else {}
    keep = ("tp", "hidden", "vocab", "keys", "chunks", "files", "data_bytes")
    return {k: doc[k] for k in keep if k in doc}


def _fmt(s: dict, spec: str = ".2f", unit: str = "") -> str:
    return f"{s['median']:{spec}}{unit} [{s['min']:{spec}}-{s['max']:{spec}}]"


def table(doc: dict) -> str:
    """The README tables (markdown) from a results document."""
    lines = ["| case | bytes read | command | wall s | CPU s | throughput / `cat`'s | engine CPU s (MB/s) |"]
    lines.append("|---|---|---|---|---|---|---|")
    for name, case in doc["cross_layout"].items():
        gb = f"{case['bytes'] / 1e9:.2f} GB"
        for cmd in ("cat", "before", "after"):
            fig = case["figures"].get(cmd)
            if fig is None:
                continue
            eng = case.get(f"engine_{cmd}")
            engine_text = ""
            if eng:
                rate = eng["bytes"] / 1e6 / eng["cpu_seconds"]["median"]
                engine_text = f"{_fmt(eng['cpu_seconds'])} ({rate:.0f})"
            label = {"cat": "`cat` A B", "before": "before (2 threads)", "after": "after (`--jobs 1`)"}[cmd]
            ratio = "1" if cmd == "cat" else _fmt(fig["of_cat_throughput"], ".3f")
            lines.append(
                f"| {name} | {gb} | {label} | {_fmt(fig['seconds'])} | {_fmt(fig['cpu_seconds'])} | {ratio} | "
                f"{engine_text} |"
            )
    lines += ["", "| work | bytes | command | wall s | CPU s | throughput / `cat`'s |", "|---|---|---|---|---|---|"]
    for name, case in doc["parallel"].items():
        for cmd, fig in case["figures"].items():
            ratio = _fmt(fig["of_cat_throughput"], ".3f")
            lines.append(
                f"| {name} | {case['bytes'] / 1e9:.2f} GB | {cmd} | {_fmt(fig['seconds'])} | "
                f"{_fmt(fig['cpu_seconds'])} | {ratio} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="dir holding tp1, tp2, tp4, tp8, tp64 save dirs")
    p.add_argument("--before", type=Path, default=None, help="a worktree of the commit before the change")
    p.add_argument("--code", type=Path, default=REPO, help="the source tree measured (default: this checkout)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--only", choices=["cross", "parallel"], default=None)
    p.add_argument("--out", type=Path, default=BENCH / "results" / "values.json")
    p.add_argument("--table", type=Path, default=None, help="print the README tables of this results file, then exit")
    a = p.parse_args()
    if a.table is not None:
        print(table(json.loads(a.table.read_text())))
        return 0
    doc: dict = {
        "benchmark": "values",
        "argv": sys.argv,
        "machine": machine(a.code),
        "cross_layout": {},
        "parallel": {},
    }
    if a.only != "parallel":
        for left, right in (("tp64", "tp8"), ("tp64", "tp1"), ("tp2", "tp4")):
            pa, pb = a.data / left, a.data / right
            both = data_files(pa) + data_files(pb)
            commands = {"cat": cat(both), "after": ckptdoctor(a.code, "diff", "--values", "-q", "--jobs", "1", pa, pb)}
            if a.before is not None:
                commands["before"] = ckptdoctor(a.before, "diff", "--values", "-q", pa, pb)
            name = f"{left} vs {right}"
            print(name, file=sys.stderr)
            doc["cross_layout"][name] = {
                "a": info(pa),
                "b": info(pb),
                "bytes": sum(f.stat().st_size for f in both),
                "figures": alternate(commands, a.rounds, a.timeout),
                "engine_after": engine(a.code, pa, pb, a.rounds),
            }
            if a.before is not None:
                doc["cross_layout"][name]["engine_before"] = engine(a.before, pa, pb, a.rounds)
    if a.only != "cross":
        deep = a.data / "tp8"
        pair = (a.data / "tp2", a.data / "tp4")
        for label, files, args in (
            ("check --deep tp8", data_files(deep), ("check", "--isolated", "--deep", "--quiet", str(deep))),
            (
                "diff --values tp2 vs tp4",
                data_files(pair[0]) + data_files(pair[1]),
                ("diff", "--values", "-q", *map(str, pair)),
            ),
        ):
            commands = {
                "cat": cat(files),
                "cat x2": cat(files, 2),
                "jobs 1": ckptdoctor(a.code, *args[:1], "--jobs", "1", *args[1:]),
                "jobs 2": ckptdoctor(a.code, *args[:1], "--jobs", "2", *args[1:]),
                "torchrun 1": torchrun(a.code, 1, *args[:1], "--jobs", "1", *args[1:]),
                "torchrun 2": torchrun(a.code, 2, *args[:1], "--jobs", "1", *args[1:]),
                "torchrun 4": torchrun(a.code, 4, *args[:1], "--jobs", "1", *args[1:]),
            }
            print(label, file=sys.stderr)
            doc["parallel"][label] = {
                "bytes": sum(f.stat().st_size for f in files),
                "figures": alternate(commands, a.rounds, a.timeout),
            }
    doc["machine"]["load_1min_after"] = os.getloadavg()[0]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(a.out.read_text()) if a.out.exists() else {}
    for part in ("cross_layout", "parallel"):  # a run of one part keeps the other's figures
        if not doc[part] and previous.get(part):
            doc[part] = previous[part]
            doc.setdefault("kept_from_earlier_run", []).append({"part": part, "machine": previous.get("machine")})
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
