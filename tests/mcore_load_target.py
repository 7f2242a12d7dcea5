"""Load fixtures at other layouts with real Megatron-LM ``load_checkpoint`` (megatron-core 0.19.2), on CPU.

    python tests/mcore_load_target.py --matrix RESULTS.json [--record] [CELL_ID ...]

runs the cells of tests/can_load_matrix.jsonl (all, or those named), one process group per world size
(``torchrun`` when the world is > 1, the cells of one world one after another in it), and writes what each
load did to RESULTS.json; ``--record`` also stores it as the cells' ``expect`` in the matrix file (run by hand
after adding a cell; tests/test_can_load.py runs ``--matrix`` and compares). The worker mode,

    python tests/mcore_load_target.py CELLS.json RESULTS.json

takes cells of one world size (target given as a dict); ``--readme-table`` prints the matrix as the table of
docs/can-load-matrix.md.
Each
cell builds the loading run the way a fresh launch at the target layout would: Megatron-LM's default args,
overlaid with the checkpoint's saved args (or all of them except the layout ones with ``use_checkpoint_args``),
the target layout, the load flags and ``set`` overrides. It validates the parallelism-derived args with
megatron-core's ``resolve_tensor_parallel_weight_shards`` (what ``TransformerConfig`` runs at startup), builds
the fixture model (fixtures/generate.py) with DDP, optimizer and scheduler, and calls the real
``megatron.training.checkpointing.load_checkpoint``. RESULTS.json gets, per cell, ``loads``, ``fails`` (the
exception type and first line, and the section the failure belongs to) or ``corrupts``: with the distributed
optimizer, the load raised nothing but a model tensor differs from the checkpoint's (read again into a fresh
model), or the optimizer's state exported per parameter differs from the same fixture's load at its saved layout
(a ``reference:`` load run beside the cells). Test code only: CPU shims from fixtures/generate.py.
"""

from __future__ import annotations

import collections
import datetime
import enum
import gc
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import traceback
import typing
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
if not hasattr(typing, "override"):  # megatron.training imports typing.override (Python 3.12)
    typing.override = lambda f: f  # type: ignore[attr-defined]

import generate as gen  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

LAYOUT_ARGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "context_parallel_size",
    "data_parallel_size",
    "world_size",
    "virtual_pipeline_model_parallel_size",  # launch flags (a cell's "vpp"), never the checkpoint's
    "num_layers_per_virtual_pipeline_stage",
)
DERIVED_ARGS = {  # a fresh launch leaves these to megatron (resolved at the launch's TP)
    "tensor_parallel_num_weight_shards": None,
    "gtp_weight_remat_size": 1,
    "expert_tensor_parallel_num_weight_shards": None,
    "expert_gtp_weight_remat_size": 1,
}
# Where a key or a message belongs: the checkpoint sections an error names.
SECTION_PATTERNS = (
    ("args", r"weight_shards|value from checkpoint|must be a multiple|should be divisible|moe_layer_pattern|middle"),
    ("common", r"'tuple' object has no attribute"),
    ("format", r"No such file or directory: '[^']*\.metadata'|not a distributed checkpoint"),
    (
        "optimizer",
        r"optimizer\.|'optimizer'|DistributedOptimizer|per_bucket_numel|parameter group|param_groups|flattened_range",
    ),
    ("rng", r"rng_state"),
    ("rerun", r"rerun_state_machine"),
    # a shape mismatch is the model's unless its key is an optimizer item (a distributed optimizer's bucket)
    (
        "model",
        r"(?<![\w.])(embedding|decoder|output_layer|mtp)\."
        r"|Global shape mismatch(?!.* for key (chained_\d+\.)?optimizer\.)",
    ),
)
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception): .+")


