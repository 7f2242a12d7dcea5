"""Rewrite an fsdp_dtensor save's optimizer param groups into the layout Megatron-FSDP itself saves them in, with
megatron-core 0.19.2's own state-dict functions (built on CPU, not by a Megatron-FSDP run: no GPU):

- which parameter is in which group: ``megatron.core.optimizer._get_param_groups`` on the fixture's model (the
  grouping ``get_megatron_optimizer`` builds), each group's fields taken from the saved group with the same
  identifier fields (``param_group_identifier_keys``, as the distributed optimizer's load matches them);
- the per-parameter layout: ``DistributedOptimizer._param_groups_to_param2group_meta`` (what
  ``sharded_param_state_fsdp_dtensor`` saves as ``param_to_group_meta``), parameters named as Megatron-FSDP's
  ``_param_name`` names them (``module.module.module.<name>``, the prefix of the save's optimizer states);
- no ``content_metadata`` (Megatron-LM's fsdp_dtensor save passes it to the optimizer only, never into the state
  dict) and an ``rng_state`` keyed ``"(<pp>, <tp>)"`` as ``get_rng_state`` builds it for fsdp_dtensor, less
  ``cuda_rng_state`` (``torch.cuda.get_rng_state`` needs CUDA) and with an empty tracker state;
- saved with ``torch.distributed.checkpoint.save`` from the nested state dict, the optimizer section being
  ``{"state": ..., "param_to_group_meta": ...}`` only (no ``param_groups``, no ``param_state_sharding_type``).

    torchrun --nproc_per_node 1 tests/fsdp_native_groups.py SOURCE_ITER_DIR OUTPUT_SAVE_DIR

writes OUTPUT_SAVE_DIR/iter_<iteration> and the tracker file, as Megatron-LM's save_checkpoint does.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

import generate as gen  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys  # noqa: E402

FSDP_PREFIX = "module.module.module."
# the fixture's local layer spec keeps separate norms, which a Transformer Engine spec (Megatron-FSDP's) fuses into
# the next linear layer; its sharded_state_dict saves them under the fused names, as the save's states name them
TE_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def fsdp_name(name: str) -> str:
    for local, fused in TE_NAMES.items():
        if name.endswith(local):
            name = name[: -len(local)] + fused
    return FSDP_PREFIX + name


def main() -> None:
    source, output = sys.argv[1], sys.argv[2]
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups, get_standard_config_overrides
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    state = _load_state_dict_from_keys(checkpoint_id=source)  # nested along the paths DCP's planner recorded
    optimizer = state["optimizer"]
    saved_groups = optimizer.pop("param_groups")
    del optimizer["param_state_sharding_type"]
    args = state["args"]
    gen.install_cpu_shims()
    gen.init_distributed(1)
    model = gen.build_gpt(args.num_layers, 1)
    # the fixture's optimizer config (generate.py's build_optimizer): the fields the grouping reads
    config = OptimizerConfig(optimizer="adam", lr=gen.LR, min_lr=gen.LR / 10, weight_decay=0.01, bf16=args.bf16)
    built = _get_param_groups([model], config, get_standard_config_overrides(config))  # as get_megatron_optimizer

    def identity(group: dict) -> tuple:
        return tuple(group.get(k) for k in param_group_identifier_keys)

    by_identity = {identity(g): g for g in saved_groups}
    groups = [{**by_identity[identity(g)], "params": g["params"]} for g in built]
    names = {p: fsdp_name(n) for n, p in model.named_parameters()}
    stub = SimpleNamespace(_param_name=names.__getitem__)
    meta = DistributedOptimizer._param_groups_to_param2group_meta(stub, groups)  # type: ignore[arg-type]
    optimizer["param_to_group_meta"] = meta
    del state["content_metadata"]
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state()}
    rng |= {"torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    state["rng_state"] = {"(0, 0)": [rng]}
    assert set(optimizer) == {"state", "param_to_group_meta"}  # what sharded_param_state_fsdp_dtensor returns
    iteration = int(state["iteration"])
    dcp.save(state, checkpoint_id=str(Path(output) / gen.ITERATION_DIR_FMT.format(iteration)), no_dist=True)
    (Path(output) / gen.TRACKER_FILENAME).write_text(str(iteration))
    print(f"NATIVE OK {len(groups)} groups over {len(meta)} parameters")


if __name__ == "__main__":
    main()
