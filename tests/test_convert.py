"""convert --to fsdp_dtensor on the real torch_dist fixtures: the output is read by torch DCP's own ``dcp.load`` with
the key set Megatron-FSDP requests (derived below from megatron-core's naming, independently of the converter),
values equal to the source's; dry run lists every mapping; an interrupted write leaves no output."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from conftest import FIXTURES, file_digests, run_cli

from ckptdoctor.atomic import FAULT_ENV, FAULT_EXIT_CODE, FAULT_MODE_ENV
from ckptdoctor.cli import main

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

ITER = "iter_0000010"


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _source_tensor(save, key):
    """A torch_dist tensor loaded by torch DCP itself from the source (Megatron saves it unflattened)."""
    metadata = dcp.FileSystemReader(str(save / ITER)).read_metadata()
    md = metadata.state_dict_metadata[key]
    value = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    dcp.load({key: value}, checkpoint_id=str(save / ITER), planner=dcp.DefaultLoadPlanner(flatten_state_dict=False))
    return value


def _fsdp_requests(save):
    """The state dict Megatron-FSDP asks a fsdp_dtensor save for, per megatron-core's conventions: the model's
    named params (``model.module.`` + one key per layer, SwiGLU fc1 as ``weight_w``/``weight_v``,
    ``handle_swiglu_in_state_dict``) and Adam's ``exp_avg``/``exp_avg_sq`` under
    ``optimizer.state.module.module.module.<param>``; each key -> (source key, layer or None, half or None)."""
    metadata = dcp.FileSystemReader(str(save / ITER)).read_metadata()
    requests = {}
    for key, md in metadata.state_dict_metadata.items():
        if not hasattr(md, "size") or key.startswith(("rng_state", "rerun_state", "common_state")):
            continue
        stat = None
        param = key
        match = re.match(r"optimizer\.state\.(exp_avg|exp_avg_sq)\.(.+)", key)
        if match:
            stat, param = match.group(1), match.group(2)
        layers = range(md.size[0]) if ".layers." in param else [None]
        for layer in layers:
            name = param if layer is None else param.replace(".layers.", f".layers.{layer}.")
            halves = ["w", "v"] if name.endswith("mlp.linear_fc1.weight") else [None]
            for half in halves:
                full = name if half is None else f"{name}_{half}"
                out = f"model.module.{full}" if stat is None else f"optimizer.state.module.module.module.{full}.{stat}"
                requests[out] = (key, layer, half)
    return requests


@pytest.mark.parametrize("fixture", ["core019_tp1", "core019_tp2"])
def test_fsdp_dtensor_output_loads_with_torch_dcp_and_equals_the_source(capsys, tmp_path, fixture):
    save = FIXTURES / fixture
    out = tmp_path / "fsdp"
    rc, text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", out)
    assert rc == 0, err
    assert "written" in text
    requests = _fsdp_requests(save)
    assert any(k.endswith("linear_fc1.weight_w") for k in requests)
    target = dcp.FileSystemReader(str(out / ITER)).read_metadata().state_dict_metadata
    state = {}
    for key in requests:
        md = target[key]
        state[key] = torch.full(tuple(md.size), float("nan"), dtype=md.properties.dtype)
    state["args"] = None
    state["iteration"] = None
    dcp.load(state, checkpoint_id=str(out / ITER))
    sources = {}
    for key, (source, layer, half) in requests.items():
        if source not in sources:
            sources = {source: _source_tensor(save, source)}
        expected = sources[source] if layer is None else sources[source][layer]
        if half is not None:
            expected = torch.chunk(expected, 2, dim=0)[0 if half == "w" else 1]
        assert torch.equal(state[key], expected), key
    assert state["iteration"] == 10
    assert state["args"].ckpt_format == "fsdp_dtensor"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "10"
    # ckptdoctor reads it back as Megatron-FSDP's format
    rc, text, err = _run(capsys, "inspect", out)
    assert rc == 0 and "Megatron-FSDP fsdp_dtensor" in text, err


@pytest.mark.parametrize("fixture", ["core019_tp1", "core019_tp2", "core019_peft_trainable_tp1"])
def test_round_trip_is_bit_identical_in_values(capsys, tmp_path, fixture):
    """Both directions, values bit-identical. The trainable-params-only save (no linear_fc1 weight: no _w/_v keys
    in its fsdp_dtensor form) reads back as fsdp_dtensor by its args (it was refused as "torch_dcp")."""
    save = FIXTURES / fixture
    rc, _text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp")
    assert rc == 0, err
    rc, text, err = _run(capsys, "convert", tmp_path / "fsdp", "--to", "torch_dist", "-o", tmp_path / "back")
    assert rc == 0, err
    assert "layers stacked" in text
    back = tmp_path / "back" / ITER
    assert (back / "common.pt").is_file()
    assert json.loads((back / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    # model and optimizer tensors bit-identical, args and the rest of the common state equal; what fsdp_dtensor
    # cannot carry (extra state, per-rank RNG and rerun states) left out; the chunk grid is the writer's own
    excluded = "_extra_state|rng_state|rerun_state_machine_state"
    rc, text, err = _run(capsys, "diff", save, tmp_path / "back", "--values", "--exclude", excluded, "--ignore-layout")
    assert rc == 0, text + err
    assert " 0 differ" in text and "args: 0 differ" in text
    rc, text, _err = _run(capsys, "diff", save, tmp_path / "back", "--values", "--ignore-layout")
    assert rc == 1 and "rng_state" in text  # without the exclusion the dropped items show


def test_to_torch_dist_refuses_a_torch_dist_source(capsys):
    rc, _out, err = _run(capsys, "convert", FIXTURES / "core019_tp1", "--to", "torch_dist")
    assert rc == 2 and "reads a Megatron-FSDP fsdp_dtensor save, not this one (torch_dist, " in err, err


def test_dry_run_lists_every_mapping_and_writes_nothing(capsys, tmp_path):
    save = FIXTURES / "core019_tp2"
    rc, out, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "--format", "json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["schema"] == "ckptdoctor.convert/1" and report["dry_run"] and report["result"] is None
    targets = {t for m in report["plan"]["mappings"] for t in m["targets"]}
    assert set(_fsdp_requests(save)) <= targets
    sources = {m["source"] for m in report["plan"]["mappings"]} | {n["key"] for n in report["plan"]["not_carried"]}
    metadata = dcp.FileSystemReader(str(save / ITER)).read_metadata()
    # every source key is either mapped or listed as not carried, with why
    assert {k for k in metadata.state_dict_metadata if not k.startswith("common_state")} <= sources
    assert any("_extra_state" in n["key"] for n in report["plan"]["not_carried"])
    rc, out, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor")
    assert rc == 0 and "decoder.layers.mlp.linear_fc1.weight" in out and "-> model.module.decoder.layers.1" in out
    assert "dry run" in out
    rc, out, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", tmp_path / "o", "--dry-run")
    assert rc == 0 and "dry run" in out and not (tmp_path / "o").exists(), err


@pytest.mark.parametrize("step", ["convert:staging-created", "convert:chunk-written", "convert:before-swap"])
def test_interrupted_convert_leaves_no_output(tmp_path, step):
    source = FIXTURES / "core019_tp1"
    before = file_digests(source / ITER)
    out = tmp_path / "fsdp"
    env = dict(os.environ, **{FAULT_ENV: step})
    proc = run_cli("convert", str(source), "--to", "fsdp_dtensor", "-o", str(out), env=env)
    assert proc.returncode == FAULT_EXIT_CODE, proc.stderr
    assert not out.exists()
    assert file_digests(source / ITER) == before
    # the killed run's staging dir is hidden beside the output and never takes the output's name
    assert all(p.name.startswith(".fsdp") for p in tmp_path.iterdir())


def test_ctrl_c_while_converting_removes_the_staging_dir(tmp_path):
    env = dict(os.environ, **{FAULT_ENV: "convert:chunk-written", FAULT_MODE_ENV: "sigint"})
    proc = run_cli("convert", str(FIXTURES / "core019_tp1"), "--to", "fsdp_dtensor", "-o", str(tmp_path / "o"), env=env)
    assert proc.returncode == 130, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_an_output_only_once_the_new_one_is_complete(capsys, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "old").write_text("x")
    rc, _text, err = _run(capsys, "convert", FIXTURES / "core019_tp1", "--to", "fsdp_dtensor", "-o", out, "--force")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == [ITER, "latest_checkpointed_iteration.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_dry_run_is_metadata_only():
    proc = run_cli("convert", str(FIXTURES / "core019_tp2"), "--to", "fsdp_dtensor", block=("torch", "megatron"))
    assert proc.returncode == 0, proc.stderr
    assert "-> model.module.decoder.layers.0.mlp.linear_fc1.weight_w" in proc.stdout
    assert "IMPORTED:\n" in proc.stderr


def test_refuses_a_non_torch_dist_source_and_an_existing_output(capsys, tmp_path):
    rc, _out, err = _run(capsys, "convert", FIXTURES / "dcp" / "fsdp2_titan_ws1", "--to", "fsdp_dtensor")
    assert rc == 2 and "torch_dist" in err
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("x")
    rc, _out, err = _run(capsys, "convert", FIXTURES / "core019_tp1", "--to", "fsdp_dtensor", "-o", tmp_path / "o")
    assert rc == 2 and "not empty" in err


def _load_fsdp(out, keys):
    """The listed tensors of a fsdp_dtensor save, loaded by torch DCP itself (NaN-filled first)."""
    target = dcp.FileSystemReader(str(out / ITER)).read_metadata().state_dict_metadata
    state = {k: torch.full(tuple(target[k].size), float("nan"), dtype=target[k].properties.dtype) for k in keys}
    dcp.load(state, checkpoint_id=str(out / ITER))
    return state


def _expert_requests(save, grouped):
    """Megatron-FSDP's per-expert parameter names (``get_global_unique_param_name`` with
    ``handle_experts_in_state_dict``: the global expert index; ``weight<E>`` for TEGroupedMLP,
    ``local_experts.<E>.`` for SequentialMLP; fc1 split in ``_w``/``_v``) for the source's stacked expert tensors:
    output key -> (source key, leading indices, half)."""
    metadata = dcp.FileSystemReader(str(save / ITER)).read_metadata()
    requests = {}
    for key, md in metadata.state_dict_metadata.items():
        match = re.match(
            r"(optimizer\.state\.(exp_avg|exp_avg_sq)\.)?(.+)\.experts\.experts\.(linear_fc[12])\.weight$", key
        )
        if not hasattr(md, "size") or not match:
            continue
        stat, head, fc = match.group(2), match.group(3), match.group(4)
        stacked = ".layers." in head and not re.search(r"layers\.\d+\.", head)
        layers = range(md.size[0]) if stacked else [None]
        for layer in layers:
            name = head if layer is None else head.replace(".layers.", f".layers.{layer}.")
            if name.startswith("mtp."):  # Megatron-FSDP's name of an MTP layer's transformer layer
                name = name.replace(".transformer_layer.", ".mtp_model_layer.")
            for expert in range(md.size[1 if stacked else 0]):
                param = (
                    f"{name}.experts.{fc}.weight{expert}"
                    if grouped
                    else f"{name}.experts.local_experts.{expert}.{fc}.weight"
                )
                for half in ["w", "v"] if fc == "linear_fc1" else [None]:
                    full = param if half is None else f"{param}_{half}"
                    out = (
                        f"model.module.{full}"
                        if stat is None
                        else f"optimizer.state.module.module.module.{full}.{stat}"
                    )
                    lead = (expert,) if layer is None else (layer, expert)
                    requests[out] = (key, lead, half)
    return requests


def _check_requests(save, out, requests):
    state = _load_fsdp(out, requests)
    sources = {}
    for key, (source, lead, half) in requests.items():
        if source not in sources:
            sources = {source: _source_tensor(save, source)}
        expected = sources[source][lead]
        if half is not None:
            expected = torch.chunk(expected, 2, dim=0)[0 if half == "w" else 1]
        assert torch.equal(state[key], expected), key


@pytest.mark.parametrize(
    ("fixture", "expert_keys"),
    [
        ("core019_moe_ep2", 2 * 4 * 3 * 3),  # 2 layers x 4 experts x (fc1 halves, fc2) x (model, two Adam stats)
        ("core019_moe_mixed_shared_ep2", 4 * 3 * 3),  # the MoE layer only
        ("core019_deepseek_mtp", 2 * 4 * 3),  # the MoE layer and the MTP layer's, no optimizer state
    ],
)
def test_moe_experts_become_one_key_per_expert_and_round_trip_bit_identical(capsys, tmp_path, fixture, expert_keys):
    save = FIXTURES / fixture
    rc, text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp")
    assert rc == 0, err
    assert "per-expert split, SwiGLU split" in text
    requests = _expert_requests(save, grouped=False)
    assert len(requests) == expert_keys
    _check_requests(save, tmp_path / "fsdp", requests)
    # the dense layers and the shared expert are split as in a dense model
    names = dcp.FileSystemReader(str(tmp_path / "fsdp" / ITER)).read_metadata().state_dict_metadata
    if fixture != "core019_moe_ep2":
        assert "model.module.decoder.layers.1.mlp.shared_experts.linear_fc1.weight_v" in names
        assert "model.module.decoder.layers.0.mlp.linear_fc1.weight_w" in names
    if fixture == "core019_deepseek_mtp":
        # DeepSeek-style: MLA projections renamed only, the sigmoid router's expert bias kept (fp32) in the
        # decoder's and the MTP layer's MoE, whose experts are numbered as the decoder's
        mtp = "model.module.mtp.layers.0.mtp_model_layer."
        assert f"{mtp}mlp.experts.local_experts.3.linear_fc1.weight_v" in names
        assert f"{mtp}mlp.shared_experts.linear_fc1.weight_w" in names
        assert f"{mtp}self_attention.linear_kv_down_proj.weight" in names
        for bias in ("model.module.decoder.layers.1.mlp.router.expert_bias", f"{mtp}mlp.router.expert_bias"):
            assert names[bias].properties.dtype == torch.float32, bias
        assert not any("transformer_layer" in k for k in names)
    rc, text, err = _run(capsys, "convert", tmp_path / "fsdp", "--to", "torch_dist", "-o", tmp_path / "back")
    assert rc == 0, err
    assert "experts stacked, SwiGLU halves joined" in text
    excluded = "_extra_state|rng_state|rerun_state_machine_state"
    rc, text, err = _run(capsys, "diff", save, tmp_path / "back", "--values", "--exclude", excluded, "--ignore-layout")
    assert rc == 0, text + err
    assert " 0 differ" in text and "no differences" in text
    # a block of dense and MoE layers stays per layer (as torch_dist saves it); a uniform one is stacked again
    back = dcp.FileSystemReader(str(tmp_path / "back" / ITER)).read_metadata().state_dict_metadata
    assert set(back) >= {
        k
        for k in dcp.FileSystemReader(str(save / ITER)).read_metadata().state_dict_metadata
        if "_extra_state" not in k and not k.startswith(("rng_state", "rerun", "common_state"))
    }


def test_grouped_gemm_experts_are_named_weight_e(capsys, tmp_path):
    """With moe_grouped_gemm in the saved args the experts are TEGroupedMLP's ``linear_fc1.weight<E>``
    (``weight<E>_w`` halves), and they come back to the same stacked torch_dist keys."""
    save = tmp_path / "grouped"
    rc, _text, err = _run(
        capsys, "fix-args", FIXTURES / "core019_moe_ep2", "--set", "moe_grouped_gemm=true", "-o", save
    )
    assert rc in (0, 1), err
    rc, _text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp")
    assert rc == 0, err
    requests = _expert_requests(save, grouped=True)
    assert "model.module.decoder.layers.1.mlp.experts.linear_fc1.weight3_v" in requests
    _check_requests(save, tmp_path / "fsdp", requests)
    rc, _text, err = _run(capsys, "convert", tmp_path / "fsdp", "--to", "torch_dist", "-o", tmp_path / "back")
    assert rc == 0, err
    excluded = "_extra_state|rng_state|rerun_state_machine_state"
    rc, text, err = _run(capsys, "diff", save, tmp_path / "back", "--values", "--exclude", excluded, "--ignore-layout")
    assert rc == 0, text + err


def test_fully_reshardable_optimizer_state_is_carried_and_round_trips(capsys, tmp_path):
    """A fully_reshardable distributed optimizer saves per-parameter state (exp_avg, exp_avg_sq, the fp32 master
    param): each goes under Megatron-FSDP's optimizer prefix, split as its parameter is, and comes back
    bit-identical, param groups back under optimizer.optimizer where the distributed optimizer keeps them."""
    save = FIXTURES / "core019_tp2_dp2_fully_reshardable"
    rc, text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp")
    assert rc == 0, err
    assert "optimizer.distributed" not in text and "dp_reshardable" not in text
    state = _load_fsdp(
        tmp_path / "fsdp",
        [
            "optimizer.state.module.module.module.decoder.layers.1.mlp.linear_fc1.weight_v.exp_avg",
            "optimizer.state.module.module.module.decoder.layers.1.mlp.linear_fc1.weight_v.param",
        ],
    )
    for stat in ("exp_avg", "param"):
        expected = torch.chunk(
            _source_tensor(save, f"optimizer.state.{stat}.decoder.layers.mlp.linear_fc1.weight")[1], 2
        )[1]
        got = state[f"optimizer.state.module.module.module.decoder.layers.1.mlp.linear_fc1.weight_v.{stat}"]
        assert torch.equal(got, expected), stat
    rc, _text, err = _run(capsys, "convert", tmp_path / "fsdp", "--to", "torch_dist", "-o", tmp_path / "back")
    assert rc == 0, err
    excluded = "_extra_state|rng_state|rerun_state_machine_state"
    rc, text, err = _run(capsys, "diff", save, tmp_path / "back", "--values", "--exclude", excluded, "--ignore-layout")
    assert rc == 0, text + err
    assert "no differences" in text


def test_dp_reshardable_buckets_are_listed_as_not_carried_with_why(capsys):
    rc, out, err = _run(capsys, "convert", FIXTURES / "core019_tp2_dp2", "--to", "fsdp_dtensor", "--format", "json")
    assert rc == 0, err
    why = {n["key"]: n["why"] for n in json.loads(out)["plan"]["not_carried"]}
    buckets = [k for k in why if k.startswith("optimizer.distributed.")]
    assert len(buckets) == 12  # 2 DP groups x (exp_avg, exp_avg_sq, param, optimizer, per_bucket_numel(_unpadded))
    assert all("dp_reshardable" in why[k] and "fully-reshardable" in why[k] for k in buckets)


def _tree_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fixture", ["core019_tp2", "core019_moe_ep2", "core019_bf16_dp2_fully_reshardable"])
def test_jobs_gives_the_same_bytes_both_ways(capsys, tmp_path, fixture):
    """--jobs N spreads the source's data files over worker processes, each writing its own output file: the
    output is byte for byte the same at any --jobs (units are cut by the source alone, records joined in order)."""
    save = FIXTURES / fixture
    outs = {}
    for jobs in (1, 3):
        out = tmp_path / f"fsdp{jobs}"
        rc, _text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", out, "--jobs", jobs)
        assert rc == 0, err
        back = tmp_path / f"back{jobs}"
        rc, _text, err = _run(capsys, "convert", out, "--to", "torch_dist", "-o", back, "--jobs", jobs)
        assert rc == 0, err
        outs[jobs] = (_tree_bytes(out), _tree_bytes(back))
    assert outs[1] == outs[3]
    forward, _back = outs[1]
    assert sum(name.endswith(".distcp") for name in forward) == 3  # two source data files, then the common items


BF16 = "core019_bf16_dp2_fully_reshardable"
EXCLUDED = "_extra_state|rng_state|rerun_state_machine_state"


def _model_requests(save):
    """:func:`_fsdp_requests`' model keys (``model.module.<param>``, one per layer, SwiGLU halves)."""
    requests = _fsdp_requests(save).items()
    return {k: v for k, v in requests if k.startswith("model.module.") and not k.startswith("model.module.optimizer.")}


