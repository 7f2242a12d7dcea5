"""Benchmark ``ckptdoctor check`` on synthetic checkpoints of 2,000 data files and 20,000 keys, in one run.

Inputs: ``make_synthetic.py`` checkpoints (real PyTorch DCP writes), cached in ``bench/data/synth_<size>_...``
(``harness.synthetic``, shared with ``run.py``). The six commands (``check``, ``cat`` of the files ``--deep``
reads, ``check --deep``, at both sizes) are one alternating group (``harness.alternate``: each its own child
process, wall spawn -> exit, CPU, the child's own peak RSS; one warm-up round, the order rotating per round);
ratios are per round, median [min-max].

Targets (issue 6):
- non-deep ``check`` of the 4 GB checkpoint <= 1 s for the whole process, and no torch import;
- time independent of data size: check(4 GB) / check(0.5 GB) <= 1.3;
- ``--deep`` throughput >= 60 % of ``cat`` of the same files (data files and .metadata) to /dev/null.

    python bench/bench_check.py                 # 0.5G and 4G -> bench/results/check.json
    python bench/bench_check.py --render        # the README table of the last results file
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (no torch)
from harness import PYTHON, RESULTS, Case, alternate, ckptdoctor, fmt_spread  # noqa: E402

PROBE = """
import sys
from ckptdoctor.cli import main
rc = main(['check', '--isolated', '-q', sys.argv[1]])
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy'))
print('HEAVY:' + ','.join(heavy))
sys.exit(rc)
"""


def probe(save: Path) -> dict:
    """Untimed: the non-deep check in-process, and the heavy modules it imported (none expected)."""
    r = subprocess.run([PYTHON, "-c", PROBE, str(save)], capture_output=True, text=True, cwd=harness.CODE)
    heavy = r.stdout.strip().rsplit("HEAVY:", 1)[-1]
    return {"rc": r.returncode, "heavy_modules": heavy.split(",") if heavy else []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_options(p)
    p.add_argument("--sizes", default="0.5G,4G", help="small,large data sizes (default 0.5G,4G)")
    p.add_argument("--keys", type=int, default=20000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--render", action="store_true", help="print the table of bench/results/check.json")
    o = p.parse_args(argv)
    harness.use_code(o.code)
    if o.render:
        print(render(json.loads((RESULTS / "check.json").read_text())))
        return 0
    recorder = harness.Recorder("check", argv)
    small, large = [s.strip() for s in o.sizes.split(",")]
    saves = {size: harness.synthetic(size, o.keys, o.files) for size in (small, large)}
    probes = {size: probe(save) for size, save in saves.items()}
    cases: dict[str, Case] = {}
    data_bytes: dict[str, int] = {}
    for size, save in saves.items():
        iteration, names, data_bytes[size] = harness.iteration_files(save)
        cases[f"check {size}"] = Case(ckptdoctor("check", "--isolated", "-q", str(save)))
        cases[f"cat {size}"] = Case(harness.cat_command(iteration, names))
        cases[f"check --deep {size}"] = Case(ckptdoctor("check", "--isolated", "-q", "--deep", str(save)))
    group = alternate(cases, o.repeats, o.timeout)
    ratios = {
        f"check {large} / check {small}": group.ratio(f"check {large}", f"check {small}"),
        **{
            f"--deep throughput / cat throughput, {size}": group.ratio(f"cat {size}", f"check --deep {size}")
            for size in saves
        },
        **{
            f"deep pass alone (deep - non-deep) throughput / cat, {size}": harness.spread(
                [
                    c / (d - n)
                    for c, d, n in zip(
                        group.per_round(f"cat {size}"),
                        group.per_round(f"check --deep {size}"),
                        group.per_round(f"check {size}"),
                    )
                ]
            )
            for size in saves
        },
    }
    doc = recorder.write(
        {
            "sizes": [small, large],
            "inputs": {size: harness.synthetic_info(save) for size, save in saves.items()},
            "data_bytes": data_bytes,
            "probes": probes,
            "group": group.summary(),
            "ratios": ratios,
        }
    )
    print(harness.header(json.loads(doc.read_text())) + "\n")
    print(render(json.loads(doc.read_text())))
    return 0 if not group.failures else 1


def render(doc: dict) -> str:
    cases, ratios = doc["group"]["cases"], doc["ratios"]
    small, large = doc["sizes"]
    lines = [
        "| command | data | wall s, median [min–max] | CPU s (median) | GB/s (median wall) | peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    for label, c in cases.items():
        size = label.rsplit(" ", 1)[1]
        gb = doc["data_bytes"][size] / 1e9
        rate = f"{gb / c['seconds']['median']:.2f}" if not label.startswith("check ") or "--deep" in label else "-"
        lines.append(
            f"| `{label}` | {gb:.2f} GB | {fmt_spread(c['seconds'])} | {c['cpu_s']['median']:.3f} | {rate} "
            f"| {c['peak_rss_mb']:.0f} |"
        )
    heavy = sorted({m for pr in doc["probes"].values() for m in pr["heavy_modules"]})
    check_large = cases[f"check {large}"]["seconds"]
    lines += [
        "",
        "| target (issue 6) | measured (per round, median [min–max]) | required | met |",
        "|---|---|---|---|",
        f"| non-deep check, {large}, whole process | {fmt_spread(check_large, unit='s')} | <= 1 s | "
        f"{'yes' if check_large['median'] <= 1 else '**no**'} |",
    ]
    for name, limit, op in (
        (f"check {large} / check {small}", 1.3, "<="),
        (f"--deep throughput / cat throughput, {large}", 0.6, ">="),
    ):
        r = ratios[name]
        met = r["median"] <= limit if op == "<=" else r["median"] >= limit
        if name.startswith("check "):  # CPU time: less inflated by other load than wall
            cpu = harness.summary_ratio(cases, f"check {large}", f"check {small}")
            r_text = f"{fmt_spread(r, '.2f')} x (CPU: {fmt_spread(cpu, '.2f')} x)"
        else:
            cpu = harness.summary_ratio(cases, f"cat {large}", f"check --deep {large}")
            r_text = f"{fmt_spread(r, '.2f')} x (CPU: {fmt_spread(cpu, '.2f')} x)"
        lines.append(f"| {name} | {r_text} | {op} {limit} x | {'yes' if met else '**no**'} |")
    lines.append(
        f"| torch / megatron / numpy imported by non-deep check | {', '.join(heavy) or 'none'} | none | "
        f"{'yes' if not heavy else '**no**'} |"
    )
    lines += ["", "Informational:", ""]
    for name, r in ratios.items():
        if name.startswith("deep pass") or name.endswith(f", {small}"):
            lines.append(f"- {name}: {fmt_spread(r, '.2f')} x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
