"""Benchmark ``ckptdoctor check --health`` against ``check --deep`` and ``cat`` of the same bytes (issue #38).

Inputs: ``make_synthetic.py`` checkpoints (real PyTorch DCP writes), one bf16 and one fp32, cached in
``bench/data`` (``harness.synthetic``). The commands (``cat`` of the files ``--deep`` reads, ``check`` without
``--deep``, ``check --deep``, ``check --health``, each at ``--jobs 1``) are one alternating group per dtype
(``harness.alternate``: each its own child process, one warm-up round, the order rotating per round). Ratios
are per round, median [min-max].

Goal (issue #38): ``check --health`` time within 1.25x of ``check --deep`` on the same checkpoint.

``--before TREE`` adds ``check --health`` of another source tree (a git worktree of the baseline commit) to each
group, so a change is measured before/after in the same alternating rounds.

``--cold`` evicts the checkpoint's files from the page cache before every run (``harness.evict``), so each command
reads them from the disk, as a checkpoint larger than memory is read; results go to ``health-cold.json``.
``--jobs N`` runs every check with ``--jobs N`` (results ``health[-cold]-jobsN.json``); ``--tag TAG`` appends
``-TAG`` to the results file's name (a second input size beside the first).
``--numpy`` adds ``check --health`` with the C extensions blocked (``CKPTDOCTOR_NO_EXTENSIONS=1``: numpy's
statistics, as a build without a C compiler runs them); results ``health[-cold][-jobsN]-numpy.json``.

    python bench/bench_health.py                      # 0.5G, 2000 keys, 16 files -> bench/results/health.json
    python bench/bench_health.py --before /tmp/base   # and the baseline tree's --health, alternating with them
    python bench/bench_health.py --cold --size 1G     # each run from the disk -> bench/results/health-cold.json
    python bench/bench_health.py --render             # the README table of the last results file
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (no torch)
from harness import RESULTS, Case, alternate, ckptdoctor, fmt_spread  # noqa: E402

DTYPES = ("bf16", "fp32")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_options(p)
    p.add_argument("--size", default="0.5G")
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--before", type=Path, default=None, help="baseline source tree: its --health joins each group")
    p.add_argument("--cold", action="store_true", help="evict the checkpoint from the page cache before every run")
    p.add_argument("--jobs", type=int, default=1, help="ckptdoctor's --jobs for every check (default 1)")
    p.add_argument(
        "--numpy", action="store_true", help="add check --health without the C extensions (CKPTDOCTOR_NO_EXTENSIONS=1)"
    )
    p.add_argument("--tag", default="", help="appended to the results file's name (health[-cold][-jobsN]-TAG.json)")
    p.add_argument("--render", action="store_true", help="print the table of bench/results/health.json")
    o = p.parse_args(argv)
    harness.use_code(o.code)
    if o.render:
        print(render(json.loads((RESULTS / ("health-cold.json" if o.cold else "health.json")).read_text())))
        return 0
    name = ("health-cold" if o.cold else "health") + (f"-jobs{o.jobs}" if o.jobs != 1 else "")
    name += ("-numpy" if o.numpy else "") + (f"-{o.tag}" if o.tag else "")
    recorder = harness.Recorder(name, argv)
    groups, ratios, inputs, data_bytes = {}, {}, {}, {}
    failures = False
    for dtype in DTYPES:
        save = harness.synthetic(o.size, o.keys, o.files, dtype=dtype)
        inputs[dtype] = harness.synthetic_info(save)
        iteration, names, data_bytes[dtype] = harness.iteration_files(save)
        check = ("check", "--isolated", "-q", "--jobs", str(o.jobs))
        evict = (lambda root=save: harness.evict(root)) if o.cold else None
        cases = {
            f"cat {dtype}": Case(harness.cat_command(iteration, names), before=evict),
            f"check {dtype}": Case(ckptdoctor(*check, str(save)), before=evict),
            f"check --deep {dtype}": Case(ckptdoctor(*check, "--deep", str(save)), before=evict),
            f"check --health {dtype}": Case(ckptdoctor(*check, "--health", str(save)), before=evict),
        }
        if o.before is not None:
            before = o.before.resolve()
            cases[f"check --health {dtype} (before)"] = Case(
                ckptdoctor(*check, "--health", str(save)), cwd=before, before=evict
            )
        if o.numpy:  # what a build without a C compiler runs: numpy's statistics
            cases[f"check --health {dtype} (numpy)"] = Case(
                ["env", "CKPTDOCTOR_NO_EXTENSIONS=1", *ckptdoctor(*check, "--health", str(save))], before=evict
            )
        group = alternate(cases, o.repeats, o.timeout)
        failures = failures or bool(group.failures)
        groups[dtype] = group.summary()
        ratios[f"--health / --deep, {dtype}"] = group.ratio(f"check --health {dtype}", f"check --deep {dtype}")
        if o.before is not None:
            ratios[f"--health / --health before, {dtype}"] = group.ratio(
                f"check --health {dtype}", f"check --health {dtype} (before)"
            )
            ratios[f"--health before / --deep, {dtype}"] = group.ratio(
                f"check --health {dtype} (before)", f"check --deep {dtype}"
            )
        if o.numpy:
            ratios[f"--health (numpy) / --deep, {dtype}"] = group.ratio(
                f"check --health {dtype} (numpy)", f"check --deep {dtype}"
            )
        ratios[f"--deep / cat, {dtype}"] = group.ratio(f"check --deep {dtype}", f"cat {dtype}")
        ratios[f"health pass / deep pass (minus non-deep check), {dtype}"] = harness.spread(
            [
                (h - n) / (d - n)
                for h, d, n in zip(
                    group.per_round(f"check --health {dtype}"),
                    group.per_round(f"check --deep {dtype}"),
                    group.per_round(f"check {dtype}"),
                )
            ]
        )
    payload = {"size": o.size, "inputs": inputs, "data_bytes": data_bytes, "groups": groups, "ratios": ratios}
    if o.cold:
        payload["cache"] = "cold: the checkpoint's files evicted from the page cache before every run"
    doc = recorder.write(payload)
    print(harness.header(json.loads(doc.read_text())) + "\n")
    print(render(json.loads(doc.read_text())))
    return 1 if failures else 0


def render(doc: dict) -> str:
    lines = [
        "| command | data | wall s, median [min–max] | CPU s (median) | peak RSS MB |",
        "|---|---|---|---|---|",
    ]
    for dtype, group in doc["groups"].items():
        gb = doc["data_bytes"][dtype] / 1e9
        for label, c in group["cases"].items():
            lines.append(
                f"| `{label}` | {gb:.2f} GB | {fmt_spread(c['seconds'])} | {c['cpu_s']['median']:.3f} "
                f"| {c['peak_rss_mb']:.0f} |"
            )
    lines += ["", "| ratio (wall, per round) | median [min–max] |", "|---|---|"]
    for name, r in doc["ratios"].items():
        lines.append(f"| {name} | {fmt_spread(r, spec='.2f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
