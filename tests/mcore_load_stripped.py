"""Load a stripped (trainable-params-only) checkpoint with real megatron-core onto a freshly built base model.

Run by tests/test_strip_frozen.py in a child process (single process, or ``torchrun`` for TP=2):

    python tests/mcore_load_stripped.py STRIPPED FULL_SOURCE [REFERENCE]

The model is rebuilt with fixtures/generate.py (same GPT + LoRA adapters as the fixtures). The load request's
model section is filtered to trainable params and loaded with StrictHandling.LOG_UNEXPECTED, as Megatron-LM
does for --save-trainable-params-only checkpoints. Checks, on every rank: adapter weights, Adam exp_avg and
exp_avg_sq and the iteration equal what the full source checkpoint (and the reference, when given) load;
frozen base weights are untouched by the load; adapters really changed from the fresh model's values.
Prints "OK <n> tensors" on success.
"""

from __future__ import annotations

import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))

import generate as gen  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def load_fresh(ckpt_dir: str, args, pp: int):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    torch.manual_seed(987654 + dist.get_rank())  # fresh weights differ from the saved ones
    model = gen.build_gpt(args.num_layers, pp)
    gen.add_lora(model)
    optimizer = gen.build_optimizer(gen.wrap_ddp(model))
    fresh = gen.snapshot(model, None)
    request = gen.build_state_dict(
        args, model, optimizer, None, args.iteration, 0.0, model_filter=gen.trainable_only, is_loading=True
    )
    loaded = dist_checkpointing.load(request, ckpt_dir, strict=StrictHandling.LOG_UNEXPECTED)
    model.load_state_dict(loaded["model"], strict=False)
    optimizer.load_state_dict(loaded["optimizer"])
    return model, gen.snapshot(model, optimizer), fresh, loaded


def iteration_dir(path: str) -> str:
    p = Path(path)
    tracker = p / gen.TRACKER_FILENAME
    return str(p / gen.ITERATION_DIR_FMT.format(int(tracker.read_text()))) if tracker.exists() else str(p)


def main() -> None:
    stripped, full = iteration_dir(sys.argv[1]), iteration_dir(sys.argv[2])
    reference = iteration_dir(sys.argv[3]) if len(sys.argv) > 3 else None
    gen.install_cpu_shims()
    tp, pp = gen.init_distributed(1)
    gen.seed_everything(1234)
    from megatron.core import dist_checkpointing

    args = dist_checkpointing.load_common_state_dict(full)["args"]
    model, got, fresh, loaded = load_fresh(stripped, args, pp)
    assert loaded["iteration"] == args.iteration == 10, loaded["iteration"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".adapter." in n for n in trainable), trainable
    checked = 0
    for name, value in fresh.items():  # frozen base untouched; adapters restored (changed from fresh)
        pname = name.split(":", 1)[1]
        if pname in trainable:
            assert not torch.equal(got[name], value), f"{pname} not restored"
        else:
            assert torch.equal(got[name], value), f"{pname}: base weight touched by the load"
    for source in [full] + ([reference] if reference else []):
        _, expected, _, other = load_fresh(source, args, pp)
        assert other["iteration"] == loaded["iteration"]
        for key, value in expected.items():
            if key.startswith("param:") and key.split(":", 1)[1] not in trainable:
                continue
            assert key in got, f"{key} missing after loading {stripped}"
            assert torch.equal(got[key], value), f"{key} differs from {source}"
            checked += 1
    moments = [k for k in got if k.startswith(("exp_avg:", "exp_avg_sq:"))]
    assert moments and all(k.split(":", 1)[1] in trainable for k in moments), moments
    dist.barrier()
    print(f"OK rank {dist.get_rank()} tp {tp}: {checked} tensors, {len(moments)} Adam moments")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