def test_bf16_model_module_holds_the_fp32_main_params(capsys, tmp_path):
    """bf16 params with the distributed optimizer's fp32 main params: Megatron-FSDP's state dict holds the main
    params under ``model.module.<name>`` (megatron_fsdp.py's state-dict pre-hook swaps in the optimizer's params,
    built on the fp32 main-weight buffer) and keeps no ``param`` optimizer state. So the output's model keys are
    the source's fp32 ``optimizer.state.param`` values, split as their parameter is; the bf16 model copy (the main
    params rounded, as the fixture shows) is listed as not carried."""
    save = FIXTURES / BF16
    rc, text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp")
    assert rc == 0, err
    assert "precision       torch.bfloat16 model, fp32 main params: model.module.* holds them, 9 from" in text
    requests = _model_requests(save)
    assert len(requests) == 17  # embedding, output layer, final norm, 2 layers x (qkv, proj, fc1 halves, fc2, 2 norms)
    state = _load_fsdp(tmp_path / "fsdp", requests)
    sources = {}
    for key, (source, layer, half) in requests.items():
        if source not in sources:
            model = _source_tensor(save, source)
            main = _source_tensor(save, f"optimizer.state.param.{source}")
            assert model.dtype == torch.bfloat16 and main.dtype == torch.float32
            assert torch.equal(main.to(torch.bfloat16), model), source  # the model copy is the main params rounded
            sources = {source: main}
        expected = sources[source] if layer is None else sources[source][layer]
        if half is not None:
            expected = torch.chunk(expected, 2, dim=0)[0 if half == "w" else 1]
        assert state[key].dtype == torch.float32 and torch.equal(state[key], expected), key
    names = dcp.FileSystemReader(str(tmp_path / "fsdp" / ITER)).read_metadata().state_dict_metadata
    assert not any(k.endswith(".param") for k in names)  # the main params are model.module's, not optimizer state
    assert "model.module.decoder.layers.1.mlp.linear_fc1.weight_v" in names
    rc, out, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "--format", "json")
    assert rc == 0, err
    plan = json.loads(out)["plan"]
    assert plan["model_dtype"] == "torch.bfloat16"
    why = {n["key"]: n["why"] for n in plan["not_carried"]}
    assert "fp32 main params" in why["decoder.layers.mlp.linear_fc2.weight"]
    mains = {m["source"]: m["targets"] for m in plan["mappings"] if m["source"].startswith("optimizer.state.param.")}
    assert mains["optimizer.state.param.decoder.layers.mlp.linear_fc2.weight"] == [
        "model.module.decoder.layers.0.mlp.linear_fc2.weight",
        "model.module.decoder.layers.1.mlp.linear_fc2.weight",
    ]