def error_message(exc: BaseException) -> str:
    """The innermost error line (PyTorch DCP wraps each rank's exception in a CheckpointException)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line.strip() for line in text.splitlines() if _ERROR_LINE.match(line.strip())]
    line = lines[-1] if lines else text.splitlines()[0]
    line = line.replace(f"{FIXTURES}/", "fixtures/")  # no machine paths in the recorded matrix
    return re.sub(r"^[\w.]*\.(\w+(Error|Exception): )", r"\1", line)


def sections_of_error(message: str) -> list[str]:
    message = re.sub(r"not in state dict: \[.*", "not in state dict", message, flags=re.S)  # the key list
    return sorted({section for section, pattern in SECTION_PATTERNS if re.search(pattern, message)})


def default_args():
    from megatron.training.arguments import parse_args

    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv


def run_args(cell: dict, saved, iter_dir: Path):
    """The loading run's args: a fresh launch at the target with the saved model args."""
    args = default_args()
    target = cell["target"]
    for name, value in vars(saved).items():
        if name in LAYOUT_ARGS or (name in DERIVED_ARGS and not cell.get("use_checkpoint_args")):
            continue
        setattr(args, name, value)
    if not cell.get("use_checkpoint_args"):
        for name, value in DERIVED_ARGS.items():
            setattr(args, name, value)
    tp, pp, dp = target["tp"], target["pp"], target["dp"]
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.expert_model_parallel_size = target.get("ep", 1)
    args.expert_tensor_parallel_size = target.get("etp", tp)
    args.context_parallel_size = 1
    args.data_parallel_size, args.world_size = dp, tp * pp * dp
    args.rank = dist.get_rank()
    args.load = str(iter_dir.parent)
    args.ckpt_format = "torch_dist"
    args.auto_detect_ckpt_format = False
    args.use_dist_ckpt = True
    args.finetune = bool(cell.get("finetune"))
    args.no_load_optim = bool(cell.get("no_load_optim"))
    args.no_load_rng = bool(cell.get("no_load_rng"))
    args.dist_ckpt_strictness = cell.get("strictness", "assume_ok_unexpected")
    if "use_distributed_optimizer" in cell:
        args.use_distributed_optimizer = cell["use_distributed_optimizer"]
    args.ckpt_fully_parallel_load = False
    args.exit_on_missing_checkpoint = True
    args.global_batch_size = args.micro_batch_size * dp
    for name, value in cell.get("set", {}).items():
        setattr(args, name, value)
    if cell.get("vpp"):  # --num-layers-per-virtual-pipeline-stage: interleaved model chunks
        args.virtual_pipeline_model_parallel_size = cell["vpp"]
        args.num_layers_per_virtual_pipeline_stage = args.num_layers // (pp * cell["vpp"])
        args.global_batch_size = args.micro_batch_size * dp * pp  # the interleaved schedule runs PP micro-batches
    return args


_MOE_CONFIG_KWARGS = gen.moe_config_kwargs


def has_adapters(save_dir: Path) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    iter_dir = save_dir / gen.ITERATION_DIR_FMT.format(int((save_dir / gen.TRACKER_FILENAME).read_text()))
    if not (iter_dir / ".metadata").exists():
        return False
    return any(".adapter." in key for key in FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata)


