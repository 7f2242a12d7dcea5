"""Load checkpoints written by ``ckptdoctor edit`` with real Megatron-LM code (megatron-core 0.19.2's wheel also
ships ``megatron.training``), in a child process (single process, or ``torchrun`` for TP > 1):

    python tests/mcore_load_edited.py CASES_JSON [--dp N] [--layout JSON]

``--layout`` sets fixtures/generate.py's ``Layout`` fields the loading model is built with (e.g. a MoE fixture's
``{"dp": 2, "ep": 2, "num_experts": 4}``), as the fixture was generated.

CASES_JSON is a list of cases, each loaded into a freshly built model (fixtures/generate.py's tiny GPT):

* ``"via": "load_checkpoint"``: ``megatron.training.checkpointing.load_checkpoint`` with Megatron-LM's own
  argument defaults (``arguments.parse_args``), the checkpoint's saved args on top (as a resumed run has them),
  this run's layout and the case's ``flags`` (``--no-load-optim``, ``--no-load-rng``, ``--finetune``);
* ``"via": "dist"``: ``dist_checkpointing.load`` of the model section only, default strictness (or the case's
  ``strictness``, e.g. ``log_unexpected``: keys the checkpoint lacks stay fresh); with
  ``"no_extra_state": true`` the model's linear layers keep no extra state, so its load requests no
  ``_extra_state`` item (``torch.nn.Module`` leaves it out of ``state_dict`` when ``get_extra_state`` is the
  base class's).

``expect`` is ``"ok"`` (then every model parameter must equal what ``reference`` loads) or a substring of the
error the load must fail with. Prints ``CASE <name> OK`` / ``CASE <name> FAILED-AS-EXPECTED <error>`` per case.
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path

import typing_extensions

typing.override = typing_extensions.override  # type: ignore[attr-defined]  # megatron.training uses 3.12's

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))

import generate as gen  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def iteration_dir(path: str) -> Path:
    p = Path(path)
    tracker = p / gen.TRACKER_FILENAME
    return p / gen.ITERATION_DIR_FMT.format(int(tracker.read_text())) if tracker.exists() else p


_OWN_EXTRA_STATE: dict = {}


def build_model(saved, no_extra_state: bool, module_names: bool = False):
    """The fixtures' GPT (local spec). ``module_names``: its layers save and request their norms under the module
    names (input_layernorm, pre_mlp_layernorm), i.e. without the spec's sharded_state_dict_keys_map, which maps
    them to Transformer Engine's fused names."""
    from megatron.core.tensor_parallel import layers

    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        own = _OWN_EXTRA_STATE.setdefault(cls, cls.get_extra_state)
        cls.get_extra_state = torch.nn.Module.get_extra_state if no_extra_state else own  # type: ignore[method-assign]
    torch.manual_seed(4321 + dist.get_rank())  # fresh weights differ from the saved ones
    model = gen.build_gpt(saved.num_layers, 1)
    if module_names:
        for layer in model.decoder.layers:
            layer.submodules_config.sharded_state_dict_keys_map = {}
    return model


