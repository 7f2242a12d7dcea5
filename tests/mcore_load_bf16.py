"""Load two torch_dist checkpoints of the bf16 fixture's layout (bf16 params, distributed optimizer with fp32 main
params, ``fully_reshardable``) with real megatron-core 0.19.2 on CPU, model and optimizer, and compare what each
leaves in a freshly built model: the bf16 parameters, the optimizer's fp32 main params and Adam moments, and its
param groups' fields (``lr``, ``step``, ``wd_mult``, ...).

    torchrun --nproc_per_node 2 tests/mcore_load_bf16.py REFERENCE CANDIDATE

Each rank prints ``BF16 OK rank <r>: <n> tensors equal (...), <g> param groups equal`` when every value matches
bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))

import generate as gen  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def iteration_dir(path: str) -> Path:
    p = Path(path)
    tracker = p / gen.TRACKER_FILENAME
    return p / gen.ITERATION_DIR_FMT.format(int(tracker.read_text())) if tracker.exists() else p


def load(path: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """A fresh model and optimizer (one step taken so the distributed optimizer can build its load request, as
    generate.py's verify does), the checkpoint loaded into both; their values, keyed as generate.py snapshots."""
    from megatron.core import dist_checkpointing

    ckpt = iteration_dir(path)
    args = dist_checkpointing.load_common_state_dict(str(ckpt))["args"]
    args.no_save_rng = True  # the round trip carries no per-rank RNG state: request none
    from megatron.core.tensor_parallel import layers

    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        # nor extra state (Megatron-FSDP keeps none): the model's linear layers request none
        cls.get_extra_state = torch.nn.Module.get_extra_state  # type: ignore[method-assign]
    torch.manual_seed(987654)  # fresh weights differ from the saved ones
    from megatron.core.transformer.module import Float16Module

    gpt = gen.build_gpt(args.num_layers, 1)
    model = Float16Module(gpt.config, gpt)  # as the fixture was built (Megatron-LM's get_model with --bf16)
    ddp = gen.wrap_ddp(model)
    optimizer = gen.build_optimizer(ddp)
    gen.train_one_step(ddp, optimizer, seed=4321)
    request = gen.build_state_dict(args, model, optimizer, None, args.iteration, 0.0, is_loading=True)
    request.pop("rerun_state_machine", None)  # nor rerun state (Megatron-LM loads on without it)
    loaded = dist_checkpointing.load(request, str(ckpt))
    model.load_state_dict(loaded["model"], strict=True)
    with torch.no_grad():  # distributed optimizer: fp32 main shards are views of the params
        optimizer.load_state_dict(loaded["optimizer"])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
    return gen.snapshot(model, optimizer), groups


def main() -> None:
    reference, candidate = sys.argv[1], sys.argv[2]
    gen.LAYOUT.dp = 2
    gen.LAYOUT.distributed_optimizer = True
    gen.LAYOUT.fully_parallel_save = True
    gen.LAYOUT.optim_sharding_type = "fully_reshardable"
    gen.LAYOUT.bf16 = True
    gen.install_cpu_shims()
    gen.init_distributed(1)
    gen.seed_everything(1234)
    want, want_groups = load(reference)
    got, got_groups = load(candidate)
    assert got_groups == want_groups, (got_groups, want_groups)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key, value in want.items():
        assert got[key].dtype == value.dtype, (key, got[key].dtype, value.dtype)
        assert torch.equal(got[key], value), f"{key} differs from the reference"
    dtypes = sorted({str(v.dtype) for v in want.values()})
    equal = f"{len(want)} tensors equal ({', '.join(dtypes)}), {len(want_groups)} param groups equal"
    sys.stdout.write(f"BF16 OK rank {dist.get_rank()}: {equal}\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
