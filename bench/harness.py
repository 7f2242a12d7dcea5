"""The one measuring harness of the benchmark scripts: child processes, alternating groups, machine facts, results.

- **One run** (``run_once``): the command is spawned as its own child process; **wall** = spawn -> exit of that
  process (interpreter start, imports, work, exit), **CPU** = that child's user + sys, **peak RSS** = that
  child's own ``ru_maxrss`` as returned by ``os.wait4`` for its pid. A child that runs past ``timeout`` is killed
  (``timed_out``). A child may also report the seconds of one in-process call on a line ``BENCH_SECONDS=<s>``
  of its stdout (``Run.reported_s``): that is how a call's own time is measured after its imports.
- **An alternating group** (``alternate``): several commands measured in one run, round by round (one untimed
  warm-up round, then ``rounds`` timed ones; the order rotates each round), so that load from other work on the
  machine hits them alike. Figures are medians with [min-max]; ratios are taken per round (A_i / B_i) and
  summarised the same way, which cancels most of the load drift between rounds.
- **Machine facts** (``machine``): cores, CPU model, memory, Python, torch and ckptdoctor versions (read from
  the installed metadata: the harness never imports torch, so a forked child starts small), the git commit and
  whether the measured tree has uncommitted changes, and the 1-minute load average.
- **Results** (``write_results``): ``bench/results/<benchmark>.json``, with the command line, the date, the
  machine facts and the load before/after next to the figures; the README tables are made from these files.

The code measured is the ``ckptdoctor`` package of ``--code`` (default: this checkout), run as
``python -m ckptdoctor`` with that directory as working directory (``ckptdoctor(...)``); give a clean
``git worktree`` of a commit to measure exactly that commit while others edit this checkout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DATA = BENCH / "data"
RESULTS = BENCH / "results"
PYTHON = sys.executable
CODE = Path(os.environ.get("BENCH_CODE", REPO)).resolve()  # the ckptdoctor source tree measured
FLOOR = [PYTHON, "-c", "import click, tabulate"]  # interpreter start + the CLI's own imports, no work
SECONDS_TAG = "BENCH_SECONDS="


def parse_size(text: str) -> int:
    """'0.5G' -> bytes (K/M/G/T are powers of 1024, as in make_synthetic.py)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMGT" else text) * scale)


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """Options every benchmark script shares."""
    parser.add_argument(
        "--code",
        type=Path,
        default=None,
        help="ckptdoctor source tree to measure (default: this checkout; e.g. a git worktree of one commit)",
    )


def use_code(path: Path | None) -> None:
    global CODE
    if path is not None:
        CODE = path.resolve()


_BUILT: set[Path] = set()


