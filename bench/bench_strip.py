"""Benchmark ``ckptdoctor strip-frozen`` on synthetic full PEFT checkpoints, in one run.

Inputs: synthetic torch_dist checkpoints written by real PyTorch DCP through ``make_synthetic.py``, with its
``build_specs`` swapped for a PEFT variant: a frozen base (bf16) plus LoRA adapters on every ``linear_qkv`` and
``linear_fc1`` (``<module>.adapter.linear_in/linear_out.weight``, rank chosen so that 1% of the parameters are
trainable) and optimizer state (fp32 ``exp_avg``/``exp_avg_sq``) for the adapters only, as a PEFT run saves it.
Cached in ``bench/data/peft_<size>_<layout>``.

Measured per size, each command in its own child process (wall time spawn -> exit, peak RSS of that child via
``wait4``, one warm-up run first; see ``run.py``):

- ``ckptdoctor strip-frozen SRC -o OUT`` (trainable inferred from the optimizer);
- ``cp`` of one file as large as the kept data (what copying the kept bytes costs at least);
- the naive path: ``dcp_to_torch_save`` -> ``torch.load`` -> filter -> ``torch.save`` -> ``torch_save_to_dcp``.

    python bench/bench_strip.py                      # 1G and 4G, stacked layout (Megatron's dense GPT keys)
    python bench/bench_strip.py --sizes 1G --layout per-layer --keys 20000 --files 2000

Prints a Markdown table and writes ``bench/results/strip-frozen.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from run import DATA, REPO, RESULTS, machine_info, parse_size, run_once  # noqa: E402  (run.py: no torch)

TRAINABLE_FRACTION = 0.01
WRAPPED = ("linear_qkv.weight", "linear_fc1.weight")

NAIVE = """
import sys, torch, json
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
src, tmp, out = sys.argv[1:4]
dcp_to_torch_save(src, tmp + '/full.pt')
sd = torch.load(tmp + '/full.pt', weights_only=False)
trainable = {k.split('.', 3)[3] for k in sd if k.startswith('optimizer.state.exp_avg.')}
model = lambda k: not k.startswith(('optimizer.', 'rng_state', 'rerun_state_machine_state', 'common_state'))
kept = {k: v for k, v in sd.items() if not model(k) or (k in trainable and '_extra_state' not in k)}
del sd
torch.save(kept, tmp + '/kept.pt')
del kept
torch_save_to_dcp(tmp + '/kept.pt', out)
"""


# --- the PEFT variant of make_synthetic's model ---------------------------------------------------------------


def peft_build_specs(d, param_dtype):
    """Frozen base + LoRA adapters (1% of params) + optimizer state for the adapters only."""
    import make_synthetic as ms
    import torch

    params = ms.model_tensors(d)
    stacked = d.layout == "stacked"
    wrapped = [(k, shape) for k, shape, _ in params if k.endswith(WRAPPED)]
    per_rank = sum((shape[-1] + shape[-2]) * (shape[0] if stacked else 1) for _, shape in wrapped)
    base_numel = sum(math.prod(shape) for _, shape, _ in params)
    rank = max(1, round(TRAINABLE_FRACTION * base_numel / per_rank))
    adapters = []
    for key, shape in wrapped:
        out_f, in_f = shape[-2], shape[-1]
        prefix = key[: -len("weight")] + "adapter."
        if stacked:
            layers = shape[0]
            in_chunks = [ms.Chunk((layer, 0, 0), (1, rank, in_f), None) for layer in range(layers)]
            out_chunks = [c for layer in range(layers) for c in _tp_split((out_f, rank), d.tp, (layer,))]
            adapters += [
                (prefix + "linear_in.weight", (layers, rank, in_f), in_chunks),
                (prefix + "linear_out.weight", (layers, out_f, rank), out_chunks),
            ]
        else:
            adapters += [
                (prefix + "linear_in.weight", (rank, in_f), ms.whole((rank, in_f))),
                (prefix + "linear_out.weight", (out_f, rank), _tp_split((out_f, rank), d.tp, ())),
            ]
    tensors = [ms.TensorSpec(k, s, param_dtype, c) for k, s, c in params + adapters]
    for state in ("exp_avg", "exp_avg_sq"):
        for key, shape, chunks in adapters:
            tensors.append(
                ms.TensorSpec(
                    f"optimizer.state.{state}.{key}", shape, torch.float32, [dataclasses.replace(c) for c in chunks]
                )
            )
    objects = [ms.ObjectSpec(f"rng_state/shard_0.{t}_1.{d.tp}", "rng") for t in range(d.tp)]
    if stacked:
        objects += ms.extra_state_objects(d)
    peft_build_specs.info = {
        "lora_rank": rank,
        "adapter_keys": len(adapters),  # type: ignore[attr-defined]
        "trainable_params": sum(math.prod(s) for _, s, _ in adapters),
        "base_params": base_numel,
    }
    return tensors, objects


def _tp_split(shape: tuple[int, ...], tp: int, lead: tuple[int, ...]) -> list:
    import make_synthetic as ms

    if shape[0] % tp:
        return [ms.Chunk(lead + (0,) * len(shape), (1,) * len(lead) + shape, None)]
    chunks = ms.split(shape, 0, tp, lead)
    for c in chunks:
        c.tp_rank %= tp
    return chunks


def make_peft_checkpoint(size: str, layout: str, keys: int, files: int, layers: int | None) -> Path:
    """The cached PEFT checkpoint, generated in a child process so that this one never imports torch (a
    child forked from a parent holding torch would report the parent's pages in its peak RSS)."""
    out = DATA / f"peft_{size}_{layout}_{keys}k_{files}f".replace(".", "p")
    marker = out / "peft.json"
    want = {
        "size": size,
        "layout": layout,
        "keys": keys,
        "files": files,
        "layers": layers,
        "trainable_fraction": TRAINABLE_FRACTION,
    }
    if marker.exists() and json.loads(marker.read_text()).get("requested") == want:
        return out
    cmd = [
        sys.executable,
        __file__,
        "--generate",
        size,
        "--layout",
        layout,
        "--keys",
        str(keys),
        "--files",
        str(files),
    ] + ([] if layers is None else ["--layers", str(layers)])
    print(f"generating {out.name} ...", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"generated in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def generate(size: str, layout: str, keys: int, files: int, layers: int | None) -> None:
    import make_synthetic as ms

    out = DATA / f"peft_{size}_{layout}_{keys}k_{files}f".replace(".", "p")
    want = {
        "size": size,
        "layout": layout,
        "keys": keys,
        "files": files,
        "layers": layers,
        "trainable_fraction": TRAINABLE_FRACTION,
    }
    param_bytes = 2  # bf16
    # make_synthetic sizes param + 8 bytes of optimizer state per element; here only the base is stored at scale
    total = int(parse_size(size) * (param_bytes + 8) / param_bytes)
    ms.build_specs = peft_build_specs
    info = ms.write_checkpoint(out, total, keys, files, "bf16", 0, 2, layout, layers, os.cpu_count() or 1)
    (out / "peft.json").write_text(
        json.dumps({"requested": want, **peft_build_specs.info, "synthetic": info}, indent=1)
    )


# --- measuring --------------------------------------------------------------------------------------------


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _timed(cmd: list[str], repeats: int, timeout: float, before=None, warm_up: bool = True) -> dict:
    """One warm-up (unless told not to), then ``repeats`` runs; ``before`` (cleanup) runs before every run."""
    runs = []
    for i in range(repeats + 1) if warm_up else range(1, repeats + 1):
        if before:
            before()
        r = run_once(cmd, timeout)
        if r.rc != 0:
            raise SystemExit(f"failed (rc {r.rc}): {' '.join(cmd)}")
        if i:
            runs.append(r)
    walls = sorted(r.wall_s for r in runs)
    return {
        "wall_best_s": walls[0],
        "wall_median_s": walls[len(walls) // 2],
        "peak_rss_mb": max(r.peak_rss_mb for r in runs),
        "runs": [dataclasses.asdict(r) for r in runs],
    }


def bench_size(size: str, opts: argparse.Namespace) -> dict:
    src = make_peft_checkpoint(size, opts.layout, opts.keys, opts.files, opts.layers)
    peft = json.loads((src / "peft.json").read_text())
    scratch = DATA / "tmp" / f"strip_{size}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    out = scratch / "out"
    strip_cmd = [sys.executable, "-m", "ckptdoctor", "strip-frozen", str(src), "-o", str(out)]
    strip = _timed(strip_cmd, opts.repeats, opts.timeout, lambda: shutil.rmtree(out, ignore_errors=True))
    out_iter = next(out.glob("iter_*"))
    kept_data = sum(p.stat().st_size for p in out_iter.glob("*.distcp"))
    src_iter = next(src.glob("iter_*"))
    result = {
        "size": size,
        "source_bytes": _dir_bytes(src_iter),
        "output_bytes": _dir_bytes(out_iter),
        "kept_data_bytes": kept_data,
        "source": peft,
        "strip": strip,
    }

    blob, copy = scratch / "kept.bin", scratch / "kept.copy"
    with open(blob, "wb") as f:
        for left in range(kept_data, 0, -(8 << 20)):
            f.write(os.urandom(min(8 << 20, left)))
    result["cp"] = _timed(
        ["cp", str(blob), str(copy)], opts.repeats, opts.timeout, lambda: copy.unlink(missing_ok=True)
    )
    blob.unlink()
    copy.unlink(missing_ok=True)

    if not opts.skip_naive:
        naive_out = scratch / "naive"

        def clean() -> None:
            shutil.rmtree(naive_out, ignore_errors=True)
            for name in ("full.pt", "kept.pt"):
                (scratch / name).unlink(missing_ok=True)

        result["naive"] = _timed(
            [sys.executable, "-c", NAIVE, str(src_iter), str(scratch), str(naive_out)],
            opts.naive_repeats,
            3600,
            clean,
            warm_up=False,
        )
        clean()
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def targets(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        s, c = r["strip"]["wall_median_s"], r["cp"]["wall_median_s"]
        rows.append(
            {
                "target": f"strip wall <= 2 x cp(kept bytes) + 1 s, {r['size']}",
                "value": round(s, 3),
                "limit": round(2 * c + 1, 3),
                "met": s <= 2 * c + 1,
            }
        )
        if "naive" in r:
            ratio = r["naive"]["wall_median_s"] / s
            rows.append(
                {
                    "target": f"naive / strip wall >= 20, {r['size']}",
                    "value": round(ratio, 1),
                    "limit": 20,
                    "met": ratio >= 20,
                }
            )
        rows.append(
            {
                "target": f"strip peak RSS <= 300 MB, {r['size']}",
                "value": round(r["strip"]["peak_rss_mb"], 1),
                "limit": 300,
                "met": r["strip"]["peak_rss_mb"] <= 300,
            }
        )
    return rows


def markdown(results: list[dict], rows: list[dict], opts: argparse.Namespace) -> str:
    gib = 2**30
    lines = [
        f"layout {opts.layout}, keys {opts.keys}, files {opts.files}; medians of {opts.repeats} runs after a "
        "warm-up (naive: one run)",
        "",
        "| size | source | kept data | output | LoRA rank | strip s | strip RSS MB | cp kept s | naive s | "
        "naive RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        naive = r.get("naive", {})
        lines.append(
            f"| {r['size']} | {r['source_bytes'] / gib:.2f} GiB, {r['source']['synthetic']['keys']} keys, "
            f"{r['source']['synthetic']['files']} files | {r['kept_data_bytes'] / 2**20:.1f} MiB | "
            f"{r['output_bytes'] / 2**20:.1f} MiB | {r['source']['lora_rank']} | {r['strip']['wall_median_s']:.2f} | "
            f"{r['strip']['peak_rss_mb']:.0f} | {r['cp']['wall_median_s']:.2f} | "
            f"{naive.get('wall_median_s', float('nan')):.1f} | {naive.get('peak_rss_mb', float('nan')):.0f} |"
        )
    lines += ["", "| target | value | limit | met |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {t['limit']} | {'yes' if t['met'] else 'NO'} |" for t in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1G,4G", help="comma-separated base sizes (default 1G,4G)")
    p.add_argument("--layout", choices=["stacked", "per-layer"], default="stacked")
    p.add_argument("--keys", type=int, default=200, help="make_synthetic --keys (per-layer: sets the key count)")
    p.add_argument("--files", type=int, default=256, help="data files (2 per simulated rank)")
    p.add_argument("--layers", type=int, default=32, help="layers (stacked layout)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--naive-repeats", type=int, default=1)
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--generate", metavar="SIZE", help=argparse.SUPPRESS)  # internal: the generator child
    opts = p.parse_args(argv)
    if opts.layout == "per-layer":
        opts.layers = None
    if opts.generate:
        generate(opts.generate, opts.layout, opts.keys, opts.files, opts.layers)
        return 0
    results = [bench_size(size.strip(), opts) for size in opts.sizes.split(",")]
    rows = targets(results)
    text = markdown(results, rows, opts)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "strip-frozen" + (f"-{opts.tag}" if opts.tag else "")
    (RESULTS / f"{name}.json").write_text(
        json.dumps(
            {"options": vars(opts), "machine": machine_info(), "results": results, "targets": rows, "markdown": text},
            indent=1,
            default=str,
        )
    )
    return 0 if all(t["met"] for t in rows) else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
