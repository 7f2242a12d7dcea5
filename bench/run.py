"""Inspect against PyTorch's own metadata read, and the scale table; every figure from alternating runs.

    python bench/run.py --only inspect --sizes 0.5G,4G      # -> bench/results/inspect.json
    python bench/run.py --only scale --before TREE          # -> bench/results/scale.json
    python bench/run.py --render inspect                    # print the README table of a results file
    python bench/run.py --list

**inspect** (per ``--sizes``, 20,000 keys / 2,000 files): ``ckptdoctor inspect --format json`` as a whole
process and in-process (the call alone, after its imports), next to the fair baseline, PyTorch's own
``FileSystemReader(path).read_metadata()``, also as a whole process (``import torch.distributed.checkpoint``
included) and in-process, ``cat`` of ``.metadata`` and the ``python -c "import click, tabulate"`` floor; all in
one alternating group (``harness.alternate``), ratios per round. Separately, at the largest size, the old
anchor under its real name: converting and loading all the data (``dcp_to_torch_save`` + ``torch.load``).

**scale** (``SCALE_POINTS``): ``inspect``, ``check``, ``diff A A`` and ``fix-args --write`` (``--scale-commands``
also ``strip-frozen --force`` and ``edit --remove '^optimizer\\.'``, the rewrites) whole-process wall
and peak RSS at 2k/20k/100k/200k keys (200 files), 200/2,000/20,000 files (20k keys), 0.06/0.5/2/8 GB of data,
TP1/8/64 chunk grids and 1M chunks (42k keys x TP16), each command one alternating group with the floor
``python -c "import click, tabulate"`` and, with ``--before TREE``, the same cases run from another source tree
(ratios after / before per round); growth exponents per round, raw and with that round's floor subtracted;
peak RSS per chunk beyond the floor.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (no torch: the measured children start small)
from harness import DATA, FLOOR, PYTHON, RESULTS, Case, alternate, ckptdoctor, fmt_spread  # noqa: E402

# The fair baseline: PyTorch's own metadata read (whole process: its imports are part of what it costs).
READ_METADATA = (
    "import sys\n"
    "from torch.distributed.checkpoint import FileSystemReader\n"
    "md = FileSystemReader(sys.argv[1]).read_metadata()\n"
    "print(len(md.state_dict_metadata), 'keys')\n"
)
# The same call in-process: imports first, then the call alone is timed.
READ_METADATA_CALL = (
    "import sys, time\n"
    "from torch.distributed.checkpoint import FileSystemReader\n"
    "t0 = time.perf_counter()\n"
    "md = FileSystemReader(sys.argv[1]).read_metadata()\n"
    "print('BENCH_SECONDS=%r' % (time.perf_counter() - t0))\n"
)
# ckptdoctor inspect in-process: the CLI's imports first, then main() alone is timed (output to /dev/null).
INSPECT_CALL = (
    "import contextlib, os, sys, time\n"
    "from ckptdoctor.cli import main\n"
    "import ckptdoctor.commands.inspect\n"
    "with open(os.devnull, 'w') as null, contextlib.redirect_stdout(null):\n"
    "    t0 = time.perf_counter()\n"
    "    rc = main(['inspect', sys.argv[1], '--format', 'json'])\n"
    "    seconds = time.perf_counter() - t0\n"
    "print('BENCH_SECONDS=%r' % seconds)\n"
    "sys.exit(rc)\n"
)
# Not a metadata read: converts every tensor to one torch.save file, then loads it all.
CONVERT_AND_LOAD = (
    "import sys, torch\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
    "sd = torch.load(sys.argv[2], weights_only=False)\n"
    "print(len(sd), 'items')\n"
)
# Runs the CLI in-process, then lists the torch / numpy modules it imported.
IMPORT_PROBE = (
    "import sys\n"
    "from ckptdoctor.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'megatron'))\n"
    "print('HEAVY_MODULES=' + ','.join(heavy), file=sys.stderr)\n"
)


def inspect_check(stdout: Path, info: dict) -> str:
    """'' when the warm-up run's JSON has the synthetic's tensor key and file counts."""
    try:
        report = json.loads(stdout.read_text())
    except ValueError as exc:
        return f"not JSON ({exc})"
    # tensor keys only: the sharded rng_state objects count as one key per object, not one per shard
    keys = sum(report["sections"][s]["keys"] for s in ("model", "optimizer"))
    if keys != info["tensor_keys"] or report["data_files"]["count"] != info["files"]:
        got = f"{keys} tensor keys / {report['data_files']['count']} files"
        return f"{got}, expected {info['tensor_keys']} / {info['files']}"
    return ""


def heavy_modules(save: Path) -> list[str]:
    out = RESULTS / "stdout" / "import-probe.out"
    harness.run_once([PYTHON, "-c", IMPORT_PROBE, "inspect", str(save), "--format", "json"], 300, out)
    lines = [x for x in out.with_suffix(".stderr").read_text().splitlines() if x.startswith("HEAVY_MODULES=")]
    return lines[-1].split("=", 1)[1].split(",") if lines and lines[-1] != "HEAVY_MODULES=" else []


def bench_inspect(o: argparse.Namespace) -> dict:
    cases: dict[str, Case] = {"floor": Case(FLOOR)}
    saves = {size: harness.synthetic(size, o.keys, o.files) for size in o.sizes}
    for size, save in saves.items():
        iteration, _, _ = harness.iteration_files(save)
        stdout = RESULTS / "stdout" / f"inspect-{size}.json"
        cases[f"inspect {size}"] = Case(ckptdoctor("inspect", str(save), "--format", "json"), stdout_path=stdout)
        cases[f"read_metadata {size}"] = Case([PYTHON, "-c", READ_METADATA, str(iteration)])
        cases[f"inspect call {size}"] = Case([PYTHON, "-c", INSPECT_CALL, str(save)], metric="reported")
        cases[f"read_metadata call {size}"] = Case([PYTHON, "-c", READ_METADATA_CALL, str(iteration)], "reported")
        cases[f"cat .metadata {size}"] = Case(["cat", str(iteration / ".metadata")])
    group = alternate(cases, o.repeats, o.timeout)
    problems = {}
    for size, save in saves.items():
        stdout = cases[f"inspect {size}"].stdout_path
        problems[size] = inspect_check(stdout, harness.synthetic_info(save)) if stdout else "no output"
    ratios = {}
    for size in o.sizes:
        ratios[size] = {
            "inspect / read_metadata, whole processes": group.ratio(f"inspect {size}", f"read_metadata {size}"),
            "inspect / read_metadata, in-process calls": group.ratio(
                f"inspect call {size}", f"read_metadata call {size}"
            ),
            "inspect / cat .metadata": group.ratio(f"inspect {size}", f"cat .metadata {size}"),
        }
    small, large = o.sizes[0], o.sizes[-1]
    result: dict = {
        "inputs": {size: harness.synthetic_info(save) for size, save in saves.items()},
        "group": group.summary(),
        "ratios": ratios,
        "output_check": problems,
        "heavy_modules_imported_by_inspect": heavy_modules(saves[small]),
    }
    if len(o.sizes) > 1:
        result["size_ratio"] = group.ratio(f"inspect {large}", f"inspect {small}")
    if not o.skip_convert:
        iteration, _, _ = harness.iteration_files(saves[large])
        tmp_pt = DATA / "tmp" / "convert_and_load.pt"
        tmp_pt.parent.mkdir(parents=True, exist_ok=True)
        convert = alternate(
            {
                f"inspect {large}": Case(ckptdoctor("inspect", str(saves[large]), "--format", "json")),
                "convert and load all data": Case(
                    [PYTHON, "-c", CONVERT_AND_LOAD, str(iteration), str(tmp_pt)],
                    before=lambda: tmp_pt.unlink(missing_ok=True),
                ),
            },
            o.convert_repeats,
            max(o.timeout, 1800),
            warm_up=False,
        )
        tmp_pt.unlink(missing_ok=True)
        result["convert_and_load"] = convert.summary() | {
            "size": large,
            "ratio": convert.ratio("convert and load all data", f"inspect {large}"),
        }
    return result


def render_inspect(doc: dict) -> str:
    cases = doc["group"]["cases"]
    sizes = list(doc["inputs"])
    lines = [
        "| command | " + " | ".join(f"{s}: wall s, median [min–max] | CPU s | peak RSS MB" for s in sizes) + " |",
        "|---|" + "---|---|---|" * len(sizes),
    ]
    rows = [
        ("`ckptdoctor inspect --format json` (whole process)", "inspect"),
        ("PyTorch `FileSystemReader(p).read_metadata()` (whole process, imports included)", "read_metadata"),
        ("`ckptdoctor` inspect, in-process call after imports", "inspect call"),
        ("PyTorch `read_metadata()`, in-process call after imports", "read_metadata call"),
        ("`cat .metadata` (to /dev/null)", "cat .metadata"),
    ]
    for title, key in rows:
        cells = []
        for size in sizes:
            c = cases.get(f"{key} {size}")
            whole = c is not None and c["metric"] != "reported"  # in-process: the call alone, no CPU/RSS of it
            rss = f"{c['peak_rss_mb']:.0f}" if whole else "-"
            cpu = f"{c['cpu_s']['median']:.2f}" if whole else "-"
            cells.append(f"{fmt_spread(c and c['seconds'])} | {cpu} | {rss}")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    floor = cases["floor"]
    lines.append(
        f'| floor `python -c "import click, tabulate"` | {fmt_spread(floor["seconds"])} | '
        f"{floor['cpu_s']['median']:.2f} | {floor['peak_rss_mb']:.0f} |" + " | | |" * (len(sizes) - 1)
    )
    lines += ["", "| ratio (per round, median [min–max]) | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    for name in doc["ratios"][sizes[0]]:
        lines.append(f"| {name} | " + " | ".join(fmt_spread(doc["ratios"][s][name], ".2f") for s in sizes) + " |")
    cpu = [harness.summary_ratio(cases, f"inspect {s}", f"read_metadata {s}") for s in sizes]
    lines.append(
        "| inspect / read_metadata, whole processes, CPU time | " + " | ".join(fmt_spread(c, ".2f") for c in cpu) + " |"
    )
    if "size_ratio" in doc:
        cpu = harness.summary_ratio(cases, f"inspect {sizes[-1]}", f"inspect {sizes[0]}")
        lines.append(
            f"| inspect {sizes[-1]} / {sizes[0]} (whole processes): wall; CPU | "
            f"{fmt_spread(doc['size_ratio'], '.2f')}; {fmt_spread(cpu, '.2f')} |" + " |" * (len(sizes) - 1)
        )
    ca = doc.get("convert_and_load")
    if ca and ca["cases"]["convert and load all data"].get("seconds"):  # absent with --convert-repeats 0
        c = ca["cases"]["convert and load all data"]
        lines += [
            "",
            f"Not a metadata read: converting and loading all data (`dcp_to_torch_save` + `torch.load`) at "
            f"{ca['size']}: {fmt_spread(c['seconds'], '.1f')} s, peak RSS {c['peak_rss_mb']:.0f} MB, "
            f"{fmt_spread(ca['ratio'], '.0f')} x inspect (alternating, {len(c['runs'])} rounds).",
        ]
    heavy = doc["heavy_modules_imported_by_inspect"]
    lines.append(f"\nModules of torch/numpy/megatron imported by `inspect`: {', '.join(heavy) or 'none'}.")
    bad = {s: p for s, p in doc["output_check"].items() if p}
    if bad:
        lines.append(f"\nOutput check FAILED: {bad}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# The scale table
# ----------------------------------------------------------------------------------------------------------------


# label -> (data size, keys, files, generator options, sweep): every scale input, each made once by
# make_synthetic.py and cached in bench/data. Small tensors (--shape-tp 2) unless the TP grid needs TP=64 shapes.
_SMALL = {"shape-tp": "2"}
SCALE_POINTS: dict[str, tuple[str, int, int, dict[str, str], str]] = {
    "2k keys / 200 files": ("64M", 2000, 200, _SMALL, "keys"),
    "20k keys / 200 files": ("64M", 20000, 200, _SMALL, "keys"),
    "100k keys / 200 files": ("64M", 100000, 200, _SMALL, "keys"),
    "200k keys / 200 files": ("64M", 200000, 200, _SMALL, "keys"),
    # as megatron-core saves: every rank's local plan kept in .metadata (all_local_plans, a write item per chunk)
    "200k keys, mcore plans / 200 files": ("64M", 200000, 200, {**_SMALL, "mcore-plans": "1"}, "plans"),
    "20k keys / 2000 files": ("64M", 20000, 2000, _SMALL, "files"),
    "20k keys / 20000 files": ("64M", 20000, 20000, _SMALL, "files"),
    "20k keys / 2000 files / 0.5G": ("0.5G", 20000, 2000, {"shape-tp": "4"}, "bytes"),
    "20k keys / 2000 files / 2G": ("2G", 20000, 2000, {"shape-tp": "4"}, "bytes"),
    "20k keys / 2000 files / 8G": ("8G", 20000, 2000, {"shape-tp": "4"}, "bytes"),
    "20k keys TP1 / 256 files": ("64M", 20000, 256, {"tp": "1", "shape-tp": "64"}, "tp"),
    "20k keys TP8 / 256 files": ("64M", 20000, 256, {"tp": "8", "shape-tp": "64"}, "tp"),
    "20k keys TP64 / 256 files": ("64M", 20000, 256, {"tp": "64", "shape-tp": "64"}, "tp"),
    "42k keys TP16 (1M chunks) / 256 files": (
        "64M",
        42000,
        256,
        {"tp": "16", "shape-tp": "16", "expert-tp": "16"},
        "chunks",
    ),
}
BEFORE = " · before"  # suffix of a case run from the --before tree


def scale_points(o: argparse.Namespace) -> dict[str, tuple[str, int, int, dict[str, str], str]]:
    """The points asked for (``--scale-points``: comma-separated label prefixes; default every point)."""
    if not o.scale_points:
        return dict(SCALE_POINTS)
    wanted = [w.strip() for w in o.scale_points.split(",") if w.strip()]
    return {label: spec for label, spec in SCALE_POINTS.items() if any(label.startswith(w) for w in wanted)}


def scale_commands(save: Path, scratch: Path, tag: str) -> dict[str, tuple[list[str], Callable[[], None] | None]]:
    out = scratch / f"{save.name}{tag}"

    def clean() -> None:
        shutil.rmtree(out, ignore_errors=True)

    fix = ckptdoctor("fix-args", str(save), "--set", "seq_length=12345", "--write", "--output", str(out))
    # the rewrites: every key kept (--force: no parameter of the synthetic is frozen), or the optimizer removed
    strip = ckptdoctor("strip-frozen", str(save), "--force", "--output", str(out))
    edit = ckptdoctor("edit", str(save), "--remove", r"^optimizer\.", "--output", str(out))
    # the plan of a rewrite as a user reads it (issue #35 item 14): text (summarised by reason) and JSON (every key)
    plan = ckptdoctor("strip-frozen", str(save), "--force", "--dry-run")
    return {
        "inspect": (ckptdoctor("inspect", str(save), "--format", "json"), None),
        "check": (ckptdoctor("check", "--isolated", "-q", str(save)), None),
        "diff": (ckptdoctor("diff", str(save), str(save), "--format", "json"), None),
        "fix-args": (fix, clean),
        "strip-frozen": (strip, clean),
        "edit": (edit, clean),
        "strip-frozen-plan": (plan, None),
        "strip-frozen-plan-json": ([*plan, "--format", "json"], None),
    }


def bench_scale(o: argparse.Namespace) -> dict:
    points = scale_points(o)
    saves = {
        label: harness.synthetic(size, keys, files, **extra) for label, (size, keys, files, extra, _) in points.items()
    }
    scratch = DATA / "tmp" / "scale"
    scratch.mkdir(parents=True, exist_ok=True)
    trees = {"": None} if o.before is None else {"": None, BEFORE: o.before.resolve()}
    groups = {}
    for command in o.scale_commands:
        print(f"== scale: {command}", flush=True)
        cases = {"floor": Case(FLOOR)}
        for label, save in saves.items():
            for tag, tree in trees.items():
                cmd, before = scale_commands(save, scratch, tag.strip(" ·"))[command]
                # a clean synthetic must pass (exit 0); one with empty unreferenced .distcp files (made before
                # make_synthetic gave every writer thread an item) may get CKD115 warnings from check (exit 1)
                empty = any(f.stat().st_size == 0 for f in harness.iteration_files(save)[0].glob("*.distcp"))
                ok = (0, 1) if empty and command == "check" else (0,)
                cases[label + tag] = Case(cmd, before=before, ok_rcs=ok, cwd=tree)
        groups[command] = alternate(cases, o.scale_repeats, o.timeout)
    shutil.rmtree(scratch, ignore_errors=True)
    return {
        "scale_bytes": o.scale_bytes,
        "before": None
        if o.before is None
        else {"tree": str(o.before), "commit": harness._git("rev-parse", "--short", "HEAD", cwd=o.before)},
        "inputs": {label: harness.synthetic_info(save) | {"sweep": points[label][4]} for label, save in saves.items()},
        "groups": {c: g.summary() for c, g in groups.items()},
    }


def _walls(cases: dict, label: str) -> list[float]:
    c = cases.get(label)
    return [] if c is None or c["failure"] else [r["wall_s"] for r in c["runs"]]


def exponents(doc: dict, tag: str = "") -> dict:
    """Growth exponents per round, log(t1 / t0) / log(n1 / n0), raw and with that round's floor subtracted
    (``python -c "import click, tabulate"``, run in the same rounds), between the smallest and the largest
    point of the key and file sweeps (``tag``: the --before tree's cases)."""
    out = {}
    for command, g in doc["groups"].items():
        cases = g["cases"]
        floors = _walls(cases, "floor")
        for axis in ("keys", "files"):
            sweep = [
                x
                for x, info in doc["inputs"].items()
                if info.get("sweep") == axis or (axis == "files" and x == "20k keys / 200 files")
            ]
            sweep = [x for x in sweep if _walls(cases, x + tag)]
            sweep.sort(key=lambda x: doc["inputs"][x][axis])
            if len(sweep) < 2:
                continue
            a, b = sweep[0], sweep[-1]
            n0, n1 = (doc["inputs"][x][axis] for x in (a, b))
            raw, net = [], []
            for f, t0, t1 in zip(floors, _walls(cases, a + tag), _walls(cases, b + tag)):
                raw.append(math.log(t1 / t0) / math.log(n1 / n0))
                if t0 > f and t1 > f:  # under load a round's floor can exceed a small point's time
                    net.append(math.log((t1 - f) / (t0 - f)) / math.log(n1 / n0))
            out[f"{command} vs {axis}{tag}"] = {
                "from": a,
                "to": b,
                "raw": harness.spread(raw),
                "minus_floor": harness.spread(net) if net else None,
            }
    return out


def _cell(case: dict | None, digits: str = ".2f") -> str:
    if case is None:
        return "- | -"
    if case["failure"]:
        return f"{case['failure']} | -"
    return f"{fmt_spread(case['seconds'], digits)} | {case['peak_rss_mb']:.0f}"


def render_scale(doc: dict) -> str:
    groups = doc["groups"]
    commands = list(groups)
    has_before = doc.get("before") is not None
    lines = []
    if has_before:
        lines.append(
            f"Before: `{doc['before']['tree']}` (commit {doc['before']['commit']}); after: the measured commit.\n"
        )
    head = " | ".join(
        (f"`{c}` s | RSS MB | before s | before RSS MB" if has_before else f"`{c}` s | RSS MB") for c in commands
    )
    width = 4 if has_before else 2
    lines += [
        f"| input | keys | chunks | files | data GB | .metadata MiB | {head} |",
        "|---|---|---|---|---|---|" + "---|" * (width * len(commands)),
    ]
    for label, info in doc["inputs"].items():
        cells = []
        for c in commands:
            cases = groups[c]["cases"]
            cells.append(_cell(cases.get(label)))
            if has_before:
                cells.append(_cell(cases.get(label + BEFORE)))
        lines.append(
            f"| {label} | {info['keys']:,} | {info['chunks']:,} | {info['files']:,} | "
            f"{info['data_bytes'] / 2**30:.2f} | {info['metadata_bytes'] / 2**20:.1f} | " + " | ".join(cells) + " |"
        )
    floor = groups[commands[0]]["cases"]["floor"]
    lines.append(
        f'| floor `python -c "import click, tabulate"` | | | | | | {fmt_spread(floor["seconds"], ".2f")} | '
        f"{floor['peak_rss_mb']:.0f} |" + " |" * (width * len(commands) - 2)
    )
    if has_before:
        lines += [
            "",
            "| after / before, per round (median [min–max]) | "
            + " | ".join(f"`{c}` wall | `{c}` CPU" for c in commands)
            + " |",
        ]
        lines.append("|---|" + "---|---|" * len(commands))
        for label in doc["inputs"]:
            cells = []
            for c in commands:
                cases = groups[c]["cases"]
                a, b = _walls(cases, label), _walls(cases, label + BEFORE)
                cells.append(fmt_spread(harness.spread([x / y for x, y in zip(a, b)]), ".2f") if a and b else "-")
                cpu = harness.summary_ratio(cases, label, label + BEFORE) if a and b else None
                cells.append(fmt_spread(cpu, ".2f"))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| peak RSS per chunk beyond the floor, (RSS - floor RSS) / chunks | "
        + " | ".join((f"`{c}` | before" if has_before else f"`{c}`") for c in commands)
        + " |",
    ]
    lines.append("|---|" + "---|" * (len(commands) * (2 if has_before else 1)))
    for label, info in doc["inputs"].items():
        cells = []
        for c in commands:
            cases = groups[c]["cases"]
            floor_mb = cases["floor"]["peak_rss_mb"]
            for tag in ("", BEFORE) if has_before else ("",):
                case = cases.get(label + tag)
                ok = case is not None and not case["failure"]
                cells.append(f"{(case['peak_rss_mb'] - floor_mb) * 2**20 / info['chunks']:,.0f} B" if ok else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    sweep = sorted(
        (x for x, i in doc["inputs"].items() if i.get("sweep") == "keys"), key=lambda x: doc["inputs"][x]["chunks"]
    )
    if len(sweep) >= 2:
        a, b = sweep[0], sweep[-1]
        da = doc["inputs"][b]["chunks"] - doc["inputs"][a]["chunks"]
        cells = []
        for c in commands:
            cases = groups[c]["cases"]
            for tag in ("", BEFORE) if has_before else ("",):
                ca, cb = cases.get(a + tag), cases.get(b + tag)
                ok = ca and cb and not ca["failure"] and not cb["failure"]
                cells.append(f"{(cb['peak_rss_mb'] - ca['peak_rss_mb']) * 2**20 / da:,.0f} B" if ok else "-")
        lines.append(f"| slope {a} -> {b} | " + " | ".join(cells) + " |")
    rows = [(name, e) for tag in (("", BEFORE) if has_before else ("",)) for name, e in exponents(doc, tag).items()]
    if rows:
        lines += ["", "| growth exponent (per round, median [min–max]) | raw | floor subtracted |", "|---|---|---|"]
    for name, e in rows:
        lines.append(
            f"| {name} ({e['from']} -> {e['to']}) | {fmt_spread(e['raw'], '.2f')} | "
            f"{fmt_spread(e['minus_floor'], '.2f')} |"
        )
    return "\n".join(lines)


BENCHMARKS = {
    "inspect": (bench_inspect, render_inspect, "inspect vs PyTorch's read_metadata, cat .metadata, the floor"),
    "scale": (bench_scale, render_scale, "inspect/check/diff/fix-args wall and RSS at 2k..200k keys, 200..20k files"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_options(p)
    p.add_argument("--only", default=None, help="comma-separated benchmark names (default: all)")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.add_argument("--render", metavar="NAME", help="print the Markdown table of bench/results/NAME.json")
    p.add_argument("--sizes", default="0.5G,4G", help="inspect: checkpoint data sizes (default 0.5G,4G)")
    p.add_argument("--keys", type=int, default=20000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5, help="inspect: timed rounds (after one warm-up)")
    p.add_argument("--convert-repeats", type=int, default=2)
    p.add_argument("--skip-convert", action="store_true", help="inspect: leave out convert-and-load")
    p.add_argument("--scale-bytes", default="64M", help="scale: synthetic data size (small tensors)")
    p.add_argument(
        "--scale-points", default="", help="scale: comma-separated label prefixes of SCALE_POINTS (default: all)"
    )
    p.add_argument("--before", type=Path, default=None, help="scale: also run every case from this source tree")
    p.add_argument("--results-name", default=None, help="results file name (default: the benchmark's name)")
    p.add_argument(
        "--scale-commands",
        default="inspect,check,diff,fix-args",
        help="also: strip-frozen (--force), edit, strip-frozen-plan (--dry-run, text), strip-frozen-plan-json",
    )
    p.add_argument("--scale-repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300, help="seconds before a run is killed")
    o = p.parse_args(argv)
    harness.use_code(o.code)
    if o.list:
        for name, (_, _, help_) in BENCHMARKS.items():
            print(f"{name:10s} {help_}")
        return 0
    if o.render:
        doc = json.loads((RESULTS / f"{o.render}.json").read_text())
        print(BENCHMARKS[doc["benchmark"]][1](doc))
        return 0
    o.sizes = [s.strip() for s in o.sizes.split(",") if s.strip()]
    o.scale_commands = [c.strip() for c in o.scale_commands.split(",") if c.strip()]
    names = list(BENCHMARKS) if o.only is None else [n.strip() for n in o.only.split(",")]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}")
    for name in names:
        print(f"== {name}", flush=True)
        recorder = harness.Recorder(name, argv, "run.py")
        bench, render, _ = BENCHMARKS[name]
        payload = bench(o)
        doc = json.loads(recorder.write(payload, o.results_name).read_text())
        print(harness.header(doc) + "\n\n" + render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
