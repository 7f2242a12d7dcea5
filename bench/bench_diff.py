"""Benchmark ``ckptdoctor diff`` on synthetic checkpoints written by real PyTorch DCP, everything in one run.

Inputs (``make_synthetic.py``, cached in ``bench/data`` under the names ``run.py`` uses): per size, A = TP=2 and
B = the same model at TP=4 (20,000 keys, 2,000 files), and for ``--values`` a byte copy of the largest A
(``diffcopy_<size>``: the common "is this copy / resumed save the same" case, every value read and compared).

Measured, each command in its own child process (wall time spawn -> exit, peak RSS of that child via ``wait4``;
see ``run.py``), with repeats interleaved across sizes so that load from other work hits all sizes alike:

1. structural diff (``diff A B --format json``) at each size: the largest over the smallest size (<= 1.3);
2. the usual workaround at the largest size: ``dcp_to_torch_save`` both, ``torch.load`` both, compare the dicts
   (keys, then ``torch.equal`` per common tensor) - over the structural diff (>= 50x);
3. ``diff A copy --values``: bytes of both checkpoints / wall, over ``cat A/* copy/* > /dev/null`` in the
   same run, page cache warm for both (>= 60%); its peak RSS against 3x the largest chunk + 300 MB;
4. ``diff A B --values`` (TP=2 vs TP=4): the decode path (torch, cross-layout boxes, numeric compare of the
   TP-split tensors, whose synthetic values differ); wall, throughput and peak RSS.

    python bench/bench_diff.py                     # 0.5G and 4G
    python bench/bench_diff.py --sizes 16M,64M --repeats 1 --skip-workaround   # a quick smoke run

Prints a Markdown table and writes ``bench/results/diff.json``. ``--cleanup`` deletes what it generated.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from run import DATA, REPO, RESULTS, machine_info, run_once, synthetic  # noqa: E402  (no torch)

KEYS, FILES = 20000, 2000
WORKAROUND = r"""
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
a_dir, b_dir, a_pt, b_pt = sys.argv[1:5]
dcp_to_torch_save(a_dir, a_pt)
dcp_to_torch_save(b_dir, b_pt)
a = torch.load(a_pt, weights_only=False)
b = torch.load(b_pt, weights_only=False)
only = len(a.keys() ^ b.keys())
differ = 0
for k in a.keys() & b.keys():
    x, y = a[k], b[k]
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        differ += not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))
    else:
        differ += not (type(x) is type(y))
