"""ckptdoctor on a plain PyTorch DCP save against torch's own tools (issue #41), wall time and peak memory.

    python bench/bench_plain_dcp.py --out /tmp/bench/plain_dcp [--tensors 1024] [--rows 256]

Two plain ``dcp.save`` dirs ``a`` and ``b`` of the same state (``--tensors`` fp32 tensors of ``rows x 256``,
256 MiB at the defaults), then, each in its own process under ``/usr/bin/time``:

- ``inspect a`` against ``FileSystemReader(a).read_metadata()`` (the process imports torch);
- ``diff --values a b`` against ``dcp_to_torch_save`` of both, ``torch.load`` of both and ``torch.equal`` per key.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAKE = """
import torch, torch.distributed.checkpoint as dcp
torch.manual_seed(0)
model = {{f"layers.{{i}}.weight": torch.randn({rows}, 256) for i in range({tensors})}}
state = {{"model": model, "train_state": {{"step": 1}}}}
for name in ("a", "b"):
    dcp.save(state, checkpoint_id="{out}/" + name, no_dist=True)
"""
READ_METADATA = """
from torch.distributed.checkpoint import FileSystemReader
FileSystemReader("{out}/a").read_metadata()
"""
TO_TORCH_SAVE = """
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
for n in ("a", "b"):
    dcp_to_torch_save(f"{out}/{{n}}", f"{out}/{{n}}.pt")
a = torch.load("{out}/a.pt", weights_only=False)
b = torch.load("{out}/b.pt", weights_only=False)
assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
"""


def timed(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB) of one process."""
    proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", *argv], capture_output=True, text=True, check=True)
    wall, rss = proc.stderr.strip().splitlines()[-1].split()
    return float(wall), int(rss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tensors", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=256)
    opts = parser.parse_args()
    out = opts.out.resolve()
    if not (out / "b" / ".metadata").exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", MAKE.format(out=out, rows=opts.rows, tensors=opts.tensors)], check=True)
    ckd = [sys.executable, "-m", "ckptdoctor"]
    cases = {
        "ckptdoctor inspect": [*ckd, "inspect", str(out / "a")],
        "FileSystemReader.read_metadata": [sys.executable, "-c", READ_METADATA.format(out=out)],
        "ckptdoctor diff --values": [*ckd, "diff", "--values", str(out / "a"), str(out / "b")],
        "dcp_to_torch_save + load + compare": [sys.executable, "-c", TO_TORCH_SAVE.format(out=out)],
    }
    for name, argv in cases.items():
        wall, rss = timed(argv)
        print(f"{name:40s} {wall:7.2f} s  {rss / 1024:7.0f} MiB")


if __name__ == "__main__":
    main()
