"""Megatron's own startup checks of a target layout, on CPU (megatron-core 0.19.2, Megatron-LM's arguments).

    python tests/mcore_layout_checks.py CASES.json  ->  JSON on stdout: one error line (or null) per case

A case is ``{"args": {name: value}, "world": N}``: Megatron-LM's ``parse_args`` defaults, overlaid with ``args``,
at world size N, then ``validate_args``; where that passes and N is 1, megatron-core's
``initialize_model_parallel`` at the case's layout on a one-rank gloo group. The error is "Type: message", as
``can-load`` prints it. Test code only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import typing
import warnings

warnings.filterwarnings("ignore")
if not hasattr(typing, "override"):  # megatron.training imports typing.override (Python 3.12)
    typing.override = lambda f: f  # type: ignore[attr-defined]


def _validate(case: dict) -> tuple[object, str | None]:
    from megatron.training.arguments import parse_args, validate_args

    argv, sys.argv = sys.argv, ["mcore_layout_checks", "--mock-data", "--micro-batch-size", "1"]
    try:
        args = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    for name, value in case["args"].items():
        setattr(args, name, value)
    args.world_size, args.rank = case["world"], 0
    try:
        validate_args(args)
    except AssertionError as exc:
        return args, f"AssertionError: {exc}"
    return args, None


def _initialize(args: object) -> str | None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,  # type: ignore[attr-defined]
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,  # type: ignore[attr-defined]
            context_parallel_size=args.context_parallel_size,  # type: ignore[attr-defined]
            expert_model_parallel_size=args.expert_model_parallel_size,  # type: ignore[attr-defined]
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,  # type: ignore[attr-defined]
        )
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    finally:
        parallel_state.destroy_model_parallel()
    return None


def main(path: str) -> None:
    results = []
    with open(path, encoding="utf-8") as handle:
        cases = json.load(handle)
    for case in cases:
        args, error = _validate(case)
        if error is None and case["world"] == 1:
            error = _initialize(args)
        results.append(error)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
