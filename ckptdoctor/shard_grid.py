"""How a plain PyTorch DCP save (FSDP2, TorchTitan, Megatron-LM torch_dcp) is sharded, read off its chunk grids.

A DTensor saved by DCP keeps one chunk per rank holding a piece of it: FSDP2 cuts each parameter (and its
optimizer state) along dim 0 with ``torch.chunk`` semantics, so a dim that the world size does not divide gives
uneven shards (5 rows over 2 ranks: 3 + 2). The writer ranks are those named by the data files
(``__<rank>_<n>.distcp``); a tensor kept in one chunk was saved whole (replicated, or one rank's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptdoctor.formats.torch_dist import writer_rank

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint

_SHOWN_UNEVEN = 3


@dataclass
class UnevenShards:
    key: str
    dim: int
    sizes: list[int]  # the chunks' extents along ``dim``, in offset order


@dataclass
class ShardGrid:
    world_size: int  # ranks that wrote a data file
    sharded: int  # tensors stored in more than one chunk
    whole: int  # tensors stored in one chunk
    shard_dims: dict[int, int] = field(default_factory=dict)  # dim -> tensors split along it
    uneven: list[UnevenShards] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "sharded": self.sharded,
            "whole": self.whole,
            "shard_dims": {str(dim): count for dim, count in sorted(self.shard_dims.items())},
            "uneven": [{"key": u.key, "dim": u.dim, "sizes": u.sizes} for u in self.uneven],
        }

    def summary(self) -> str:
        writers = f"world size {self.world_size}"
        if not self.sharded:
            return f"{writers}: every tensor whole ({self.whole})"
        dims = ", ".join(f"dim {dim}" for dim in sorted(self.shard_dims))
        text = f"{writers}: {self.sharded} tensors sharded on {dims}, {self.whole} whole"
        if self.uneven:
            shown = ", ".join(f"{u.key} {'+'.join(map(str, u.sizes))}" for u in self.uneven[:_SHOWN_UNEVEN])
            more = f", ... {len(self.uneven) - _SHOWN_UNEVEN} more" if len(self.uneven) > _SHOWN_UNEVEN else ""
            text += f"; {len(self.uneven)} uneven ({shown}{more})"
        return text


def shard_grid(checkpoint: Checkpoint) -> ShardGrid:
    """The sharding of every tensor of ``checkpoint`` from its chunk offsets and sizes (metadata only)."""
    ranks = {r for name in checkpoint.data_files if (r := writer_rank(name)) is not None}
    grid = ShardGrid(world_size=len(ranks), sharded=0, whole=0)
    for entry in checkpoint.entries.values():
        if entry.kind != "tensor" or entry.shape is None or entry.misranked_chunk() is not None:
            continue
        if len(entry.chunks) <= 1:
            grid.whole += 1
            continue
        grid.sharded += 1
        for dim in range(len(entry.shape)):
            extents = sorted({(c.offsets[dim], c.sizes[dim]) for c in entry.chunks})
            if len(extents) <= 1:
                continue
            grid.shard_dims[dim] = grid.shard_dims.get(dim, 0) + 1
            sizes = [size for _, size in extents]
            if len(set(sizes)) > 1:
                grid.uneven.append(UnevenShards(entry.key, dim, sizes))
    grid.uneven.sort(key=lambda u: u.key)
    return grid