def build_and_load(cell: dict, args) -> tuple[list[str], bool]:
    """Load the cell's fixture as the run would; (the model tensors the load left unlike the checkpoint's,
    whether the optimizer's state was exported for :func:`optimizer_differences`)."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import resolve_tensor_parallel_weight_shards
    from megatron.core.num_microbatches_calculator import (
        init_num_microbatches_calculator,
        unset_num_microbatches_calculator,
    )
    from megatron.training import checkpointing, global_vars

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    # Startup validation of the parallelism-derived args, as TransformerConfig.__post_init__ runs it.
    resolve_tensor_parallel_weight_shards(tp, args.tensor_parallel_num_weight_shards, args.gtp_weight_remat_size)
    resolve_tensor_parallel_weight_shards(
        args.expert_tensor_parallel_size,
        args.expert_tensor_parallel_num_weight_shards,
        args.expert_gtp_weight_remat_size,
        shards_field="expert_tensor_parallel_num_weight_shards",
        tp_field="expert_tensor_parallel_size",
    )
    gen.LAYOUT.dp = args.data_parallel_size
    gen.LAYOUT.ep = args.expert_model_parallel_size
    gen.LAYOUT.num_experts = args.num_experts
    gen.LAYOUT.distributed_optimizer = bool(args.use_distributed_optimizer)
    gen.LAYOUT.num_query_groups = args.num_query_groups if args.group_query_attention else None
    gen.LAYOUT.qk_layernorm = bool(getattr(args, "qk_layernorm", False))
    gen.LAYOUT.vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    gen.LAYOUT.tie_embeddings = not args.untie_embeddings_and_output_weights
    freq = getattr(args, "moe_layer_freq", 1)
    gen.LAYOUT.moe_layer_freq = list(freq) if isinstance(freq, list) else None
    gen.LAYOUT.moe_shared_expert = getattr(args, "moe_shared_expert_intermediate_size", None)
    gen.LAYOUT.first_stage_layers = getattr(args, "decoder_first_pipeline_num_layers", None)
    gen.LAYOUT.last_stage_layers = getattr(args, "decoder_last_pipeline_num_layers", None)
    gen.LAYOUT.bf16 = bool(getattr(args, "bf16", False))
    gen.LAYOUT.overlap_grad_reduce = bool(getattr(args, "overlap_grad_reduce", False))
    gen.LAYOUT.ddp_bucket_size = getattr(args, "ddp_bucket_size", None)
    # DeepSeek-style models (generate.py --mla --mtp-layers): multi-latent attention, MTP, the shared expert gate
    gen.LAYOUT.mla = bool(getattr(args, "multi_latent_attention", False))
    if gen.LAYOUT.mla:  # MLA's q/kv norms: generate.py's MLA config sets qk_layernorm itself
        gen.LAYOUT.qk_layernorm = False
    gen.LAYOUT.mtp_layers = getattr(args, "mtp_num_layers", None) or 0
    gen.LAYOUT.moe_shared_expert_gate = bool(getattr(args, "moe_shared_expert_gate", False))
    gen.LAYOUT.add_bias = bool(getattr(args, "add_bias_linear", False))
    parallel_state.destroy_model_parallel()
    kwargs = {}
    if args.num_experts:
        kwargs.update(
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        )
        moe_kwargs = _MOE_CONFIG_KWARGS()
        moe_kwargs["expert_tensor_parallel_size"] = args.expert_tensor_parallel_size
        gen.moe_config_kwargs = lambda: dict(moe_kwargs)
    if gen.LAYOUT.vpp:
        kwargs["virtual_pipeline_model_parallel_size"] = gen.LAYOUT.vpp
    # A cell that fails on one rank mid-collective leaves the others waiting: 5 minutes, not megatron's 30.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, distributed_timeout_minutes=5, **kwargs
    )
    gen.seed_everything(1234)
    global_vars.set_args(args)
    unset_num_microbatches_calculator()
    init_num_microbatches_calculator(
        dist.get_rank(), None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    )
    for name in gen.MODEL_DIMS:  # the loading run's model shape (saved args, or --set)
        gen.MODEL_DIMS[name] = getattr(args, name, None) or gen.MODEL_DIMS[name]
    torch.manual_seed(4321)
    if gen.LAYOUT.vpp:  # this rank's model chunks
        chunks = [gen.build_gpt(args.num_layers, pp, vp_stage=i) for i in range(gen.LAYOUT.vpp)]
        model = torch.nn.ModuleList(chunks)
    else:
        model = gen.build_gpt(args.num_layers, pp)
    if has_adapters(Path(args.load)):  # the run's model is the saved one: LoRA adapters on a frozen base
        gen.add_lora(model)
    if args.num_experts:
        gen.redraw_experts(model)
    model = as_run_builds(model)
    ddp = gen.wrap_ddp(model)
    optimizer = gen.build_optimizer(ddp)
    _CELL_OBJECTS.extend([ddp, optimizer])
    if args.use_distributed_optimizer:
        gen.train_one_step(ddp, optimizer, seed=4321)  # a fresh distributed optimizer needs state first
    scheduler = gen.build_scheduler(optimizer, args.train_iters, args.global_batch_size)
    gen.get_rerun_state(0)  # initializes the rerun state machine
    with torch.no_grad():  # distributed optimizer: fp32 main shards are views of the params
        chunks = ddp if isinstance(ddp, list) else [ddp]
        iteration, _ = checkpointing.load_checkpoint(chunks, optimizer, scheduler, strict=True)
    if iteration != (0 if args.finetune else 10):
        raise RuntimeError(f"loaded iteration {iteration}")
    # What can change after a load that raised nothing: the distributed optimizer's state, copied into the fp32
    # main params (views of fp32 model params) and moments; other runs skip the rebuild and the second read.
    if args.finetune or not args.use_distributed_optimizer or args.no_load_optim:
        return [], False
    fresh = (
        [gen.build_gpt(args.num_layers, pp, vp_stage=i) for i in range(gen.LAYOUT.vpp)]
        if gen.LAYOUT.vpp
        else [gen.build_gpt(args.num_layers, pp)]
    )
    if has_adapters(Path(args.load)):
        for module in fresh:
            gen.add_lora(module)
    fresh = [as_run_builds(module) for module in fresh]
    changed = changed_params([c.module for c in chunks], fresh, Path(args.load))
    exported = bool(cell.get("export"))
    if exported:
        export_optimizer(chunks, optimizer, Path(cell["export"]))
    return changed, exported


def export_optimizer(chunks: list, optimizer, out: Path) -> None:
    """Save the optimizer's state after the load in model space (the distributed optimizer's fully_reshardable
    format: one tensor per parameter and state, the same keys and values at any layout) to ``out``, to compare
    with a load at the saved layout: a load that completes may still have put the state on other parameters."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        out.mkdir(parents=True)
    dist.barrier()
    kept = gen.LAYOUT.distributed_optimizer, gen.LAYOUT.optim_sharding_type
    gen.LAYOUT.distributed_optimizer, gen.LAYOUT.optim_sharding_type = True, "fully_reshardable"
    try:
        modules = [c.module for c in chunks]
        if len(modules) == 1:
            state = {"model": gen.model_sharded_state_dict(modules[0])}
        else:
            state = {f"model{i}": gen.model_sharded_state_dict(m) for i, m in enumerate(modules)}
        optim = optimizer.sharded_state_dict(state, is_loading=False, metadata=gen.sharded_metadata())
    finally:
        gen.LAYOUT.distributed_optimizer, gen.LAYOUT.optim_sharding_type = kept
    dist_checkpointing.save({"optimizer": optim}, str(out))