def test_bf16_round_trip_is_bit_identical_in_values_and_dtypes(capsys, tmp_path):
    """Back to torch_dist, the model goes back to the dtype the args say (bf16: the fp32 values rounded to
    nearest, as Megatron's optimizer copies main params to the model) and the fp32 values stay the optimizer's
    ``param`` state: model and optimizer bit-identical to the source, every dtype as saved."""
    save = FIXTURES / BF16
    rc, _text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp")
    assert rc == 0, err
    rc, text, err = _run(capsys, "convert", tmp_path / "fsdp", "--to", "torch_dist", "-o", tmp_path / "back")
    assert rc == 0, err
    assert "17 source keys cast to torch.bfloat16" in text
    assert "model.module.decoder.layers.0.mlp.linear_fc2.weight  (layers stacked, cast to torch.bfloat16)" in text
    rc, text, err = _run(capsys, "diff", save, tmp_path / "back", "--values", "--exclude", EXCLUDED, "--ignore-layout")
    assert rc == 0, text + err
    assert "kind/dtype/shape changes: 0" in text and "36 compared, 36 equal" in text and "no differences" in text


def test_bf16_without_optimizer_state_casts_the_model_up(capsys, tmp_path):
    """Saved without optimizer state there are no main params to take: the bf16 model is cast up to fp32 (the
    main-weight buffer's dtype), which the round trip casts back without loss."""
    save = tmp_path / "no_optim"
    rc, _text, err = _run(capsys, "edit", FIXTURES / BF16, "--drop-section", "optimizer", "-o", save)
    assert rc == 0, err
    rc, text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp")
    assert rc == 0, err
    assert "0 from optimizer.state.param, 9 cast up from the model copy" in text
    assert "decoder.layers.mlp.linear_fc2.weight  (per-layer split, cast to torch.float32)" in text
    requests = _model_requests(save)
    state = _load_fsdp(tmp_path / "fsdp", requests)
    for key, (source, layer, half) in requests.items():
        expected = _source_tensor(save, source).float()
        expected = expected if layer is None else expected[layer]
        if half is not None:
            expected = torch.chunk(expected, 2, dim=0)[0 if half == "w" else 1]
        assert state[key].dtype == torch.float32 and torch.equal(state[key], expected), key
    rc, _text, err = _run(capsys, "convert", tmp_path / "fsdp", "--to", "torch_dist", "-o", tmp_path / "back")
    assert rc == 0, err
    rc, text, err = _run(capsys, "diff", save, tmp_path / "back", "--values", "--exclude", EXCLUDED, "--ignore-layout")
    assert rc == 0 and "no differences" in text, text + err


