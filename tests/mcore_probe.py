"""Ask real megatron-core about a checkpoint, in a child process (it needs a process group).

python tests/mcore_probe.py ITERATION_DIR  ->  JSON on stdout:
  tensors: key -> sha256 of the tensor bytes as megatron-core loads them (load_plain_tensors)
  args: the saved args as megatron-core unpickles them (repr per value)
  common_keys: top-level keys of the common state
  config_error: the ValueError ModelParallelConfig raises for the saved args, or null
  resolved: the GTP weight-shard args as ModelParallelConfig resolves them from the saved args (null on an error)
  verify_integrity: result of megatron's verify_integrity_manifest when integrity.json exists
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import warnings

warnings.filterwarnings("ignore")


def main(iteration_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict, load_plain_tensors
    from megatron.core.model_parallel_config import ModelParallelConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # the tests pass a free one; standalone, let the OS pick one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    common = load_common_state_dict(iteration_dir)
    plain = load_plain_tensors(iteration_dir)
    tensors = {
        key: hashlib.sha256(value.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        + f":{value.dtype}:{list(value.shape)}"
        for key, value in plain.items()
        if isinstance(value, torch.Tensor)
    }
    args = common["args"]
    resolved = None
    try:
        config = ModelParallelConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            tensor_parallel_num_weight_shards=args.tensor_parallel_num_weight_shards,
            gtp_weight_remat_size=args.gtp_weight_remat_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            expert_tensor_parallel_num_weight_shards=args.expert_tensor_parallel_num_weight_shards,
            expert_gtp_weight_remat_size=args.expert_gtp_weight_remat_size,
        )
        config_error = None
        resolved = {
            name: getattr(config, name)
            for name in (
                "tensor_parallel_num_weight_shards",
                "gtp_weight_remat_size",
                "expert_tensor_parallel_size",
                "expert_tensor_parallel_num_weight_shards",
                "expert_gtp_weight_remat_size",
            )
        }
    except ValueError as exc:
        config_error = str(exc)
    integrity = None
    if os.path.exists(os.path.join(iteration_dir, "integrity.json")):
        from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

        try:
            verify_integrity_manifest(iteration_dir)
            integrity = "ok"
        except Exception as exc:  # report, the test asserts
            integrity = f"failed: {exc}"
    print(
        json.dumps(
            {
                "tensors": tensors,
                "args": {k: repr(v) for k, v in vars(args).items()},
                "arg_types": {k: type(v).__module__ + "." + type(v).__qualname__ for k, v in vars(args).items()},
                "common_keys": sorted(common),
                "common_repr": {k: repr(v) for k, v in common.items() if k != "args"},
                "config_error": config_error,
                "resolved": resolved,
                "verify_integrity": integrity,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