def optimizer_differences(export: Path, reference: Path) -> list[str]:
    """The model-space optimizer tensors of ``export`` whose values differ from ``reference``'s (the same
    fixture loaded at its saved layout), each read whole with torch's DCP reader."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    metadata = [FileSystemReader(str(d)).read_metadata().state_dict_metadata for d in (export, reference)]
    keys = sorted(
        k
        for k, item in metadata[0].items()
        if hasattr(item, "size") and k in metadata[1] and getattr(metadata[1][k], "size", None) == item.size
    )
    values = []
    for directory, items in zip((export, reference), metadata):
        state = {k: torch.empty(tuple(items[k].size), dtype=items[k].properties.dtype) for k in keys}
        dcp_load(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
        values.append(state)
    return [k for k in keys if not torch.equal(values[0][k], values[1][k])]


def as_run_builds(model):
    """``model`` as Megatron-LM's get_model hands it to DDP: with --bf16 every parameter bf16 (Float16Module)."""
    if not gen.LAYOUT.bf16:
        return model
    from megatron.core.transformer.module import Float16Module

    if isinstance(model, torch.nn.ModuleList):  # VPP: each model chunk
        return torch.nn.ModuleList(Float16Module(chunk.config, chunk) for chunk in model)
    return Float16Module(model.config, model)