def test_main_params_missing_from_a_fsdp_dtensor_save_come_from_its_model(capsys, tmp_path):
    """Megatron-FSDP keeps no ``param`` optimizer state (its model holds the main params): a save without one,
    whose args say the distributed optimizer, gets each parameter's ``optimizer.state.param`` from its fp32 model
    tensor on the way back, as a fully_reshardable torch_dist save holds it; here identical to the source's."""
    save = FIXTURES / "core019_tp2_dp2_fully_reshardable"
    rc, _text, err = _run(capsys, "convert", save, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp")
    assert rc == 0, err
    rc, _text, err = _run(capsys, "edit", tmp_path / "fsdp", "--remove", r"\.param$", "-o", tmp_path / "no_param")
    assert rc == 0, err
    rc, text, err = _run(capsys, "convert", tmp_path / "no_param", "--to", "torch_dist", "-o", tmp_path / "back")
    assert rc == 0, err
    assert "    -> optimizer.state.param.decoder.layers.mlp.linear_fc2.weight" in text
    rc, text, err = _run(capsys, "diff", save, tmp_path / "back", "--values", "--exclude", EXCLUDED, "--ignore-layout")
    assert rc == 0 and "no differences" in text, text + err


def test_a_stacked_shape_of_2_to_the_40_layers_is_not_expanded(tmp_path):
    """A .metadata giving a stacked key 2^40 layers, two of them in chunks: listed as not converted with the count
    (one output key per layer of a shape was a MemoryError); the other keys are planned."""
    import shutil

    from conftest import run_ckptdoctor
    from test_hostile_inputs import MEMORY_LIMIT

    from ckptdoctor.formats.torch_dist import dump_metadata_object, load_metadata_object

    save = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "core019_tp1", save)
    path = save / ITER / ".metadata"
    metadata = load_metadata_object(path)
    item = metadata.state_dict_metadata["decoder.layers.mlp.linear_fc2.weight"]
    item.__dict__["size"] = type(item.size)((1 << 40, *item.size[1:]))
    path.write_bytes(dump_metadata_object(metadata))
    proc = run_ckptdoctor(
        "convert", save, "--to", "fsdp_dtensor", "--format", "json", timeout=60, memory_headroom=MEMORY_LIMIT
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["plan"]
    why = {n["key"]: n["why"] for n in plan["not_carried"]}
    assert why["decoder.layers.mlp.linear_fc2.weight"] == (
        "stacked layers or experts of which the chunks hold 2 of 1,099,511,627,776: not converted"
    )
    assert "decoder.layers.mlp.linear_fc1.weight" in {m["source"] for m in plan["mappings"]}


@pytest.mark.parametrize("unit_bytes", [None, 4096])
def test_data_files_keep_the_source_writers(capsys, tmp_path, monkeypatch, unit_bytes):
    """Each output data file is named under the rank that wrote its source file (``__<rank>_<n>.distcp``), also
    where a source file is cut into several units: the saved layout read from the output (writer ranks, PP from
    the disjoint writers of the layers) is the source's, both ways."""
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.ops.convert import write
    from ckptdoctor.parallelism import infer_layout

    if unit_bytes is not None:
        monkeypatch.setattr(write, "UNIT_BYTES", unit_bytes)
    src = FIXTURES / "core019_tp1_pp2"
    rc, _, err = _run(capsys, "convert", src, "--to", "fsdp_dtensor", "-o", tmp_path / "fsdp", "--jobs", "1")
    assert rc == 0, err
    files = sorted(p.name for p in (tmp_path / "fsdp" / "iter_0000010").glob("*.distcp"))
    if unit_bytes is not None:
        assert len(files) > 3  # several units per source file
    assert {name.split("_")[2] for name in files} == {"0", "1"}  # __<rank>_<n>: the source's two ranks
    rc, _, err = _run(capsys, "convert", tmp_path / "fsdp", "--to", "torch_dist", "-o", tmp_path / "back", "-j", "1")
    assert rc == 0, err
    source, back = infer_layout(open_checkpoint(src)), infer_layout(open_checkpoint(tmp_path / "back"))
    assert (back.tp, back.pp, back.writer_ranks) == (source.tp, source.pp, source.writer_ranks) == (1, 2, [0, 1])


def test_a_sealed_source_whose_bytes_changed_is_refused(capsys, tmp_path):
    """A sealed source (integrity.json) with one byte changed outside any record (a zip header field no reader
    checks): check says CKD301; convert refuses it before writing, as strip-frozen does, instead of carrying the
    changed bytes into a format no manifest covers."""
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "core019_tp2", source)
    assert _run(capsys, "seal", source)[0] == 0
    data_file = source / ITER / "__0_0.distcp"
    data = bytearray(data_file.read_bytes())
    data[19] ^= 0x01
    data_file.write_bytes(bytes(data))
    rc, out, err = _run(capsys, "convert", source, "--to", "fsdp_dtensor", "-o", tmp_path / "out")
    assert rc == 2 and "refusing to convert it" in err and "__0_0.distcp" in err, out + err
    assert not (tmp_path / "out").exists()
