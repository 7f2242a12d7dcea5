"""Save a tiny GPT with one multi-token prediction layer as torch_dist with real megatron-core 0.19.2 on CPU
(fixtures/generate.py's model, local spec, ``mtp_num_layers=1``): the model section and Megatron-LM's common
items (args, iteration, checkpoint_version), for the convert tests of MTP keys.

    python tests/mcore_save_mtp.py save OUT_DIR
    python tests/mcore_save_mtp.py load CKPT REFERENCE

``load`` builds the same model with fresh weights, loads CKPT's model section (``dist_checkpointing.load``; the
model keeps no extra state, as a converted save carries none) and checks every parameter equals what REFERENCE
loads. Prints ``MTP-PARAMS <names>`` / ``LOADED <n> parameters equal``.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

import typing_extensions

typing.override = typing_extensions.override  # type: ignore[attr-defined]  # megatron uses 3.12's

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))

import generate as gen  # noqa: E402
import torch  # noqa: E402


def build_model(seed: int, no_extra_state: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel import layers

    if no_extra_state:
        for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
            cls.get_extra_state = torch.nn.Module.get_extra_state  # type: ignore[method-assign]
    torch.manual_seed(seed)
    config = gen.transformer_config(2, 1)
    config.mtp_num_layers = 1
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=gen.MODEL_DIMS["padded_vocab_size"],
        max_sequence_length=gen.MODEL_DIMS["seq_length"],
        position_embedding_type="rope",
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )


def loaded(path: str, no_extra_state: bool) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    model = build_model(999, no_extra_state)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(state["model"], strict=not no_extra_state)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    mode = sys.argv[1]
    gen.install_cpu_shims()
    gen.init_distributed(1)
    gen.seed_everything(1234)
    from megatron.core import dist_checkpointing

    if mode == "save":
        out = Path(sys.argv[2])
        model = build_model(1234)
        args = argparse.Namespace(
            num_layers=2, mtp_num_layers=1, swiglu=True, ckpt_format="torch_dist", moe_grouped_gemm=False
        )
        out.mkdir(parents=True)
        state = {"model": model.sharded_state_dict(), "args": args, "iteration": 1, "checkpoint_version": 3.0}
        dist_checkpointing.save(state, str(out))
        names = sorted(n for n, _p in model.named_parameters() if n.startswith("mtp."))
        print("MTP-PARAMS " + " ".join(names))
    else:
        want = loaded(sys.argv[3], False)
        got = loaded(sys.argv[2], True)
        assert set(got) == set(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), name
        print(f"LOADED {len(want)} parameters equal, {sum(n.startswith('mtp.') for n in want)} of them MTP")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
