"""Time ckptdoctor commands and their usual workarounds side by side, in one run; write Markdown + JSON.

Every measured command runs in its own child process.  Its wall time is taken around spawn -> exit (the
whole process: interpreter start, imports, work, exit) and its peak RSS is the child's own ``ru_maxrss`` as
returned by ``os.wait4`` for that pid (so one figure per child, never an aggregate of several).  Each command
gets one untimed warm-up run first (page cache warm: the synthetic checkpoints are written just before and fit
in RAM), then ``--repeats`` timed runs; best and median wall and the largest peak RSS are reported.

Benchmarks are named functions in a small registry (``@benchmark("name")``); add ``diff``, ``check``,
``fix-args``, ``strip-frozen``, ... the same way.  Synthetic checkpoints are made by ``make_synthetic.py`` on
first use and cached in ``bench/data/``.

    python bench/run.py                                   # every registered benchmark
    python bench/run.py --only inspect --sizes 0.5G,4G    # one benchmark, chosen sizes
    python bench/run.py --list
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DATA = BENCH / "data"
RESULTS = BENCH / "results"


def parse_size(text: str) -> int:
    """'0.5G' -> bytes (K/M/G/T are powers of 1024, as in make_synthetic.py)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMGT" else text) * scale)


# ----------------------------------------------------------------------------------------------------------------
# Measuring one command
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    wall_s: float
    cpu_s: float  # user + system CPU of that child: less sensitive than wall to other load on the machine
    peak_rss_mb: float
    rc: int | None  # None when killed on timeout
    timed_out: bool


def run_once(cmd: list[str], timeout: float, stdout_path: Path | None = None, env: dict | None = None) -> Run:
    """Spawn ``cmd``, wait for exactly that pid with wait4: wall time and that child's peak RSS."""
    out = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    try:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.PIPE if stdout_path else subprocess.DEVNULL, env=env, cwd=REPO
        )
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        if stdout_path:  # keep stderr for the checks; a small pipe read does not change the figures
            stderr = proc.stderr.read()
            stdout_path.with_suffix(".stderr").write_bytes(stderr)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if stdout_path:
            out.close()
    timed_out = killed.is_set()
    return Run(
        wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, None if timed_out else proc.returncode, timed_out
    )


@dataclass
class Measurement:
    benchmark: str
    label: str
    size: str | None
    command: str
    repeats: int
    wall_best_s: float | None = None
    wall_median_s: float | None = None
    peak_rss_mb: float | None = None  # largest over the timed runs
    cpu_median_s: float | None = None
    runs: list[dict] = field(default_factory=list)
    timed_out: bool = False
    timeout_s: float | None = None
    rc: int | None = None
    note: str = ""
    loadavg_1m: float | None = None  # system load when the timed runs began (other work skews the figures)
    ok_rcs: tuple[int, ...] = (0,)  # ckptdoctor: 0 clean, 1 findings; 2 is an error

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.rc in self.ok_rcs