def changed_params(live: list, fresh: list, save_dir: Path) -> list[str]:
    """The parameters whose values after ``load_checkpoint`` differ from the checkpoint's model section (read
    again into ``fresh``, a new model of the same layout, with ``dist_checkpointing.load``): what a load that
    reports no error put wrong, e.g. an optimizer's buckets copied into the fp32 params they are views of."""
    from megatron.core import dist_checkpointing

    iter_dir = save_dir / gen.ITERATION_DIR_FMT.format(int((save_dir / gen.TRACKER_FILENAME).read_text()))
    # One load for every model chunk (VPP), as load_checkpoint requests them: the sharding is validated globally.
    request = {f"model{i}": model.sharded_state_dict() for i, model in enumerate(fresh)}
    state = dist_checkpointing.load(request, str(iter_dir), strict="assume_ok_unexpected")
    changed = []
    for i, (loaded, model) in enumerate(zip(live, fresh)):
        chunk = state[f"model{i}"]
        model.load_state_dict({k: v for k, v in chunk.items() if k in model.state_dict()}, strict=False)
        reread = dict(model.named_parameters())
        for name, param in loaded.named_parameters():
            if name in reread and not torch.equal(param.detach(), reread[name].detach()):
                changed.append(name)
    return sorted(set(changed))


# Every process group a cell creates (megatron-core's parallel_state makes dozens per initialize_model_parallel, and
# destroy_model_parallel only forgets them): each gloo group keeps its threads and sockets until destroyed, and a
# matrix run that leaked them had thousands of threads spinning per rank (load average ~900 on 2 cores, the world-2
# cells several times slower with every cell).
_CELL_GROUPS: list = []
_CELL_OBJECTS: list = []  # the cell's DDP-wrapped model and optimizer, emptied after it (see _empty_run_objects)
MAX_THREADS_BETWEEN_CELLS = 60  # 13-25 per rank once released; hundreds to thousands when leaked


def _record_new_group(new_group):
    def recording(*args, **kwargs):
        group = new_group(*args, **kwargs)
        _CELL_GROUPS.append(group)
        return group

    return recording


def _empty_run_objects(roots: list) -> None:
    """Clear the attributes of the cell's modules, optimizers, DDP buffers and buckets: DDP's gradient hooks sit
    on autograd nodes (C++), whose closures keep the DDP, its buckets and their process groups alive past any
    ``gc.collect`` (the distributed-optimizer cells each leaked ~20 groups' threads that way)."""
    seen: set[int] = set()
    found: list = []
    pending = list(roots)
    while pending:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, set)):
            pending.extend(obj)
            continue
        if isinstance(obj, dict):
            pending.extend(obj.values())
            continue
        # modules, optimizers and DDP's buffers and buckets only: the configs and enums they reference are shared
        owner = type(obj).__module__
        run_object = owner.startswith(("megatron.core.optimizer", "megatron.core.distributed"))
        if isinstance(obj, enum.Enum) or not hasattr(obj, "__dict__"):
            continue
        if not (run_object or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))):
            continue
        found.append(obj)
        pending.extend(vars(obj).values())
    for obj in found:
        vars(obj).clear()


