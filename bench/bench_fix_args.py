"""Benchmark ``ckptdoctor fix-args --write``: O(metadata), independent of data size, in one run.

Inputs: the cached ``make_synthetic.py`` checkpoints (2,000 data files, ~20,000 keys; core <= 0.18 layout with
``common.pt``), plus a core >= 0.19 variant of each made here: the same data files hard-linked, ``common.pt``
moved into a ``common_state/shard_0_1`` bytes item (its own small data file) added to ``.metadata`` with
PyTorch's own DCP classes, and the two-key ``metadata.json``. fix-args then takes the era's write path:
a new ``common.pt`` (0.18) or a new common-state data file plus a rewritten ``.metadata`` (0.19).

Each run writes ``--output`` to a fresh dir (unchanged data files hard-linked); one untimed warm-up, then
``--repeats`` timed runs, sizes interleaved; medians. Target (issue 4): time(4 GB) / time(0.5 GB) <= 1.3.

    python bench/bench_fix_args.py                # 0.5G and 4G
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_check import iteration_files, run_once  # noqa: E402
from run import DATA, RESULTS, machine_info, synthetic  # noqa: E402


def common_state_variant(save: Path) -> Path:
    """A core >= 0.19 layout of ``save``: data files hard-linked, common state as a DCP bytes item."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    source_iter, _, _ = iteration_files(save)
    out = save.with_name(save.name + "_era019")
    out_iter = out / source_iter.name
    if (out_iter / "metadata.json").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out_iter.mkdir(parents=True)
    for path in source_iter.iterdir():
        if path.suffix == ".distcp":
            os.link(path, out_iter / path.name)
    common = torch.load(source_iter / "common.pt", weights_only=False)
    import io

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.5G,4G")
    p.add_argument("--keys", type=int, default=20000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    python = sys.executable
    sizes = args.sizes.split(",")
    inputs: dict[tuple[str, str], Path] = {}
    for size in sizes:
        save = synthetic(python, size, args.keys, args.files)
        inputs[("<=0.18 common.pt", size)] = save
        inputs[(">=0.19 common_state", size)] = common_state_variant(save)

    scratch = DATA / "fixargs_out"
    times: dict[tuple[str, str], list[float]] = {k: [] for k in inputs}
    rss: dict[tuple[str, str], float] = {k: 0.0 for k in inputs}
    for round_ in range(args.repeats + 1):
        for key, save in inputs.items():
            shutil.rmtree(scratch, ignore_errors=True)
            cmd = [
                python,
                "-m",
                "ckptdoctor",
                "fix-args",
                str(save),
                "--set",
                "seq_length=12345",
                "--write",
                "--output",
                str(scratch),
            ]
            wall, _cpu, peak, rc = run_once(cmd, timeout=600)
            if rc != 0:
                raise SystemExit(f"{' '.join(cmd)} exited {rc}")
            if round_:  # round 0 warms the page cache
                times[key].append(wall)
                rss[key] = max(rss[key], peak)
    iteration = next(scratch.glob("iter_*"))
    linked = sum(1 for p in iteration.iterdir() if p.suffix == ".distcp" and p.stat().st_nlink > 1)
    shutil.rmtree(scratch, ignore_errors=True)

    rows = []
    result = {"machine": machine_info(), "runs": {}, "ratios": {}}
    for era in dict.fromkeys(k[0] for k in inputs):
        small, large = (statistics.median(times[(era, s)]) for s in (sizes[0], sizes[-1]))
        ratio = large / small
        result["ratios"][era] = ratio
        for size in sizes:
            med = statistics.median(times[(era, size)])
            result["runs"][f"{era} {size}"] = {"median_s": med, "peak_rss_mb": rss[(era, size)]}
            rows.append(f"| {era} | {size} | {med:.3f} | {rss[(era, size)]:.0f} |")
        rows.append(
            f"| {era} | ratio {sizes[-1]}/{sizes[0]} | {ratio:.2f} (target <= 1.3: "
            f"{'met' if ratio <= 1.3 else 'MISSED'}) | |"
        )
    print("| era | size | fix-args --write wall (s, median) | peak RSS (MB) |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nlast output: {linked} data files hard-linked (no tensor byte copied or rewritten)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fix-args.json").write_text(json.dumps(result, indent=2))
    return 0 if all(r <= 1.3 for r in result["ratios"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