def measure(
    benchmark: str,
    label: str,
    cmd: list[str],
    repeats: int,
    timeout: float,
    size: str | None = None,
    check: Callable[[Path], str] | None = None,
    cleanup: Callable[[], None] | None = None,
    note: str = "",
    ok_rcs: tuple[int, ...] = (0,),
) -> Measurement:
    """One untimed warm-up run (its stdout goes to ``check``), then ``repeats`` timed runs."""
    m = Measurement(
        benchmark, label, size, shlex.join(str(c) for c in cmd), repeats, timeout_s=timeout, note=note, ok_rcs=ok_rcs
    )
    scratch = RESULTS / "stdout"
    scratch.mkdir(parents=True, exist_ok=True)
    stdout_path = scratch / f"{benchmark}-{label}-{size or 'x'}.out".replace("/", "_").replace(" ", "_")
    print(f"  [{benchmark}] {label} {size or ''}: warm-up ...", end="", flush=True)
    warm = run_once(cmd, timeout, stdout_path)
    if cleanup:
        cleanup()
    m.rc = warm.rc
    if warm.timed_out or warm.rc not in ok_rcs:
        m.timed_out = warm.timed_out
        m.runs.append(asdict(warm) | {"warm_up": True})
        m.wall_best_s = m.wall_median_s = warm.wall_s
        m.peak_rss_mb, m.cpu_median_s = warm.peak_rss_mb, warm.cpu_s
        why = f"timed out after {timeout:.0f} s" if warm.timed_out else f"exit {warm.rc}"
        err = stdout_path.with_suffix(".stderr")
        tail = err.read_text(errors="replace").strip().splitlines()[-1:] if err.exists() else []
        m.note = "; ".join(x for x in [m.note, why, *tail] if x)
        print(f" {why}; no timed runs")
        return m
    if check:
        problem = check(stdout_path)
        if problem:
            m.note = "; ".join(x for x in [m.note, f"output check failed: {problem}"] if x)
    m.loadavg_1m = os.getloadavg()[0]
    runs = []
    for _ in range(repeats):
        r = run_once(cmd, timeout)
        if cleanup:
            cleanup()
        runs.append(r)
        print(f" {r.wall_s:.3f}s", end="", flush=True)
        if r.timed_out or r.rc not in ok_rcs:
            m.timed_out, m.rc = r.timed_out, r.rc
            break
    print()
    m.runs = [asdict(r) for r in runs]
    walls = [r.wall_s for r in runs]
    m.wall_best_s, m.wall_median_s = min(walls), statistics.median(walls)
    m.peak_rss_mb = max(r.peak_rss_mb for r in runs)
    m.cpu_median_s = statistics.median(r.cpu_s for r in runs)
    return m


# ----------------------------------------------------------------------------------------------------------------
# Registry, context, targets
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    value: float | None
    op: str  # "<=", ">=", "<", ">", "=="
    limit: float
    unit: str = ""
    detail: str = ""

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return {
            "<=": self.value <= self.limit,
            ">=": self.value >= self.limit,
            "<": self.value < self.limit,
            ">": self.value > self.limit,
            "==": self.value == self.limit,
        }[self.op]