def build_extension(tree: Path) -> None:
    """Build ``tree``'s C extensions in place (once per tree and run) where it has them
    and no extension at least as new: a bare git worktree has none, and without it the tree would run its Python
    walk, ~50x slower, and the benchmark would not measure that commit as installed."""
    tree = tree.resolve()
    sources = [*(tree / "ckptdoctor").rglob("*.c"), *(tree / "ckptdoctor").rglob("*.h")]
    if tree in _BUILT or not sources:
        return
    built = list((tree / "ckptdoctor").rglob("*.so"))
    if not built or min(p.stat().st_mtime for p in built) < max(p.stat().st_mtime for p in sources):
        script = "from setuptools import setup; setup(script_args=['-q', 'build_ext', '--inplace'])"
        proc = subprocess.run([PYTHON, "-c", script], cwd=tree, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{tree}: building the C pre-pass failed:\n{proc.stderr[-2000:]}")
    _BUILT.add(tree)


def ckptdoctor(*args: str) -> list[str]:
    """The command line of one ckptdoctor run (from ``CODE``: ``run_once`` uses it as working directory)."""
    return [PYTHON, "-m", "ckptdoctor", *args]


# ----------------------------------------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    wall_s: float
    cpu_s: float  # user + sys of that child: less sensitive to other load than wall
    peak_rss_mb: float
    rc: int | None  # None when killed on timeout
    timed_out: bool
    reported_s: float | None = None  # the child's own BENCH_SECONDS= line, if it printed one


def child_env(env: dict | None = None) -> dict:
    """The environment a timed command runs in: ``env`` (default: this one) without ``PYTHONDONTWRITEBYTECODE``,
    so each command imports the package from its bytecode caches (written by the warm-up round) as an installed
    ckptdoctor does, instead of compiling every module again in every run (about 0.1 s a command, which would
    count in every time and flatter every ratio)."""
    env = dict(os.environ if env is None else env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_once(
    cmd: Sequence[str],
    timeout: float = 600,
    stdout_path: Path | None = None,
    env: dict | None = None,
    cwd: Path | None = None,
) -> Run:
    """Spawn ``cmd`` and wait for exactly that pid with ``wait4``: wall time, CPU and that child's peak RSS.

    stdout goes to ``stdout_path`` (stderr beside it, ``.stderr``) when given, else to a scratch file that is
    read for a ``BENCH_SECONDS=`` line only."""
    build_extension(cwd or CODE)
    env = child_env(env)
    scratch = stdout_path or RESULTS / "stdout" / f"run-{os.getpid()}.out"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    with open(scratch, "wb") as out, open(scratch.with_suffix(".stderr"), "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, env=env, cwd=cwd or CODE)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    reported = None
    with open(scratch, "rb") as f:
        f.seek(max(0, scratch.stat().st_size - 4096))
        for line in f.read().decode(errors="replace").splitlines():
            if line.startswith(SECONDS_TAG):
                reported = float(line[len(SECONDS_TAG) :])
    timed_out = killed.is_set()
    return Run(
        wall,
        usage.ru_utime + usage.ru_stime,
        usage.ru_maxrss / 1024,
        None if timed_out else proc.returncode,
        timed_out,
        reported,
    )


# ----------------------------------------------------------------------------------------------------------------
# Figures: median [min-max]
# ----------------------------------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict:
    """median, min, max of ``values`` (and the values themselves)."""
    vals = list(values)
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals), "values": vals}


def fmt_spread(s: dict | None, spec: str = ".3f", unit: str = "") -> str:
    """'0.352 [0.341–0.360] s' (or '-' when missing)."""
    if not s:
        return "-"
    return f"{s['median']:{spec}} [{s['min']:{spec}}–{s['max']:{spec}}]{' ' + unit if unit else ''}"


# ----------------------------------------------------------------------------------------------------------------
# Alternating groups
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One command of a group. ``metric`` 'wall' (spawn -> exit) or 'reported' (the child's BENCH_SECONDS=);
    ``before`` runs before every run of it (e.g. removes an output dir); ``ok_rcs`` are the exits that count as
    a full run (ckptdoctor: 0 clean, 1 findings)."""

    cmd: Sequence[str]
    metric: str = "wall"
    before: Callable[[], None] | None = None
    ok_rcs: tuple[int, ...] = (0,)
    stdout_path: Path | None = None  # keeps the warm-up run's output (for output checks)
    cwd: Path | None = None  # default CODE: `python -m ckptdoctor` imports the package found there


@dataclass
class Group:
    cases: dict[str, Case]
    runs: dict[str, list[Run]] = field(default_factory=dict)
    order: list[list[str]] = field(default_factory=list)
    loadavg_per_round: list[float] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)

    def value(self, label: str, run: Run) -> float:
        if self.cases[label].metric == "reported":
            if run.reported_s is None:
                raise ValueError(f"{label}: the child printed no {SECONDS_TAG} line")
            return run.reported_s
        return run.wall_s

    def seconds(self, label: str) -> dict | None:
        runs = self.runs.get(label)
        return spread([self.value(label, r) for r in runs]) if runs and label not in self.failures else None

    def cpu(self, label: str) -> dict | None:
        runs = self.runs.get(label)
        return spread([r.cpu_s for r in runs]) if runs and label not in self.failures else None

    def peak_rss_mb(self, label: str) -> float | None:
        runs = self.runs.get(label)
        return max(r.peak_rss_mb for r in runs) if runs and label not in self.failures else None

    def ratio(self, a: str, b: str, minus: float = 0.0) -> dict | None:
        """Per-round ratio (a_i - minus) / (b_i - minus), summarised as median [min-max]."""
        if not self.runs.get(a) or not self.runs.get(b) or a in self.failures or b in self.failures:
            return None
        pairs = zip(self.runs[a], self.runs[b])
        return spread([(self.value(a, x) - minus) / (self.value(b, y) - minus) for x, y in pairs])

    def per_round(self, label: str) -> list[float]:
        return [self.value(label, r) for r in self.runs.get(label, [])]

    def summary(self) -> dict:
        """JSON-ready: per case its command, every run, and median [min-max] of its figures."""
        out = {}
        for label, case in self.cases.items():
            out[label] = {
                "command": shlex.join(str(c) for c in case.cmd),
                "metric": case.metric,
                "seconds": self.seconds(label),
                "cpu_s": self.cpu(label),
                "peak_rss_mb": self.peak_rss_mb(label),
                "failure": self.failures.get(label),
                "runs": [asdict(r) for r in self.runs.get(label, [])],
            }
        return {"cases": out, "order": self.order, "loadavg_per_round": self.loadavg_per_round}


def summary_ratio(cases: dict, a: str, b: str, field: str = "cpu_s") -> dict | None:
    """Per-round ratio a_i / b_i of one field of the runs in a ``Group.summary()["cases"]`` (e.g. CPU time, which
    other load inflates less than wall time), as median [min-max]."""
    if cases[a]["failure"] or cases[b]["failure"] or not cases[a]["runs"]:
        return None
    return spread([x[field] / y[field] for x, y in zip(cases[a]["runs"], cases[b]["runs"])])


def alternate(
    cases: dict[str, Case], rounds: int, timeout: float = 600, warm_up: bool = True, verbose: bool = True
) -> Group:
    """Run every case once per round, the order rotating by one each round (A B C, B C A, ...); round 0 is an
    untimed warm-up (page cache, first-run costs) unless ``warm_up`` is False. A case that fails (exit not in
    its ``ok_rcs``, or timeout) is dropped from later rounds and recorded in ``failures``."""
    group = Group(cases, {label: [] for label in cases})
    labels = list(cases)
    first = 0 if warm_up else 1
    for round_ in range(first, rounds + 1):
        shift = round_ % len(labels)
        order = [x for x in labels[shift:] + labels[:shift] if x not in group.failures]
        if round_:
            group.order.append(order)
        group.loadavg_per_round.append(os.getloadavg()[0])
        if verbose:
            print(f"  round {round_}{' (warm-up)' if not round_ else ''}:", end="", flush=True)
        for label in order:
            case = cases[label]
            if case.before:
                case.before()
            run = run_once(case.cmd, timeout, case.stdout_path if not round_ else None, cwd=case.cwd)
            if run.timed_out or run.rc not in case.ok_rcs:
                why = f"timed out after {timeout:g} s" if run.timed_out else f"exit {run.rc}"
                group.failures[label] = why
                print(f"\n  {label}: {why} ({shlex.join(str(c) for c in case.cmd)[:200]})", flush=True)
                continue
            if round_:
                group.runs[label].append(run)
            if verbose:
                print(f" {label}={group.value(label, run):.3f}s", end="", flush=True)
        if verbose:
            print(flush=True)
    group.loadavg_per_round.append(os.getloadavg()[0])
    return group


# ----------------------------------------------------------------------------------------------------------------
# Machine facts, synthetic inputs, results
# ----------------------------------------------------------------------------------------------------------------


def _git(*args: str, cwd: Path = REPO) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def machine() -> dict:
    """Cores, CPU, memory, versions, load, and the commit measured (with its uncommitted package changes)."""
    info: dict = {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    for pkg in ("torch", "ckptdoctor", "click", "megatron-core"):
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            info[pkg] = None
    info["loadavg_1m"] = os.getloadavg()[0]
    dirty = _git("status", "--porcelain", "--", "ckptdoctor", cwd=CODE).splitlines()
    info["code"] = {
        "path": str(CODE),
        "commit": _git("rev-parse", "--short", "HEAD", cwd=CODE) or None,
        "dirty": bool(dirty),  # uncommitted changes under ckptdoctor/ in the measured tree
        "dirty_paths": [line[3:] for line in dirty],
    }
    info["bench_commit"] = _git("rev-parse", "--short", "HEAD") or None
    return info


def synthetic(size: str, keys: int, files: int, **extra: str) -> Path:
    """A cached synthetic checkpoint in bench/data (made by make_synthetic.py in a child process when missing
    or made with other options); every benchmark script shares this cache."""
    name = f"synth_{size}_{keys}k_{files}f".replace(".", "p")
    for k, v in sorted(extra.items()):
        name += f"_{k}-{v}"
    out = DATA / name
    want = {"total_bytes": parse_size(size), "keys": keys, "files": files}
    info_path = out / "synthetic.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        recorded = {k: info.get(k.replace("-", "_")) for k in extra}  # --shape-tp is recorded as shape_tp
        if (
            info.get("requested") == want
            and all(str(recorded[k]) == str(v) for k, v in extra.items())
            and _current_synthetic(info, out)
        ):
            _note_size(out, info)
            return out
    cmd = [PYTHON, str(BENCH / "make_synthetic.py"), "--out", str(out), "--total-bytes", size]
    cmd += ["--keys", str(keys), "--files", str(files)]
    for k, v in extra.items():
        cmd += [f"--{k}", str(v)]
    print(f"  generating {out.name}: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    print(f"  generated in {time.perf_counter() - t0:.1f} s", flush=True)
    _note_size(out, json.loads(info_path.read_text()))
    return out


def synthetic_generator() -> int:
    """make_synthetic.py's ``GENERATOR`` version, read from its source (importing it would import torch)."""
    match = re.search(r"^GENERATOR = (\d+)", (BENCH / "make_synthetic.py").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def _current_synthetic(info: dict, out: Path) -> bool:
    """A cached save is reused when the current generator made it, or when an older one (version 1 recorded no
    version: it could miss --total-bytes by 3-25x) made it within 10% of the requested size on disk."""
    if "generator" in info:
        return info["generator"] == synthetic_generator()
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != "synthetic.json")
    return abs(on_disk / info["requested"]["total_bytes"] - 1) <= 0.10


def _note_size(out: Path, info: dict) -> None:
    """Say so when a save is not the size its name (and a table's label) says: too many keys/chunks for it."""
    if info.get("size_note"):
        print(f"  note: {out.name} is not its label's size: {info['size_note']}", flush=True)


def private_copy(save: Path, dest: Path) -> Path:
    """A byte copy of a cached synthetic that no other benchmark regenerates while this one runs (kept while its
    ``synthetic.json`` matches the source's)."""
    info = save / "synthetic.json"
    if (dest / "synthetic.json").exists() and (dest / "synthetic.json").read_bytes() == info.read_bytes():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    print(f"  copying {save.name} -> {dest.name}", flush=True)
    shutil.copytree(save, dest)
    return dest


def synthetic_info(save: Path) -> dict:
    return json.loads((save / "synthetic.json").read_text())


def iteration_files(save: Path) -> tuple[Path, list[str], int]:
    """The iteration dir of a synthetic save, its ``.distcp`` + ``.metadata`` names and their total bytes."""
    iteration = save / synthetic_info(save)["iteration_dir"].rsplit("/", 1)[-1]
    names = sorted(p.name for p in iteration.iterdir() if p.suffix == ".distcp" or p.name == ".metadata")
    return iteration, names, sum((iteration / n).stat().st_size for n in names)


def cat_command(directory: Path, names: Sequence[str]) -> list[str]:
    """``cat`` of ``names`` in ``directory`` to /dev/null, as one child process."""
    quoted = " ".join(shlex.quote(n) for n in names)
    return ["sh", "-c", f"cd {shlex.quote(str(directory))} && cat {quoted} > /dev/null"]


def evict(root: Path) -> None:
    """Drop the files under ``root`` from the page cache (``posix_fadvise(DONTNEED)``: no root needed; their pages are
    clean), so the next command reads them from the disk, as a checkpoint larger than memory is read."""
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Recorder:
    """Load before/after and the command line of one benchmark run; ``write`` makes its results JSON."""

    def __init__(self, benchmark: str, argv: Sequence[str] | None = None, script: str | None = None) -> None:
        self.benchmark = benchmark
        self.started = dt.datetime.now(dt.timezone.utc)
        self.load_before = os.getloadavg()[0]
        script = script or Path(sys.argv[0]).name
        args = list(sys.argv[1:] if argv is None else argv)
        self.command = shlex.join(["python", f"bench/{script}", *args])

    def write(self, payload: dict, name: str | None = None) -> Path:
        path = RESULTS / f"{name or self.benchmark}.json"
        doc = {
            "benchmark": self.benchmark,
            "results_file": str(path.relative_to(REPO)),
            "command": self.command,
            "date_utc": self.started.isoformat(timespec="seconds"),
            "seconds": round((dt.datetime.now(dt.timezone.utc) - self.started).total_seconds(), 1),
            "loadavg_1m": {"before": self.load_before, "after": os.getloadavg()[0]},
            "machine": machine(),
            "cache": "warm (one untimed warm-up round first)",
        } | payload
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {path.relative_to(REPO)}")
        return path


def header(doc: dict) -> str:
    """The line every README table carries: command, results file, commit, load, machine."""
    m = doc["machine"]
    code = m["code"]
    commit = code["commit"] + (" + uncommitted package changes" if code["dirty"] else "")
    load = doc["loadavg_1m"]
    return (
        f"`{doc['command']}` -> `{doc['results_file']}`; {doc['date_utc'][:16]} UTC, commit "
        f"{commit}; {m['cores']} cores, Python {m['python']}, torch {m['torch']}; load (1 min) "
        f"{load['before']:.1f} -> {load['after']:.1f}"
    )
