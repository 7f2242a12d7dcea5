"""Benchmark ``ckptdoctor fix-args --write``: O(metadata), independent of data size, in one run.

Inputs: the cached ``make_synthetic.py`` checkpoints (2,000 data files, ~20,000 keys; core <= 0.18 layout with
``common.pt``), plus a core >= 0.19 variant of each made here: the same data files hard-linked, ``common.pt``
moved into a ``common_state/shard_0_1`` bytes item (its own small data file) added to ``.metadata`` with
PyTorch's own DCP classes, and the two-key ``metadata.json``. fix-args then takes the era's write path:
a new ``common.pt`` (0.18) or a new common-state data file plus a rewritten ``.metadata`` (0.19).

The variants are made by a child process (``--prepare``): the measuring parent never imports torch, so the
measured children (forked from it) report their own peak RSS, not the parent's torch pages. Each run writes
``--output`` to a fresh dir (unchanged data files hard-linked); the four inputs are one alternating group
(``harness.alternate``: one warm-up round, ``--repeats`` rounds). Target (issue 4): time(4 GB) / time(0.5 GB)
<= 1.3 per era, as per-round ratios.

    python bench/bench_fix_args.py                # 0.5G and 4G -> bench/results/fix-args.json
    python bench/bench_fix_args.py --render
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (no torch)
from harness import DATA, PYTHON, RESULTS, Case, alternate, ckptdoctor, fmt_spread  # noqa: E402

ERAS = ("<=0.18 common.pt", ">=0.19 common_state")


def common_state_variant(save: Path) -> Path:
    """A core >= 0.19 layout of ``save``: data files hard-linked, common state as a DCP bytes item. Imports
    torch: call it in a child (``--prepare``)."""
    import io

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    source_iter, _, _ = harness.iteration_files(save)
    out = variant_path(save)
    out_iter = out / source_iter.name
    if (out_iter / "metadata.json").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out_iter.mkdir(parents=True)
    for path in source_iter.iterdir():
        if path.suffix == ".distcp":
            os.link(path, out_iter / path.name)
    common = torch.load(source_iter / "common.pt", weights_only=False)
    buf = io.BytesIO()
    torch.save([common], buf)
    (out_iter / "__0_common.distcp").write_bytes(buf.getvalue())
    with open(source_iter / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    key = "common_state/shard_0_1"
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__0_common.distcp", 0, len(buf.getvalue()))
    with open(out_iter / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    (out_iter / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (out / "latest_checkpointed_iteration.txt").write_text((save / "latest_checkpointed_iteration.txt").read_text())
    return out


def variant_path(save: Path) -> Path:
    return save.with_name(save.name + "_era019")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_options(p)
    p.add_argument("--sizes", default="0.5G,4G")
    p.add_argument("--keys", type=int, default=20000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--render", action="store_true", help="print the table of bench/results/fix-args.json")
    p.add_argument("--prepare", type=Path, nargs="+", help=argparse.SUPPRESS)  # internal: the torch child
    args = p.parse_args(argv)
    harness.use_code(args.code)
    if args.prepare:
        for save in args.prepare:
            common_state_variant(save)
        return 0
    if args.render:
        print(render(json.loads((RESULTS / "fix-args.json").read_text())))
        return 0
    recorder = harness.Recorder("fix-args", argv)
    sizes = [s.strip() for s in args.sizes.split(",")]
    saves = {size: harness.synthetic(size, args.keys, args.files) for size in sizes}
    subprocess.run([PYTHON, __file__, "--prepare", *map(str, saves.values())], check=True)
    cases: dict[str, Case] = {}
    outputs: dict[str, Path] = {}
    for size, save in saves.items():
        for era, src in zip(ERAS, (save, variant_path(save))):
            label = f"{era} {size}"
            out = outputs[label] = DATA / "tmp" / f"fixargs_{len(outputs)}"

            def clean(out: Path = out) -> None:
                shutil.rmtree(out, ignore_errors=True)

            cmd = ckptdoctor("fix-args", str(src), "--set", "seq_length=12345", "--write", "--output", str(out))
            cases[label] = Case(cmd, before=clean)
    group = alternate(cases, args.repeats, args.timeout)
    linked = {}
    for label, out in outputs.items():
        iteration = next(out.glob("iter_*"), None)
        linked[label] = iteration and sum(
            1 for f in iteration.iterdir() if f.suffix == ".distcp" and f.stat().st_nlink > 1
        )
        shutil.rmtree(out, ignore_errors=True)
    ratios = {era: group.ratio(f"{era} {sizes[-1]}", f"{era} {sizes[0]}") for era in ERAS}
    doc = recorder.write(
        {
            "sizes": sizes,
            "inputs": {size: harness.synthetic_info(save) for size, save in saves.items()},
            "group": group.summary(),
            "ratios": ratios,
            "hard_linked_data_files": linked,
        }
    )
    loaded = json.loads(doc.read_text())
    print(harness.header(loaded) + "\n\n" + render(loaded))
    return 0 if ratios and all(r and r["median"] <= 1.3 for r in ratios.values()) else 1


def render(doc: dict) -> str:
    cases = doc["group"]["cases"]
    sizes = doc["sizes"]
    lines = [
        "| era | size | fix-args --write wall s, median [min–max] | CPU s (median) | peak RSS MB "
        "| data files hard-linked |",
        "|---|---|---|---|---|---|",
    ]
    for era in ERAS:
        for size in sizes:
            c = cases[f"{era} {size}"]
            linked = doc["hard_linked_data_files"].get(f"{era} {size}")
            lines.append(
                f"| {era} | {size} | {fmt_spread(c['seconds'])} | {c['cpu_s']['median']:.2f} | {c['peak_rss_mb']:.0f} "
                f"| {linked} |"
            )
        r = doc["ratios"][era]
        verdict = "met" if r and r["median"] <= 1.3 else "MISSED"
        cpu = harness.summary_ratio(cases, f"{era} {sizes[-1]}", f"{era} {sizes[0]}")
        lines.append(
            f"| {era} | ratio {sizes[-1]}/{sizes[0]} per round | {fmt_spread(r, '.2f')} (<= 1.3: {verdict}) "
            f"| CPU: {fmt_spread(cpu, '.2f')} | | |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
