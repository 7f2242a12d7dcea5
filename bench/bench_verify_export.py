"""verify-export: metadata-only verification of a large Hugging Face export against reading every shard header with
``safetensors.safe_open`` in a loop, and ``--values`` throughput against ``cat`` of both sides.

    .venv/bin/python bench/bench_verify_export.py [--size 256M] [--keys 150000] [--files 16] [--per-shard 5000]

The checkpoint is a cached synthetic MoE save (``make_synthetic.py``, per-layer keys, one key per expert). The export
is written here with the ``safetensors`` library (shards of --per-shard tensors and an index, a qwen2_moe
``config.json``), its tensors named and cut from the checkpoint's by the qwen_moe mapping (the values are the
checkpoint's, so ``--values`` compares equal tensors end to end). Cases, one alternating group of ``harness.py``:
``ckptdoctor verify-export CKPT HF`` (metadata only; text and JSON), ``ckptdoctor inspect CKPT`` (the checkpoint's
``.metadata`` alone, a floor), a Python loop of ``safe_open`` + ``keys()`` + ``get_slice``
(shape and dtype; numpy framework: no torch import) over every shard, ``verify-export --values`` (default
``--jobs``: the available cores) and with ``--jobs 1``, and ``cat`` of the checkpoint's data files and the
export's shards. Writes bench/results/verify-export.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import PYTHON, Case, alternate, ckptdoctor, fmt_spread  # noqa: E402

SAFE_OPEN_LOOP = """
import sys, time
from pathlib import Path
from safetensors import safe_open
t0 = time.perf_counter()
n = 0
for shard in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with safe_open(str(shard), framework="np") as f:
        for name in f.keys():
            piece = f.get_slice(name)
            piece.get_shape(), piece.get_dtype()
            n += 1
print(f"{n} tensors")
"""


def write_export(save: Path, out: Path, per_shard: int) -> int:
    """The qwen2_moe export of the synthetic checkpoint; returns its tensor count."""
    import torch
    from safetensors.torch import save_file

    from ckptdoctor.args import args_as_dict
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.ops.verify_export.expected import Dims, expected_tensors
    from ckptdoctor.ops.verify_export.mapping import builtin_mappings
    from ckptdoctor.ops.verify_export.values import pieces_of
    from ckptdoctor.values.read import read_region

    checkpoint = open_checkpoint(save)
    args = args_as_dict(checkpoint.args)
    heads = args["num_attention_heads"]
    config = {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_size": args["hidden_size"],
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": args["ffn_hidden_size"],
        "moe_intermediate_size": args["moe_ffn_hidden_size"],
        "num_experts": args["num_experts"],
        "vocab_size": args["padded_vocab_size"],
        "torch_dtype": "bfloat16",
    }
    dims = Dims.from_args(args, config)
    expected, _ = expected_tensors(checkpoint, builtin_mappings()["qwen_moe"], dims)
    by_slice = defaultdict(list)
    for want in expected:
        by_slice[want.megatron_key, want.index].append(want)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    count = 0

    def flush() -> None:
        nonlocal shard
        if shard:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard = {}

    for (key, index), wants in sorted(by_slice.items()):
        region = read_region(checkpoint, key, index)
        for want in wants:
            pieces = pieces_of(region, want, dims)
            shard[want.hf_name] = pieces[want.part].contiguous().clone()
            count += 1
            if len(shard) >= per_shard:
                flush()
    flush()
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="256M", help="the synthetic checkpoint's bytes on disk")
    parser.add_argument("--keys", type=int, default=150000, help="its keys (model + optimizer + rng)")
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=5000, help="tensors per safetensors shard")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--render", action="store_true", help="print the table of bench/results/verify-export.json")
    harness.add_common_options(parser)
    opts = parser.parse_args(argv)
    harness.use_code(opts.code)
    if opts.render:
        print(render(json.loads((harness.RESULTS / "verify-export.json").read_text())))
        return 0
    recorder = harness.Recorder("verify-export", argv)
    save = harness.synthetic(opts.size, opts.keys, opts.files)
    iteration, names, ckpt_bytes = harness.iteration_files(save)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        tensors = write_export(save, hf, opts.per_shard)
        shards = sorted(p.name for p in hf.glob("*.safetensors"))
        hf_bytes = sum((hf / s).stat().st_size for s in shards)
        verify = ckptdoctor("verify-export", str(save), str(hf))
        both = f"cd {iteration} && cat {' '.join(names)} > /dev/null && cd {hf} && cat {' '.join(shards)} > /dev/null"
        cases = {
            "verify-export (metadata only)": Case(verify),
            "verify-export --format json (metadata only)": Case(verify + ["--format", "json"]),
            "ckptdoctor inspect (reading the checkpoint alone)": Case(ckptdoctor("inspect", str(save))),
            "safe_open loop (headers only)": Case([PYTHON, "-c", SAFE_OPEN_LOOP, str(hf)]),
            "verify-export --values": Case(verify + ["--values"]),
            "verify-export --values --jobs 1": Case(verify + ["--values", "--jobs", "1"]),
            "cat checkpoint + export": Case(["sh", "-c", both]),
        }
        group = alternate(cases, opts.repeats)
        shutil.rmtree(hf)
    doc = recorder.write(
        {
            "checkpoint": save.name,
            "checkpoint_bytes": ckpt_bytes,
            "export_tensors": tensors,
            "export_shards": len(shards),
            "export_bytes": hf_bytes,
            "group": group.summary(),
        }
    )
    print(render(json.loads(doc.read_text())))
    return 0


def render(doc: dict) -> str:
    total = doc["checkpoint_bytes"] + doc["export_bytes"]
    lines = [
        f"export of {doc['export_tensors']:,} tensors in {doc['export_shards']} shards "
        f"({doc['export_bytes'] / (1 << 20):.0f} MiB) against {doc['checkpoint']} "
        f"({doc['checkpoint_bytes'] / (1 << 20):.0f} MiB), warm page cache",
        "",
        "| command | wall s, median [min–max] | MiB/s of both sides (median) |",
        "|---|---|---|",
    ]
    for name, case in doc["group"]["cases"].items():
        s = case["seconds"]
        rate = f"{total / s['median'] / (1 << 20):.0f}" if s and ("values" in name or "cat" in name) else "-"
        lines.append(f"| `{name}` | {fmt_spread(s, '.2f')} | {rate} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
