"""Write a torch_dist checkpoint whose one tensor has N chunks at offsets that all share one tuple hash.

    python bench/make_flood.py OUT_DIR [--chunks 40000]
    /usr/bin/time -f '%e s %M KB' python -m ckptdoctor inspect OUT_DIR

The offsets come from ``tests/hostile_corpus.colliding_pairs``, which solves CPython's tuple hash for one item.
The chunks lie outside the tensor's shape, which ``check`` reports as CKD220. The checkpoint has no common state,
so ``inspect`` and ``diff`` stop with that error after the ``.metadata`` is read and indexed, which is the part
that was quadratic. Needs torch (the DCP dataclasses) to write the ``.metadata``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hostile_corpus import colliding_pairs  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--chunks", type=int, default=40_000)
    args = parser.parse_args()

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    pairs = colliding_pairs(args.chunks)
    chunks = [ChunkStorageMetadata(torch.Size(pair), torch.Size([1, 1])) for pair in pairs]
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2, 2]), chunks)
    storage = {MetadataIndex("w", torch.Size(pair)): _StorageInfo("__0_0.distcp", 0, 4) for pair in pairs}
    iteration_dir = args.out / "iter_0000001"
    iteration_dir.mkdir(parents=True, exist_ok=False)
    data = pickle.dumps(Metadata(state_dict_metadata={"w": tensor}, storage_data=storage))
    (iteration_dir / ".metadata").write_bytes(data)
    (iteration_dir / "__0_0.distcp").write_bytes(bytes(4))
    (iteration_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (args.out / "latest_checkpointed_iteration.txt").write_text("1")
    print(f"{iteration_dir / '.metadata'}: {len(data):,} bytes, {len(pairs):,} chunks sharing hash {hash(pairs[0])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