def release_cell_groups() -> None:
    """Destroy the process groups the last cell created (after a barrier: no rank still uses them)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    dist.barrier()
    parallel_state.destroy_model_parallel()
    destroy_moe_metrics_tracker()  # sized by the first MoE model's layers: a later model with more raised IndexError
    live = dist.distributed_c10d._world.pg_map
    for group in _CELL_GROUPS:
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and group in live:
            dist.destroy_process_group(group)
    _CELL_GROUPS.clear()
    _empty_run_objects(_CELL_OBJECTS)
    _CELL_OBJECTS.clear()
    parallel_state._global_process_group_list = None  # its references would keep the groups' threads running
    gc.collect()  # the last cell's model, DDP and optimizer (reference cycles) hold groups too
    tasks = Path("/proc/self/task")
    threads = [t.name for t in tasks.iterdir()] if tasks.is_dir() else []
    if len(threads) > MAX_THREADS_BETWEEN_CELLS:  # a leak again: fail now rather than slow every later cell
        names = collections.Counter((tasks / t / "comm").read_text().strip() for t in threads)
        raise RuntimeError(f"{len(threads)} threads after a cell's groups were released (leaked groups?): {names}")


def run_cell(cell: dict) -> dict:
    from megatron.core import dist_checkpointing

    fixture = FIXTURES / cell["fixture"]
    iter_dir = fixture / gen.ITERATION_DIR_FMT.format(int((fixture / gen.TRACKER_FILENAME).read_text()))
    try:
        saved = dist_checkpointing.load_common_state_dict(str(iter_dir))["args"]
        changed, exported = build_and_load(cell, run_args(cell, saved, iter_dir))
    except BaseException as exc:  # SystemExit included: Megatron exits on some load errors
        if os.environ.get("MCORE_LOAD_TRACE"):
            traceback.print_exc()
        full = f"{type(exc).__name__}: {exc}"
        return {"outcome": "fails", "error": error_message(exc)[:400], "sections": sections_of_error(full)}
    result: dict = {"outcome": "loads", "changed": changed}
    if exported:
        result["export"] = cell["export"]
    return result


MATRIX = Path(__file__).resolve().parent / "can_load_matrix.jsonl"


def parse_target(spec: str) -> dict:
    target = {k.strip(): int(v) for k, v in (part.split("=") for part in spec.split(","))}
    return {"tp": 1, "pp": 1, "dp": 1, **target}


def reference_cell(fixture: str) -> dict | None:
    """A resume of ``fixture`` at its saved layout (None without the distributed optimizer): the model-space
    optimizer state every other load of it must reproduce."""
    from ckptdoctor.args import args_as_dict
    from ckptdoctor.checkpoint import open_checkpoint

    args = args_as_dict(open_checkpoint(FIXTURES / fixture).args)
    if not args.get("use_distributed_optimizer"):
        return None
    tp, pp = args.get("tensor_model_parallel_size") or 1, args.get("pipeline_model_parallel_size") or 1
    target = {"tp": tp, "pp": pp, "dp": args.get("data_parallel_size") or 1}
    target["ep"] = args.get("expert_model_parallel_size") or 1
    target["etp"] = args.get("expert_tensor_parallel_size") or tp
    cell = {"id": f"reference:{fixture}", "fixture": fixture, "target": target}
    if args.get("virtual_pipeline_model_parallel_size"):  # the saved model chunks per rank
        cell["vpp"] = args["virtual_pipeline_model_parallel_size"]
    return cell


def verdict_of(result: dict, references: dict[str, dict]) -> dict:
    """A cell's recorded outcome: ``corrupts`` where the load completed but a model tensor differs from the
    checkpoint's, or a model-space optimizer tensor from the fixture's load at its saved layout."""
    changed, export, fixture = result.pop("changed", []), result.pop("export", None), result.pop("fixture")
    if result["outcome"] != "loads":
        return result
    reference = references.get(fixture)
    wrong = optimizer_differences(Path(export), Path(reference["export"])) if export and reference else []
    if not changed and not wrong:
        return result
    parts = []
    if changed:
        parts.append(f"{len(changed)} model tensors differ from the checkpoint's after the load (e.g. {changed[0]})")
    if wrong:
        parts.append(f"{len(wrong)} optimizer tensors differ from a load at the saved layout (e.g. {wrong[0]})")
    sections = (["model"] if changed else []) + (["optimizer"] if wrong else [])
    return {**result, "outcome": "corrupts", "error": "no error raised; " + "; ".join(parts), "sections": sections}


def run_matrix(out: Path, record: bool, only: list[str]) -> None:
    """Every cell (or those in ``only``), grouped by world size, each group one (torchrun) process group; a
    fixture saved with the distributed optimizer is also loaded at its saved layout, the reference its other
    loads' optimizer state is compared with."""
    rows = [json.loads(line) for line in MATRIX.read_text().splitlines() if line.strip()]
    groups: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cells = []
        for row in rows:
            if only and row["id"] not in only:
                continue
            cell = {k: v for k, v in row.items() if k != "expect"}
            cell["target"] = parse_target(row["target"])
            cells.append(cell)
        references = [r for f in sorted({c["fixture"] for c in cells}) if (r := reference_cell(f))]
        for cell in cells + references:
            cell["export"] = str(Path(tmp, "exports", cell["id"].replace(":", "_")))
            t = cell["target"]
            groups.setdefault(t["tp"] * t["pp"] * t["dp"], []).append(cell)
        fixture_of = {c["id"]: c["fixture"] for c in cells + references}
        results: dict[str, dict] = {}
        for world, group in sorted(groups.items()):
            cells_path, out_path = Path(tmp, f"cells{world}.json"), Path(tmp, f"out{world}.json")
            cells_path.write_text(json.dumps(group))
            launcher = [sys.executable]
            if world > 1:
                launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port"]
                launcher += [str(gen._free_port())]
            proc = subprocess.run([*launcher, __file__, str(cells_path), str(out_path)], capture_output=True, text=True)
            if proc.returncode or not out_path.exists():
                raise SystemExit(f"world {world}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            results.update({r["id"]: r for r in json.loads(out_path.read_text())})
        by_fixture = {
            fixture_of[i]: r for i, r in results.items() if i.startswith("reference:") and r["outcome"] == "loads"
        }
        results = {
            i: verdict_of({**r, "fixture": fixture_of[i]}, by_fixture)
            for i, r in results.items()
            if not i.startswith("reference:")
        }
    out.write_text(json.dumps(results, indent=1) + "\n")
    if record:
        lines = []
        for row in rows:
            if row["id"] in results:
                row["expect"] = {k: v for k, v in results[row["id"]].items() if k != "id"}
            lines.append(json.dumps(row))
        MATRIX.write_text("\n".join(lines) + "\n")


def readme_table() -> str:
    """The matrix as docs/can-load-matrix.md's markdown table (``--readme-table``)."""
    lines = ["| cell | checkpoint | target | loading run | real load (megatron-core 0.19.2) |", "|---|---|---|---|---|"]
    for row in (json.loads(line) for line in MATRIX.read_text().splitlines() if line.strip()):
        flags = [f"`--{k.replace('_', '-')}`" for k in ("finetune", "no_load_optim", "no_load_rng") if row.get(k)]
        flags += ["`--use-checkpoint-args`"] if row.get("use_checkpoint_args") else []
        flags += [f"`--strictness {row['strictness']}`"] if row.get("strictness") else []
        if "use_distributed_optimizer" in row:
            flags.append(f"`--{'' if row['use_distributed_optimizer'] else 'no-'}use-distributed-optimizer`")
        flags += [f"`--set {k}={v}`" for k, v in row.get("set", {}).items()]
        flags += [f"`--num-virtual-stages-per-pipeline-rank {row['vpp']}`"] if row.get("vpp") else []
        expect = row["expect"]
        error = expect.get("error", "").replace("`", "'").replace("|", "\\|")
        error = error[:110] + ("..." if len(error) > 110 else "")
        shown = {"fails": "**fails**", "corrupts": "**loads wrong**"}.get(expect["outcome"])
        outcome = f"{shown} ({', '.join(expect['sections'])}): {error}" if shown else "loads"
        lines.append(f"| {row['id']} | {row['fixture']} | {row['target']} | {' '.join(flags)} | {outcome} |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1] == "--readme-table":
        print(readme_table())
        return
    if sys.argv[1] == "--matrix":
        rest = sys.argv[3:]
        run_matrix(Path(sys.argv[2]), "--record" in rest, [a for a in rest if a != "--record"])
        return
    cells = json.loads(Path(sys.argv[1]).read_text())
    gen.install_cpu_shims()
    torch.cuda.get_rng_state = lambda *a, **k: gen._philox_state(torch.initial_seed())
    torch.cuda.set_rng_state = lambda *a, **k: None
    logging.disable(logging.INFO)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(gen._free_port()))
    # the world group's own collectives (one per cell) wait at most 20 min; the cells' groups 5 (see build_and_load)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1200))
    dist.new_group = dist.distributed_c10d.new_group = _record_new_group(dist.distributed_c10d.new_group)
    results = []
    for cell in cells:
        mine = run_cell(cell)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        failed = [r for r in every if r["outcome"] == "fails"]
        if failed:
            results.append({"id": cell["id"], **failed[0]})
        else:  # the model tensors any rank found changed
            results.append({"id": cell["id"], **mine, "changed": sorted({k for r in every for k in r["changed"]})})
        if dist.get_rank() == 0:
            print(json.dumps(results[-1]), flush=True)
        release_cell_groups()
    if dist.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
