"""Benchmark ``ckptdoctor strip-frozen`` on synthetic full PEFT checkpoints, in one run.

Inputs: synthetic torch_dist checkpoints written by real PyTorch DCP through ``make_synthetic.py``, with its
``build_specs`` swapped for a PEFT variant: a frozen base (bf16) plus LoRA adapters on every ``linear_qkv`` and
``linear_fc1`` (``<module>.adapter.linear_in/linear_out.weight``, rank chosen so that 1% of the parameters are
trainable) and optimizer state (fp32 ``exp_avg``/``exp_avg_sq``) for the adapters only, as a PEFT run saves it.
Cached in ``bench/data/peft_<size>_<layout>``.

Measured per size through ``harness.py`` (each command its own child process: wall spawn -> exit, the child's
own peak RSS via ``wait4``):

- ``ckptdoctor strip-frozen SRC -o OUT`` (trainable inferred from the optimizer) and ``cp`` of one file as
  large as the kept data (what copying the kept bytes costs at least), as one alternating group: one warm-up
  round, ``--repeats`` rounds, ratios per round;
- the naive path: ``dcp_to_torch_save`` -> ``torch.load`` -> filter -> ``torch.save`` -> ``torch_save_to_dcp``
  (``--naive-repeats`` runs, no warm-up: it reads every byte anyway).

The generator passes the PEFT variant to ``make_synthetic.write_checkpoint`` (``build_specs=``) in its own child
process (``--generate``), so that this one never imports torch.

    python bench/bench_strip.py                      # 1G and 4G, stacked layout (Megatron's dense GPT keys)
    python bench/bench_strip.py --sizes 1G --layout per-layer --keys 20000 --files 2000

Prints a Markdown table and writes ``bench/results/strip-frozen.json`` (``--render``: the table of that file).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (no torch)
from harness import DATA, PYTHON, REPO, RESULTS, Case, alternate, ckptdoctor, fmt_spread, parse_size  # noqa: E402

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
        "generator": harness.synthetic_generator(),  # a new make_synthetic makes another checkpoint
    }
    if marker.exists() and json.loads(marker.read_text()).get("requested") == want:
        return out
    cmd = [
        PYTHON,
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
        "generator": harness.synthetic_generator(),  # a new make_synthetic makes another checkpoint
    }
    param_bytes = 2  # bf16
    # make_synthetic sizes param + 8 bytes of optimizer state per element; here only the base is stored at scale
    total = int(parse_size(size) * (param_bytes + 8) / param_bytes)
    info = ms.write_checkpoint(
        out, total, keys, files, "bf16", 0, 2, layout, layers, os.cpu_count() or 1, build_specs=peft_build_specs
    )
    (out / "peft.json").write_text(
        json.dumps({"requested": want, **peft_build_specs.info, "synthetic": info}, indent=1)
    )


# --- measuring --------------------------------------------------------------------------------------------


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def bench_size(size: str, opts: argparse.Namespace) -> dict:
    src = make_peft_checkpoint(size, opts.layout, opts.keys, opts.files, opts.layers)
    peft = json.loads((src / "peft.json").read_text())
    scratch = DATA / "tmp" / f"strip_{size}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    out = scratch / "out"
    src_iter = next(src.glob("iter_*"))
    # the kept data size, from one untimed strip run: cp copies a file that large
    harness.run_once(ckptdoctor("strip-frozen", str(src), "-o", str(out)), opts.timeout)
    kept_data = sum(p.stat().st_size for p in next(out.glob("iter_*")).glob("*.distcp"))
    blob, copy = scratch / "kept.bin", scratch / "kept.copy"
    with open(blob, "wb") as f:
        for left in range(kept_data, 0, -(8 << 20)):
            f.write(os.urandom(min(8 << 20, left)))
    group = alternate(
        {
            "strip": Case(
                ckptdoctor("strip-frozen", str(src), "-o", str(out)),
                before=lambda: shutil.rmtree(out, ignore_errors=True),
            ),
            "cp": Case(["cp", str(blob), str(copy)], before=lambda: copy.unlink(missing_ok=True)),
        },
        opts.repeats,
        opts.timeout,
    )
    if group.failures:
        raise SystemExit(f"failed: {group.failures}")
    out_iter = next(out.glob("iter_*"))
    result = {
        "size": size,
        "source_bytes": _dir_bytes(src_iter),
        "output_bytes": _dir_bytes(out_iter),
        "kept_data_bytes": kept_data,
        "source": peft,
        "group": group.summary(),
        "strip_over_cp": group.ratio("strip", "cp"),
    }
    blob.unlink()
    copy.unlink(missing_ok=True)

    if not opts.skip_naive and size in (opts.naive_sizes or size).split(","):
        naive_out = scratch / "naive"

        def clean() -> None:
            shutil.rmtree(naive_out, ignore_errors=True)
            for name in ("full.pt", "kept.pt"):
                (scratch / name).unlink(missing_ok=True)

        naive = alternate(
            {"naive": Case([PYTHON, "-c", NAIVE, str(src_iter), str(scratch), str(naive_out)], before=clean)},
            opts.naive_repeats,
            3600,
            warm_up=False,
        )
        clean()
        if naive.failures:
            raise SystemExit(f"naive path failed: {naive.failures}")
        result["naive"] = naive.summary()["cases"]["naive"]
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def _case(r: dict, name: str) -> dict:
    return r["naive"] if name == "naive" else r["group"]["cases"][name]


def targets(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        s, c = _case(r, "strip")["seconds"]["median"], _case(r, "cp")["seconds"]["median"]
        rows.append(
            {
                "target": f"strip wall <= 2 x cp(kept bytes) + 1 s, {r['size']} (medians)",
                "value": round(s, 3),
                "limit": round(2 * c + 1, 3),
                "met": s <= 2 * c + 1,
            }
        )
        if "naive" in r:
            ratio = _case(r, "naive")["seconds"]["median"] / s
            rows.append(
                {
                    "target": f"naive / strip wall >= 20, {r['size']} (medians)",
                    "value": round(ratio, 1),
                    "limit": 20,
                    "met": ratio >= 20,
                }
            )
        peak = _case(r, "strip")["peak_rss_mb"]
        rows.append(
            {"target": f"strip peak RSS <= 300 MB, {r['size']}", "value": round(peak), "limit": 300, "met": peak <= 300}
        )
    return rows


def render(doc: dict) -> str:
    o, results = doc["options"], doc["results"]
    gib = 2**30
    lines = [
        f"layout {o['layout']}, keys {o['keys']}, files {o['files']}; strip and cp alternating, {o['repeats']} rounds "
        f"after a warm-up round; naive: {o['naive_repeats']} run(s)",
        "",
        "| size | source | kept data | output | LoRA rank | strip s | strip RSS MB | cp kept s | strip / cp "
        "| naive s | naive RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        strip, cp = _case(r, "strip"), _case(r, "cp")
        naive = r.get("naive")
        source = f"{r['source_bytes'] / gib:.2f} GiB, {r['source']['synthetic']['keys']} keys, "
        source += f"{r['source']['synthetic']['files']} files"
        cells = [
            r["size"],
            source,
            f"{r['kept_data_bytes'] / 2**20:.1f} MiB",
            f"{r['output_bytes'] / 2**20:.1f} MiB",
            str(r["source"]["lora_rank"]),
            fmt_spread(strip["seconds"], ".2f"),
            f"{strip['peak_rss_mb']:.0f}",
            fmt_spread(cp["seconds"], ".2f"),
            fmt_spread(r["strip_over_cp"], ".1f"),
            fmt_spread(naive and naive["seconds"], ".1f"),
            f"{naive['peak_rss_mb']:.0f}" if naive else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| target | value | limit | met |", "|---|---|---|---|"]
    lines += [
        f"| {t['target']} | {t['value']} | {t['limit']} | {'yes' if t['met'] else 'NO'} |" for t in doc["targets"]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_options(p)
    p.add_argument("--sizes", default="1G,4G", help="comma-separated base sizes (default 1G,4G)")
    p.add_argument("--layout", choices=["stacked", "per-layer"], default="stacked")
    p.add_argument("--keys", type=int, default=200, help="make_synthetic --keys (per-layer: sets the key count)")
    p.add_argument("--files", type=int, default=256, help="data files (2 per simulated rank)")
    p.add_argument("--layers", type=int, default=32, help="layers (stacked layout)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--naive-repeats", type=int, default=1)
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--naive-sizes", default=None, help="sizes at which to run the naive path (default: all)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--render", action="store_true", help="print the table of the results file")
    p.add_argument("--generate", metavar="SIZE", help=argparse.SUPPRESS)  # internal: the generator child
    opts = p.parse_args(argv)
    harness.use_code(opts.code)
    if opts.layout == "per-layer":
        opts.layers = None
    if opts.generate:
        generate(opts.generate, opts.layout, opts.keys, opts.files, opts.layers)
        return 0
    name = "strip-frozen" + (f"-{opts.tag}" if opts.tag else "")
    if opts.render:
        print(render(json.loads((RESULTS / f"{name}.json").read_text())))
        return 0
    recorder = harness.Recorder(name, argv)
    results = [bench_size(size.strip(), opts) for size in opts.sizes.split(",")]
    rows = targets(results)
    doc = json.loads(recorder.write({"options": vars(opts), "results": results, "targets": rows}).read_text())
    print(harness.header(doc) + "\n\n" + render(doc))
    return 0 if all(t["met"] for t in rows) else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