def requested_keys(request: dict) -> list[str]:
    """The checkpoint keys a load request names (tensors by key, objects by key/shard_<offset>_<shape>)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    keys = set()
    for value in nested_values(request):
        if isinstance(value, ShardedObject):
            keys.add(value.unique_key)
        elif hasattr(value, "key"):
            keys.add(value.key)
    return sorted(keys)


def reference_params(saved, reference: str) -> dict[str, torch.Tensor]:
    """The model parameters as the unedited checkpoint loads them (model section only)."""
    from megatron.core import dist_checkpointing

    model = build_model(saved, False)
    loaded = dist_checkpointing.load({"model": gen.model_sharded_state_dict(model)}, str(iteration_dir(reference)))
    model.load_state_dict(loaded["model"], strict=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def megatron_args(saved, case: dict):
    from megatron.training import arguments, global_vars

    sys.argv = ["load"]
    args = arguments.parse_args(ignore_unknown_args=True)
    for key, value in vars(saved).items():
        setattr(args, key, value)
    world, tp = dist.get_world_size(), dist.get_world_size() // gen.LAYOUT.dp
    for key, value in dict(
        load=str(Path(case["ckpt"])),
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        auto_detect_ckpt_format=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        world_size=world,
        data_parallel_size=world // tp,
        rank=dist.get_rank(),
        use_distributed_optimizer=gen.LAYOUT.distributed_optimizer,
        ckpt_fully_parallel_load=False,
        dist_ckpt_strictness="assume_ok_unexpected",
        no_load_optim="--no-load-optim" in case["flags"],
        no_load_rng="--no-load-rng" in case["flags"],
        finetune="--finetune" in case["flags"],
        pretrained_checkpoint=None,
        exit_on_missing_checkpoint=True,
        non_persistent_ckpt_type=None,
        override_ckpt_iteration=None,
    ).items():
        setattr(args, key, value)
    global_vars._GLOBAL_ARGS = None
    global_vars.set_args(args)
    from megatron.core import num_microbatches_calculator as microbatches

    microbatches.destroy_num_microbatches_calculator()
    microbatches.init_num_microbatches_calculator(
        args.rank, None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    )
    return args


def load_case(saved, case: dict) -> torch.nn.Module:
    if case["via"] == "dist":
        from megatron.core import dist_checkpointing

        model = build_model(saved, case.get("no_extra_state", False), case.get("module_names", False))
        request = {"model": gen.model_sharded_state_dict(model)}
        if case.get("print_keys") and dist.get_rank() == 0:
            say(f"KEYS {case['name']} {json.dumps(requested_keys(request))}")
        strict = case.get("strictness")  # --dist-ckpt-strictness; default: megatron-core's (assume_ok_unexpected)
        if strict is None:
            loaded = dist_checkpointing.load(request, str(iteration_dir(case["ckpt"])))
        else:
            from megatron.core.dist_checkpointing.validation import StrictHandling

            loaded = dist_checkpointing.load(request, str(iteration_dir(case["ckpt"])), strict=StrictHandling(strict))
        # a key the checkpoint lacks stays fresh (log_unexpected drops it from the request, as Megatron-LM loads)
        model.load_state_dict(loaded["model"], strict=not case.get("no_extra_state", False) and strict is None)
        return model
    from megatron.training.checkpointing import load_checkpoint

    megatron_args(saved, case)
    model = build_model(saved, False)
    ddp = gen.wrap_ddp(model)
    optimizer = gen.build_optimizer(ddp)
    scheduler = gen.build_scheduler(optimizer, 100, 4)
    iteration, _ = load_checkpoint([ddp], optimizer, scheduler, strict=True)
    expected = 0 if "--finetune" in case["flags"] else saved.iteration
    assert iteration == expected, (iteration, expected)
    return model


RNG_RESTORES: list[object] = []


def say(line: str) -> None:
    """One line in one write: the ranks of a torchrun share stdout, and print() writes the newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    cases = json.loads(sys.argv[1])
    if "--dp" in sys.argv:
        gen.LAYOUT.dp = int(sys.argv[sys.argv.index("--dp") + 1])
    if "--layout" in sys.argv:
        for name, value in json.loads(sys.argv[sys.argv.index("--layout") + 1]).items():
            setattr(gen.LAYOUT, name, value)
    gen.install_cpu_shims()
    # rng state on CPU: building a request reads a (Philox-shaped) CUDA state; restoring one is counted, not applied
    torch.cuda.get_rng_state = lambda *a, **k: gen._philox_state(0)
    torch.cuda.set_rng_state = RNG_RESTORES.append
    tp, _ = gen.init_distributed(1)
    gen.seed_everything(1234)
    from megatron.core import dist_checkpointing

    for case in cases:
        RNG_RESTORES.clear()
        gen.LAYOUT.distributed_optimizer = case.get("dist_opt", False)
        saved = dist_checkpointing.load_common_state_dict(str(iteration_dir(case["reference"])))["args"]
        try:
            model = load_case(saved, case)
        except BaseException as exc:  # noqa: BLE001 - Megatron exits with SystemExit on some refusals
            message = f"{type(exc).__name__}: {exc} {getattr(exc, 'failures', '')}"
            if case["expect"] != "ok" and case["expect"] in message:
                say(f"CASE {case['name']} FAILED-AS-EXPECTED {message[:300]!r}")
                continue
            raise AssertionError(f"case {case['name']}: {message}") from exc
        assert case["expect"] == "ok", f"case {case['name']}: loaded, but expected {case['expect']!r}"
        want = reference_params(saved, case["reference"])
        got = dict(model.named_parameters())
        assert set(got) == set(want)
        for name, value in want.items():
            assert torch.equal(got[name].detach(), value), f"case {case['name']}: {name} differs from the reference"
        restored = f"rng restored {len(RNG_RESTORES)}"
        say(f"CASE {case['name']} OK rank {dist.get_rank()} tp {tp}: {len(want)} parameters equal, {restored}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