print(only, "keys on one side,", differ, "differ")
"""


def data_bytes(save_dir: Path) -> tuple[int, list[str]]:
    iteration_dir = next(save_dir.glob("iter_*"))
    files = sorted(str(p) for p in iteration_dir.iterdir() if p.is_file())
    return sum(os.path.getsize(f) for f in files), files


def largest_chunk(*save_dirs: Path) -> int:
    sys.path.insert(0, str(REPO))
    from ckptdoctor.checkpoint import open_checkpoint

    return max(
        c.storage.length
        for d in save_dirs
        for e in open_checkpoint(d).entries.values()
        for c in e.chunks
        if c.storage is not None
    )


def timed(cmd: list[str], timeout: float = 3600, expect: tuple[int, ...] = (0, 1)) -> dict:
    run = run_once(cmd, timeout)
    if run.timed_out or run.rc not in expect:
        raise SystemExit(f"failed (rc={run.rc}, timed out={run.timed_out}): {' '.join(cmd)}")
    return {"wall_s": round(run.wall_s, 3), "peak_rss_mb": round(run.peak_rss_mb, 1), "rc": run.rc}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.5G,4G")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--python", default=str(REPO / ".venv/bin/python"))
    p.add_argument("--skip-workaround", action="store_true")
    p.add_argument("--cleanup", action="store_true", help="delete the inputs this benchmark generated")
    opts = p.parse_args(argv)
    sizes = opts.sizes.split(",")
    big = sizes[-1]
    cli = [opts.python, "-m", "ckptdoctor", "diff"]
    pairs = {s: (synthetic(opts.python, s, KEYS, FILES), synthetic(opts.python, s, KEYS, FILES, tp="4")) for s in sizes}
    copy = DATA / f"diffcopy_{big}".replace(".", "p")
    if not copy.exists():
        print(f"copying {pairs[big][0].name} -> {copy.name} ...", flush=True)
        shutil.copytree(pairs[big][0], copy)
    results: dict = {"meta": machine_info(), "sizes": sizes, "inputs": {}}
    for s, (a, b) in pairs.items():
        results["inputs"][s] = {
            "a": str(a.relative_to(REPO)),
            "b": str(b.relative_to(REPO)),
            "a_bytes": data_bytes(a)[0],
            "b_bytes": data_bytes(b)[0],
        }

    # 1. structural diff, repeats interleaved across sizes (one warm-up each first)
    structural: dict[str, list[dict]] = {s: [] for s in sizes}
    for a, b in pairs.values():
        timed(cli + [str(a), str(b), "--format", "json", "--limit", "20"])
    for _ in range(opts.repeats):
        for s, (a, b) in pairs.items():
            structural[s].append(timed(cli + [str(a), str(b), "--format", "json", "--limit", "20"]))
            print(f"structural {s}: {structural[s][-1]}", flush=True)
    med = {s: statistics.median(r["wall_s"] for r in runs) for s, runs in structural.items()}
    results["structural"] = {"runs": structural, "median_s": med, "ratio_big_over_small": med[big] / med[sizes[0]]}

    # 2. the workaround at the largest size
    if not opts.skip_workaround:
        a, b = pairs[big]
        scratch = DATA / "diff_workaround"
        scratch.mkdir(exist_ok=True)
        try:
            wa = timed(
                [
                    opts.python,
                    "-c",
                    WORKAROUND,
                    str(next(a.glob("iter_*"))),
                    str(next(b.glob("iter_*"))),
                    str(scratch / "a.pt"),
                    str(scratch / "b.pt"),
                ],
                expect=(0,),
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        results["workaround"] = wa | {"speedup_over_structural": wa["wall_s"] / med[big]}
        print(f"workaround {big}: {wa}", flush=True)

    # 3. --values vs cat, page cache warm for both checkpoints
    a = pairs[big][0]
    bytes_a, files_a = data_bytes(a)
    bytes_c, files_c = data_bytes(copy)
    cat = ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files_a, *files_c]
    values_cmd = cli + [str(a), str(copy), "--values", "--quiet", "--format", "json"]
    timed(cat)
    cats, diffs = [], []
    for _ in range(max(1, opts.repeats - 1)):
        cats.append(timed(cat, expect=(0,)))
        diffs.append(timed(values_cmd, expect=(0,)))
        print(f"values {big}: cat {cats[-1]['wall_s']} s, diff --values {diffs[-1]}", flush=True)
    total = bytes_a + bytes_c
    cat_s = statistics.median(r["wall_s"] for r in cats)
    diff_s = statistics.median(r["wall_s"] for r in diffs)
    chunk = largest_chunk(a, copy)
    rss = max(r["peak_rss_mb"] for r in diffs)
    bound = (3 * chunk) / 2**20 + 300
    results["values"] = {
        "bytes": total,
        "cat_runs": cats,
        "diff_runs": diffs,
        "cat_median_s": cat_s,
        "diff_median_s": diff_s,
        "cat_gb_s": total / cat_s / 1e9,
        "diff_gb_s": total / diff_s / 1e9,
        "throughput_ratio": cat_s / diff_s,
        "largest_chunk_bytes": chunk,
        "peak_rss_mb": rss,
        "rss_bound_mb": bound,
    }
    # 4. the decode path: A vs the TP=4 save (cross-layout boxes; TP-split values differ, so every such chunk is
    #    decoded and compared numerically). Reported, no target of its own beyond the RSS bound.
    b4 = pairs[big][1]
    cross = timed(cli + [str(a), str(b4), "--values", "--quiet", "--format", "json"])
    cross_bytes = bytes_a + data_bytes(b4)[0]
    cross_chunk = largest_chunk(a, b4)
    results["values_cross_layout"] = cross | {
        "bytes": cross_bytes,
        "gb_s": cross_bytes / cross["wall_s"] / 1e9,
        "largest_chunk_bytes": cross_chunk,
        "rss_bound_mb": 3 * cross_chunk / 2**20 + 300,
    }
    print(f"values {big} TP=2 vs TP=4: {cross}", flush=True)
    s, v = results["structural"], results["values"]
    rows = [
        ("structural diff, median wall", " / ".join(f"{x}: {med[x]:.2f} s" for x in sizes), ""),
        (f"structural {big} / {sizes[0]}", f"{s['ratio_big_over_small']:.2f}", "<= 1.3"),
    ]
    if "workaround" in results:
        rows.append(
            (
                f"workaround at {big} / structural diff",
                f"{results['workaround']['wall_s']:.1f} s / "
                f"{med[big]:.2f} s = {results['workaround']['speedup_over_structural']:.0f}x",
                ">= 50x",
            )
        )
    rows += [
        (
            f"--values throughput at {big} (both checkpoints)",
            f"{v['diff_gb_s']:.2f} GB/s vs cat {v['cat_gb_s']:.2f} GB/s = {v['throughput_ratio']:.0%}",
            ">= 60%",
        ),
        (
            "--values peak RSS",
            f"{rss:.0f} MiB (largest chunk {chunk / 2**20:.2f} MiB, bound {bound:.0f} MiB)",
            "<= 3x chunk + 300 MB",
        ),
    ]
    c = results["values_cross_layout"]
    rows += [
        (
            f"--values TP=2 vs TP=4 at {big} (decode path)",
            f"{c['wall_s']:.2f} s, {c['gb_s']:.2f} GB/s, peak RSS {c['peak_rss_mb']:.0f} MiB "
            f"(bound {c['rss_bound_mb']:.0f} MiB)",
            "<= 3x chunk + 300 MB",
        ),
    ]
    table = "| measure | result | target |\n|---|---|---|\n" + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)
    results["markdown"] = table
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "diff.json").write_text(json.dumps(results, indent=1) + "\n")
    if opts.cleanup:
        shutil.rmtree(copy, ignore_errors=True)
        for s in sizes:
            shutil.rmtree(pairs[s][1], ignore_errors=True)
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"bench_diff: {time.perf_counter() - t0:.0f} s")
    sys.exit(rc)