@dataclass
class BenchResult:
    measurements: list[Measurement] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def synthetic(python: str, size: str, keys: int, files: int, **extra: str) -> Path:
    """A cached synthetic checkpoint in bench/data (made by make_synthetic.py when missing or made with other
    options); every benchmark script shares this cache."""
    name = f"synth_{size}_{keys}k_{files}f".replace(".", "p")
    for k, v in sorted(extra.items()):
        name += f"_{k}-{v}"
    out = DATA / name
    want = {"total_bytes": parse_size(size), "keys": keys, "files": files}
    info_path = out / "synthetic.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("requested") == want and all(str(info.get(k)) == str(v) for k, v in extra.items()):
            return out
    cmd = [
        python,
        str(BENCH / "make_synthetic.py"),
        "--out",
        str(out),
        "--total-bytes",
        size,
        "--keys",
        str(keys),
        "--files",
        str(files),
    ]
    for k, v in extra.items():
        cmd += [f"--{k}", str(v)]
    print(f"  generating {out.name}: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    print(f"  generated in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


class Context:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.python = opts.python
        self.ckptdoctor = opts.ckptdoctor

    def synthetic(self, size: str, keys: int, files: int, **extra: str) -> Path:
        return synthetic(self.python, size, keys, files, **extra)

    def measure(
        self,
        benchmark: str,
        label: str,
        cmd: list[str],
        size: str | None = None,
        repeats: int | None = None,
        timeout: float | None = None,
        **kw,
    ) -> Measurement:
        if cmd and cmd[0] == self.ckptdoctor:
            kw.setdefault("ok_rcs", (0, 1))  # exit 1 = the command reported findings, still a full run
        return measure(
            benchmark,
            label,
            cmd,
            self.opts.repeats if repeats is None else repeats,
            self.opts.timeout if timeout is None else timeout,
            size=size,
            **kw,
        )


BENCHMARKS: dict[str, tuple[Callable[[Context], BenchResult], str]] = {}


def benchmark(name: str, help: str = "") -> Callable:
    def register(fn: Callable[[Context], BenchResult]) -> Callable[[Context], BenchResult]:
        BENCHMARKS[name] = (fn, help or (fn.__doc__ or "").strip().splitlines()[0])
        return fn

    return register


# ----------------------------------------------------------------------------------------------------------------
# Benchmarks
# ----------------------------------------------------------------------------------------------------------------

# The usual workaround without ckptdoctor: convert the DCP checkpoint to one torch.save file, then load it.
WORKAROUND = (
    "import sys, torch\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
    "sd = torch.load(sys.argv[2], weights_only=False)\n"
    "print(len(sd), 'items')\n"
)

# Runs the ckptdoctor CLI in-process, then reports whether torch (or numpy) got imported.
IMPORT_PROBE = (
    "import sys\n"
    "try:\n"
    "    from ckptdoctor.cli import main\n"
    "    rc = main(sys.argv[1:])\n"
    "finally:\n"
    "    heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
    "    print('HEAVY_MODULES=' + ','.join(heavy), file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def inspect_json_check(expect_keys: int, expect_files: int) -> Callable[[Path], str]:
    def check(stdout: Path) -> str:
        try:
            report = json.loads(stdout.read_text())
        except ValueError as exc:
            return f"not JSON ({exc})"
        keys = sum(s["keys"] for s in report["sections"].values())
        if keys != expect_keys:
            return f"{keys} keys, expected {expect_keys}"
        if report["data_files"]["count"] != expect_files:
            return f"{report['data_files']['count']} data files, expected {expect_files}"
        return ""

    return check


def _median(m: Measurement | None) -> float | None:
    return None if m is None or not m.ok else m.wall_median_s


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


@benchmark("inspect", "ckptdoctor inspect vs dcp_to_torch_save+torch.load, scaling with checkpoint bytes")
def bench_inspect(ctx: Context) -> BenchResult:
    """ckptdoctor inspect at each --sizes (same keys/files) vs the convert-and-load workaround at the largest."""
    o = ctx.opts
    res = BenchResult()
    sizes = o.sizes
    by_size: dict[str, Measurement] = {}
    dirs = {}
    for size in sizes:
        ckpt = ctx.synthetic(size, o.keys, o.files)
        dirs[size] = ckpt
        info = json.loads((ckpt / "synthetic.json").read_text())
        m = ctx.measure(
            "inspect",
            "ckptdoctor inspect --format json",
            [ctx.ckptdoctor, "inspect", str(ckpt), "--format", "json"],
            size=size,
            check=inspect_json_check(info["keys"], info["files"]),
            note=f"{info['keys']} keys, {info['files']} files, "
            f"{info['data_bytes'] / 2**30:.2f} GiB data, .metadata "
            f"{info['metadata_bytes'] / 2**20:.1f} MiB",
        )
        res.measurements.append(m)
        by_size[size] = m

    small, large = sizes[0], sizes[-1]
    # torch must not be imported by inspect: run the CLI in-process and list heavy modules at exit.
    probe_dir = dirs[small]
    probe_out = RESULTS / "stdout" / "inspect-import-probe.out"
    probe = run_once(
        [ctx.python, "-c", IMPORT_PROBE, "inspect", str(probe_dir), "--format", "json"], o.timeout, probe_out
    )
    heavy = None
    if not probe.timed_out:
        lines = [
            ln for ln in probe_out.with_suffix(".stderr").read_text().splitlines() if ln.startswith("HEAVY_MODULES=")
        ]
        heavy = lines[-1].split("=", 1)[1] if lines else None
    if heavy is None:  # the probe did not finish: check imports on a small checkpoint instead
        probe_dir = ctx.synthetic("16M", 1000, 100)
        probe = run_once(
            [ctx.python, "-c", IMPORT_PROBE, "inspect", str(probe_dir), "--format", "json"], o.timeout, probe_out
        )
        lines = [
            ln for ln in probe_out.with_suffix(".stderr").read_text().splitlines() if ln.startswith("HEAVY_MODULES=")
        ]
        heavy = lines[-1].split("=", 1)[1] if lines else "?"
        res.notes.append(f"import probe on {small} did not finish (timeout); probed {probe_dir.name} instead")
    res.notes.append(f"modules from torch/numpy imported by `ckptdoctor inspect` ({probe_dir.name}): {heavy or 'none'}")

    # the usual workaround, at the largest size
    tmp = DATA / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    tmp_pt = tmp / "workaround.pt"
    iter_dir = next(dirs[large].glob("iter_*"))
    wa = None
    if not o.skip_workaround:
        wa = ctx.measure(
            "inspect",
            "workaround: dcp_to_torch_save + torch.load",
            [ctx.python, "-c", WORKAROUND, str(iter_dir), str(tmp_pt)],
            size=large,
            repeats=o.workaround_repeats,
            timeout=max(o.timeout, 1800),
            cleanup=lambda: tmp_pt.unlink(missing_ok=True),
        )
        res.measurements.append(wa)

    big = by_size[large]
    t_small, t_large = _median(by_size[small]), _median(big)
    if len(sizes) > 1:
        res.targets.append(
            Target(
                f"inspect wall {large}/{small} (median)",
                _ratio(t_large, t_small),
                "<=",
                1.3,
                "x",
                "inspect reads metadata, not tensor bytes",
            )
        )
    if wa is not None:
        bound = (
            ""
            if t_large is not None
            else f" (inspect timed out at {o.timeout:.0f} s: ratio < {(_median(wa) or 0) / o.timeout:.1f})"
        )
        res.targets.append(
            Target(
                f"workaround/inspect wall at {large} (median)",
                _ratio(_median(wa), t_large),
                ">=",
                50,
                "x",
                "dcp_to_torch_save + torch.load vs inspect" + bound,
            )
        )
    for size in sizes:
        m = by_size[size]
        res.targets.append(
            Target(f"inspect wall, {o.keys} keys / {o.files} files, {size} (median)", _median(m), "<", 0.5, "s", m.note)
        )
        res.targets.append(
            Target(
                f"inspect peak RSS, {o.keys} keys / {o.files} files, {size}",
                m.peak_rss_mb if m.ok else None,
                "<",
                100,
                "MB",
            )
        )
    res.targets.append(
        Target(
            "inspect imports torch/numpy (modules imported)",
            0 if heavy == "" else (len(heavy.split(",")) if heavy and heavy != "?" else None),
            "==",
            0,
            "",
            probe_dir.name,
        )
    )
    return res


@benchmark("inspect-scaling", "ckptdoctor inspect wall/RSS against key count (small tensors)")
def bench_inspect_scaling(ctx: Context) -> BenchResult:
    """How inspect's cost grows with the number of keys (bytes fixed at 32M, files = keys / 10)."""
    res = BenchResult()
    for keys in ctx.opts.scaling_keys:
        files = max(4, round(keys / 40) * 4)  # ~keys/10, a multiple of 2 files x TP 2
        ckpt = ctx.synthetic("32M", keys, files)
        info = json.loads((ckpt / "synthetic.json").read_text())
        m = ctx.measure(
            "inspect-scaling",
            f"ckptdoctor inspect --format json ({info['keys']} keys)",
            [ctx.ckptdoctor, "inspect", str(ckpt), "--format", "json"],
            size="32M",
            repeats=ctx.opts.scaling_repeats,
            check=inspect_json_check(info["keys"], info["files"]),
            note=f"{info['keys']} keys, {info['files']} files, {info['chunks']} chunks",
        )
        res.measurements.append(m)
    ok = [(int(m.note.split()[0]), m.wall_median_s) for m in res.measurements if m.ok]
    if len(ok) >= 2:
        import math

        (k0, t0), (k1, t1) = ok[0], ok[-1]
        res.notes.append(
            f"empirical exponent between {k0} and {k1} keys: {math.log(t1 / t0) / math.log(k1 / k0):.2f} (1 = linear)"
        )
    return res


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def machine_info() -> dict:
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
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
    for pkg in ("torch", "ckptdoctor"):
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            info[pkg] = None
    try:
        info["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
            or None
        )
    except OSError:
        info["git_commit"] = None
    return info


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(results: dict[str, BenchResult], meta: dict) -> str:
    m = meta["machine"]
    lines = [
        f"# ckptdoctor benchmarks ({meta['date']})",
        "",
        f"Machine: {m.get('cpus')} cores ({m.get('cpu_model', '?')}), {m.get('mem_gib')} GiB RAM; "
        f"Python {m['python']}, torch {m.get('torch')}, ckptdoctor {m.get('ckptdoctor')}.  ",
        f"Command: `{meta['command']}`  ",
        "Page cache: warm (one untimed warm-up run per command before the timed repeats).  ",
        f"System load (1-minute average) at start / end: {meta['loadavg_start']:.1f} / "
        f"{meta.get('loadavg_end', float('nan')):.1f} (the machine is shared; load > cores skews figures).",
        "",
    ]
    for name, res in results.items():
        lines += [
            f"## {name}",
            "",
            "| command | size | runs | wall best (s) | wall median (s) | CPU median (s) | peak RSS (MB) "
            "| load 1m | note |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for x in res.measurements:
            runs = "timeout" if x.timed_out else (str(len(x.runs)) if x.ok else f"rc={x.rc}")
            lines.append(
                f"| {x.label} | {x.size or ''} | {runs} | {fmt(x.wall_best_s)} | {fmt(x.wall_median_s)} "
                f"| {fmt(x.cpu_median_s)} | {fmt(x.peak_rss_mb, '.0f')} | {fmt(x.loadavg_1m, '.1f')} "
                f"| {x.note} |"
            )
        if res.targets:
            lines += ["", "| target | measured | required | met |", "|---|---|---|---|"]
            for t in res.targets:
                value = fmt(t.value, ".3f" if t.unit == "s" else ".2f" if t.unit == "x" else ".0f")
                lines.append(
                    f"| {t.name} | {value}{' ' + t.unit if t.value is not None else ''} "
                    f"| {t.op} {t.limit:g} {t.unit} | {'yes' if t.met else '**NO**'} |"
                )
        for n in res.notes:
            lines.append(f"\n- {n}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="comma-separated benchmark names (default: all)")
    p.add_argument("--list", action="store_true", help="list the registered benchmarks")
    p.add_argument("--sizes", default="0.5G,4G", help="checkpoint data sizes for inspect (default 0.5G,4G)")
    p.add_argument("--keys", type=int, default=20000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per command (after one warm-up)")
    p.add_argument("--workaround-repeats", type=int, default=2)
    p.add_argument("--skip-workaround", action="store_true")
    p.add_argument("--scaling-keys", default="1000,2000,5000", help="key counts for inspect-scaling")
    p.add_argument("--scaling-repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120, help="seconds before a ckptdoctor run is killed")
    p.add_argument("--python", default=sys.executable, help="interpreter for workarounds/probes")
    p.add_argument("--ckptdoctor", default=None, help="ckptdoctor executable (default: next to --python)")
    p.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    o = p.parse_args(argv)
    if o.list:
        for name, (_, help_) in BENCHMARKS.items():
            print(f"{name:18s} {help_}")
        return 0
    o.sizes = [s.strip() for s in o.sizes.split(",") if s.strip()]
    o.scaling_keys = [int(k) for k in o.scaling_keys.split(",") if k.strip()]
    if o.ckptdoctor is None:
        o.ckptdoctor = str(Path(o.python).parent / "ckptdoctor")
        if not Path(o.ckptdoctor).exists():
            o.ckptdoctor = shutil.which("ckptdoctor") or "ckptdoctor"
    names = list(BENCHMARKS) if o.only is None else [n.strip() for n in o.only.split(",")]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    DATA.mkdir(parents=True, exist_ok=True)
    ctx = Context(o)
    options = {k: v for k, v in vars(o).items() if k != "out"} | {"out": str(o.out)}
    meta = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/run.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(),
        "cache": "warm",
        "loadavg_start": os.getloadavg()[0],
        "options": options,
    }
    results: dict[str, BenchResult] = {}
    for name in names:
        print(f"== {name}", flush=True)
        results[name] = BENCHMARKS[name][0](ctx)
    meta["loadavg_end"] = os.getloadavg()[0]
    md = markdown(results, meta)
    print("\n" + md)
    payload = meta | {
        "benchmarks": {
            name: {
                "measurements": [asdict(x) for x in r.measurements],
                "targets": [asdict(t) | {"met": t.met} for t in r.targets],
                "notes": r.notes,
            }
            for name, r in results.items()
        }
    }
    o.out.parent.mkdir(parents=True, exist_ok=True)
    o.out.write_text(json.dumps(payload, indent=1))
    o.out.with_suffix(".md").write_text(md + "\n")
    print(f"wrote {o.out} and {o.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
