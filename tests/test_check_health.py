"""``check --health``: exact per-key statistics and fingerprints in ``--deep``'s one pass, and the health rules
(CKD5xx, and CKD313 in the distributed optimizer's buckets), on fixtures saved by real megatron-core (seven of them
damaged before the save) and on copies of fixtures whose tensors are re-saved with changed values."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import pytest

from ckptdoctor import numpy_lazy
from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.cli import main
from ckptdoctor.formats.torch_dist import (
    StorageLocation,
    dump_metadata_object,
    index_fqn,
    load_metadata_object,
    record_attr,
    set_storage,
    storage_items,
)
from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip
from ckptdoctor.values import health
from ckptdoctor.values.health import HealthScan, KeyStats, summarise
from ckptdoctor.values.moments import KINDS, Moments
from ckptdoctor.values.read import read_tensor
from tests.conftest import FIXTURES, fixture_names

np = pytest.importorskip("numpy")

ITER = "iter_0000010"
EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
DAMAGED = {
    "core019_moe_zero_expert_ep2",
    "core019_moe_dup_expert_ep2",
    "core019_nan_weight_tp1",
    "core019_inf_exp_avg_sq_dp2",
    "core019_inf_exp_avg_sq_tp1",
    "core019_zero_moments_trained_tp1",
    "core019_zero_moments_dp2",
    "core019_moe_zero_moments_ep2_distopt",
    "core019_reinit_layer_trained_tp1",
    "core019_reinit_weights_trained_tp1",
}
# What ``check --health`` adds to ``check``: the CKD5xx rules and CKD313 (NaN/Inf)
HEALTH_SELECT = ("--select", "CKD5", "--select", "CKD313")
BUCKET = "optimizer.distributed.dp_group_idx_{}.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.{}"
LAYER_AT_INIT_BY_WEIGHTS = (
    "every weight's mean and std those of Megatron's init for init_method_std 0.02 (normal(0, 0.02); linear_proj, "
    "linear_fc2: normal(0, 0.01))"
)


def _check(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["check", "--isolated", "--format", "json", *args])
    out, _ = capsys.readouterr()
    return rc, json.loads(out)


def _health_codes(report: dict) -> list[str]:
    return [f["code"] for f in report["findings"] if f["code"].startswith("CKD5")]


def _stats(report: dict) -> dict[str, dict]:
    (checkpoint,) = report["health"]
    return {k["key"]: k for k in checkpoint["keys"]}


def _edit_metadata(iteration_dir: Path, edit: Callable[[object], None]) -> None:
    path = iteration_dir / ".metadata"
    metadata = load_metadata_object(path)
    edit(metadata)
    path.write_bytes(dump_metadata_object(metadata))


def _rewrite_tensor(
    iteration_dir: Path, key: str, change: Callable[[bytes], bytes], chunk: tuple[int, ...] | None = None
) -> None:
    """Re-save every chunk of ``key`` (or the one at offsets ``chunk``) with ``change`` applied to its storage bytes
    (appended to its data file)."""
    metadata = load_metadata_object(iteration_dir / ".metadata")
    moved = {}
    for index, info in storage_items(metadata).items():
        if index_fqn(index) != key or (chunk is not None and _offset(index) != chunk):
            continue
        path = iteration_dir / info.relative_path
        ref = load_torch_zip(path.read_bytes()[info.offset : info.offset + info.length], key)
        ref.storage.set_data(change(ref.storage.data()))
        blob = dump_torch_zip(ref)
        offset = path.stat().st_size
        with open(path, "ab") as f:
            f.write(blob)
        moved[_where(index)] = StorageLocation(info.relative_path, offset, len(blob))
    assert moved, key

    def edit(metadata: object) -> None:
        for index, info in storage_items(metadata).items():
            if _where(index) in moved:
                set_storage(info, moved[_where(index)])

    _edit_metadata(iteration_dir, edit)


# --- the rules on the damaged fixtures and the healthy ones --------------------------------------------------


def test_zeroed_expert_is_an_error(capsys):
    rc, report = _check(capsys, "--health", str(FIXTURES / "core019_moe_zero_expert_ep2"))
    assert rc == 1 and _health_codes(report) == ["CKD501", "CKD501"]
    messages = sorted(f["message"] for f in report["findings"])
    assert messages == [
        f"{EXPERT_FC1}: layer 0 expert 1 all zero (1 of 8 slices)",
        f"{EXPERT_FC2}: layer 0 expert 1 all zero (1 of 8 slices)",
    ]
    assert {f["severity"] for f in report["findings"]} == {"error"}


def test_duplicated_expert_is_a_warning(capsys):
    rc, report = _check(capsys, "--health", str(FIXTURES / "core019_moe_dup_expert_ep2"))
    assert rc == 1 and _health_codes(report) == ["CKD502"]
    (f,) = report["findings"]
    assert f["severity"] == "warning"
    assert f["message"] == "decoder.layers.mlp.experts (layer 0): experts 0, 1 are equal in every tensor"


def test_health_rules_need_health(capsys):
    """--deep alone reads the same chunks but neither computes statistics nor applies CKD5xx."""
    rc, report = _check(capsys, "--deep", str(FIXTURES / "core019_moe_zero_expert_ep2"))
    assert rc == 0 and "health" not in report


@pytest.mark.parametrize("fixture", sorted(set(fixture_names()) - DAMAGED))
def test_healthy_fixtures_have_no_health_finding(capsys, fixture):
    """Every real fixture that is not damaged on purpose, the trained one and the one whose biases are all zero
    included: no CKD5xx and no NaN/Inf (the distributed optimizer's buckets included) finding."""
    rc, report = _check(capsys, "--health", *HEALTH_SELECT, str(FIXTURES / fixture))
    assert rc == 0 and report["findings"] == []


@pytest.mark.parametrize(
    "fixture, codes",
    [
        ("core019_nan_weight_tp1", ["CKD313"]),
        ("core019_inf_exp_avg_sq_dp2", ["CKD313"]),
        ("core019_inf_exp_avg_sq_tp1", ["CKD313"]),
        ("core019_zero_moments_trained_tp1", ["CKD510"]),
        ("core019_zero_moments_dp2", ["CKD510"]),
        ("core019_moe_zero_moments_ep2_distopt", ["CKD510"]),
        ("core019_reinit_layer_trained_tp1", ["CKD505"]),
        ("core019_reinit_weights_trained_tp1", ["CKD505"]),
        ("core019_moe_zero_expert_ep2", ["CKD501", "CKD501"]),
        ("core019_moe_dup_expert_ep2", ["CKD502"]),
    ],
)
def test_each_damaged_fixture_gets_exactly_its_finding(capsys, fixture, codes):
    rc, report = _check(capsys, "--health", str(FIXTURES / fixture))
    assert rc == 1 and [f["code"] for f in report["findings"]] == codes


def test_nan_in_one_model_tensor(capsys):
    rc, report = _check(capsys, "--health", str(FIXTURES / "core019_nan_weight_tp1"))
    (f,) = report["findings"]
    assert f["severity"] == "error" and f["path"].endswith("__0_0.distcp")
    assert f["message"] == (
        "decoder.layers.self_attention.linear_proj.weight: 1 NaN and 0 Inf value(s) in 1 of 2 chunk(s) "
        "(first: chunk at [0, 0, 0])"
    )


def test_inf_in_a_distributed_optimizer_bucket(capsys):
    """One +Inf in DP rank 0's first exp_avg_sq element: found inside the dp_reshardable bucket, named by the
    bucket key and the element range of its chunk; the padding chunks (garbage) are not scanned."""
    for jobs in ("1", "2"):  # one data file per DP rank: the counts of both files merged alike
        rc, report = _check(capsys, "--deep", "--jobs", jobs, str(FIXTURES / "core019_inf_exp_avg_sq_dp2"))
        (f,) = report["findings"]
        assert rc == 1 and f["code"] == "CKD313" and f["severity"] == "error"
        assert f["message"] == (
            f"{BUCKET.format(0, 'exp_avg_sq')}: 0 NaN and 1 Inf value(s) in elements [0, 4096) of the distributed "
            "optimizer's bucket (1 of 15 chunk(s); 5 padding chunk(s) not scanned)"
        )


def test_inf_in_a_model_space_exp_avg_sq(capsys):
    rc, report = _check(capsys, "--health", str(FIXTURES / "core019_inf_exp_avg_sq_tp1"))
    (f,) = report["findings"]
    assert f["message"] == (
        "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight: 0 NaN and 1 Inf value(s) in 1 of 1 chunk(s) "
        "(first: chunk at [0, 0])"
    )
    assert _stats(report)["optimizer.state.exp_avg_sq.embedding.word_embeddings.weight"]["inf"] == 1


def _bucket_chunks(save: Path, key: str) -> list[tuple[int, int]]:
    metadata = load_metadata_object(save / ITER / ".metadata")
    chunks = record_attr(record_attr(metadata, "state_dict_metadata")[key], "chunks")
    return sorted((record_attr(c, "offsets")[0], record_attr(c, "sizes")[0]) for c in chunks)


def test_real_bucket_padding_holds_garbage_and_is_not_scanned(capsys):
    """megatron-core saves the padding between a bucket's parameters from torch.empty: in core019_tp2_dp2 one
    padding chunk of dp_group_idx_1's param bucket holds a NaN bit pattern. check --deep scans the bucket but not
    its padding (chunks holding no multiple of 64, where DDP starts every parameter): no finding."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader, load

    save = FIXTURES / "core019_tp2_dp2"
    key = BUCKET.format(1, "param")
    chunks = _bucket_chunks(save, key)
    padding = [(start, size) for start, size in chunks if start % 64 and start + size <= -(-start // 64) * 64]
    assert padding and all(size < 64 for _, size in padding)
    state = {key: torch.zeros(sum(size for _, size in chunks))}
    load(state, storage_reader=FileSystemReader(str(save / ITER)), no_dist=True)
    values = state[key]
    in_padding = sum(int(values[start : start + size].isnan().sum()) for start, size in padding)
    assert in_padding > 0 and int(values.isnan().sum()) == in_padding  # NaN only where nothing was written
    rc, report = _check(capsys, "--deep", str(save))
    assert rc == 0 and report["findings"] == []


def test_nan_in_a_bucket_parameter_chunk_is_found(capsys, copy_fixture):
    """A NaN re-saved into a parameter's chunk of a bucket (not padding) is CKD313, with its element range."""
    save = copy_fixture("core019_tp2_dp2")
    key = BUCKET.format(1, "exp_avg")
    start, size = _bucket_chunks(save, key)[1]  # the second chunk: a parameter's (it starts at a multiple of 64)
    assert start % 64 == 0

    def one_nan(data: bytes) -> bytes:
        return data[:4] + struct.pack("<f", math.nan) + data[8:]

    _rewrite_tensor(save / ITER, key, one_nan, chunk=(start,))
    rc, report = _check(capsys, "--deep", str(save))
    (f,) = report["findings"]
    assert rc == 1 and f["code"] == "CKD313"
    assert f["message"].startswith(f"{key}: 1 NaN and 0 Inf value(s) in elements [{start}, {start + size}) of ")


def test_bucket_statistics_leave_the_padding_out(capsys):
    """A bucket's statistics count its parameters' elements only: the padding chunks (garbage) are not measured."""
    save = FIXTURES / "core019_tp2_dp2"
    rc, report = _check(capsys, "--health", str(save))
    stats = _stats(report)
    for group in (0, 1):
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            key = BUCKET.format(group, kind)
            chunks = _bucket_chunks(save, key)
            written = sum(size for start, size in chunks if not (start % 64 and start + size <= -(-start // 64) * 64))
            assert stats[key]["count"] == written < stats[key]["shape"][0]
            assert stats[key]["nan"] == stats[key]["inf"] == 0
    assert rc == 0


def test_negative_second_moment_in_a_bucket(capsys, copy_fixture):
    """With the padding left out, a bucket's exp_avg_sq is read element-wise like a model-space one: CKD511."""
    save = copy_fixture("core019_tp2_dp2")
    key = BUCKET.format(0, "exp_avg_sq")
    start, _ = _bucket_chunks(save, key)[0]
    _rewrite_tensor(save / ITER, key, lambda data: struct.pack("<f", -1.0) + data[4:], chunk=(start,))
    rc, report = _check(capsys, "--health", str(save))
    assert rc == 1 and _health_codes(report) == ["CKD511"]
    assert report["findings"][0]["message"] == f"{key}: negative values (smallest -1)"


def test_optimizer_moments_zeroed_before_a_real_save(capsys):
    rc, report = _check(capsys, "--health", str(FIXTURES / "core019_zero_moments_trained_tp1"))
    (f,) = report["findings"]
    assert f["severity"] == "warning"
    assert f["message"] == "all 18 exp_avg/exp_avg_sq tensors are zero at iteration 10 (optimizer re-initialised?)"


def test_bucket_moments_zeroed_before_a_real_save(capsys):
    """The distributed optimizer's moments zeroed before megatron-core's save: the buckets' padding holds what
    torch.empty gave (not zero), and is not measured, so CKD510 still sees every moment zero."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader, load

    save = FIXTURES / "core019_zero_moments_dp2"
    keys = [BUCKET.format(0, kind) for kind in ("exp_avg", "exp_avg_sq")]
    state = {key: torch.zeros(sum(size for _, size in _bucket_chunks(save, key))) for key in keys}
    load(state, storage_reader=FileSystemReader(str(save / ITER)), no_dist=True)
    assert all(int(values.count_nonzero()) > 0 for values in state.values())  # the padding's garbage, on disk
    rc, report = _check(capsys, "--health", str(save))
    (f,) = report["findings"]
    assert f["code"] == "CKD510"
    assert f["message"] == "all 2 exp_avg/exp_avg_sq tensors are zero at iteration 10 (optimizer re-initialised?)"


def test_chained_optimizer_bucket_moments_zeroed(capsys):
    """An MoE model's distributed optimizer is megatron-core's ChainedOptimizer (dense, experts): its dp_reshardable
    buckets are saved as chained_0./chained_1.optimizer.distributed.*, optimizer items like the unprefixed ones:
    every moment zeroed is CKD510 over both optimizers' buckets, and the layout is the saved one (not a TP read from
    the buckets' flat chunks, as when they counted as model keys)."""
    save = FIXTURES / "core019_moe_zero_moments_ep2_distopt"
    rc, report = _check(capsys, "--health", str(save))
    (f,) = report["findings"]
    assert f["code"] == "CKD510"
    assert f["message"] == "all 6 exp_avg/exp_avg_sq tensors are zero at iteration 10 (optimizer re-initialised?)"
    moments = [k["key"] for k in report["health"][0]["keys"] if k["key"].endswith((".exp_avg", ".exp_avg_sq"))]
    assert {m.split(".", 1)[0] for m in moments} == {"chained_0", "chained_1"} and len(moments) == 6


def test_layer_replaced_by_a_fresh_megatron_init(capsys):
    """Layer 1 re-initialised by the model's own init methods (norms 1, biases 0, weights drawn again) while layer 0
    trained 10 steps: CKD505 by its norm scales and by its weights' statistics."""
    rc, report = _check(capsys, "--health", str(FIXTURES / "core019_reinit_layer_trained_tp1"))
    (f,) = report["findings"]
    assert f["severity"] == "warning"
    assert f["message"] == (
        f"layer 1: every norm scale exactly 1; {LAYER_AT_INIT_BY_WEIGHTS}, as initialised, while "
        "layer(s) 0 moved (never trained?)"
    )


def test_layer_weights_redrawn_by_megatron_init(capsys):
    """Only layer 1's weights drawn again (its norm scales kept as trained): found by the weights alone."""
    rc, report = _check(capsys, "--health", str(FIXTURES / "core019_reinit_weights_trained_tp1"))
    (f,) = report["findings"]
    assert f["message"] == (
        f"layer 1: {LAYER_AT_INIT_BY_WEIGHTS}, as initialised, while layer(s) 0 moved (never trained?)"
    )


def _tripled(data: bytes) -> bytes:
    return (np.frombuffer(data, dtype="<f4") * 3).astype("<f4").tobytes()


@pytest.mark.parametrize("moved, flagged", [([0], []), ([1, 2], [0])])
def test_layer_weights_at_init_beside_as_many_moved_layers(capsys, copy_fixture, moved, flagged):
    """core019_pp2_uneven (3 layers, all at Megatron's init) with the linear_proj weights of some layers re-saved
    tripled (std 3x its init): the layers left at init are flagged only where at least as many layers moved (one
    moved layer beside two at init is an early checkpoint, not a layer left behind)."""
    save = copy_fixture("core019_pp2_uneven")
    for layer in moved:
        _rewrite_tensor(save / ITER, "decoder.layers.self_attention.linear_proj.weight", _tripled, chunk=(layer, 0, 0))
    rc, report = _check(capsys, "--health", str(save))
    names = ", ".join(map(str, moved))
    assert [f["message"] for f in report["findings"]] == [
        f"layer {layer}: {LAYER_AT_INIT_BY_WEIGHTS.replace('0.01', '0.008165')}, as initialised, while layer(s) "
        f"{names} moved (never trained?)"
        for layer in flagged
    ]
    assert rc == (1 if flagged else 0)


def test_trained_fixture_moved_every_layer():
    """core019_trained_tp1 (10 real Adam steps): every dense weight of every layer is away from its init (std
    beyond the default tolerance), and no norm scale is exactly one: the control for CKD505."""
    from ckptdoctor.ops.check import health_scan
    from ckptdoctor.values.moments import moment_values

    save = FIXTURES / "core019_trained_tp1"
    scan = health_scan(save / ITER, save / ITER)
    init_stds = {
        "decoder.layers.self_attention.linear_qkv.weight": 0.02,
        "decoder.layers.self_attention.linear_proj.weight": 0.01,  # 0.02 / sqrt(2 num_layers)
        "decoder.layers.mlp.linear_fc1.weight": 0.02,
        "decoder.layers.mlp.linear_fc2.weight": 0.01,
    }
    for key, init_std in init_stds.items():
        stats = scan.keys[key]
        for layer in (0, 1):
            _, std, _ = moment_values(stats.slices[(layer,)], stats.dtype)
            assert std is not None and abs(std / init_std - 1) > 0.2, (key, layer, std)
    norms = scan.keys["decoder.layers.self_attention.linear_qkv.layer_norm_weight"]
    assert all(not (m.low == m.high == 1) for m in norms.slices.values())


def test_untrained_fixture_with_all_zero_biases_is_healthy(capsys):
    """core019_bias_tp1: every linear bias all zero, as Megatron initialises them; never a finding."""
    rc, report = _check(capsys, "--health", str(FIXTURES / "core019_bias_tp1"))
    (checkpoint,) = report["health"]
    biases = [k for k in checkpoint["keys"] if k["key"].startswith("decoder.") and k["key"].endswith(".bias")]
    assert biases and all(k["zeros"] == k["count"] for k in biases)
    assert rc == 0 and report["findings"] == []


# --- [tool.ckptdoctor.health-rules] ----------------------------------------------------------------------------


def _check_with_config(capsys, monkeypatch, tmp_path: Path, body: str, *args: str) -> tuple[int, str, str]:
    (tmp_path / "pyproject.toml").write_text(f"[tool.ckptdoctor.health-rules]\n{body}\n")
    monkeypatch.chdir(tmp_path)
    rc = main(["check", "--format", "json", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_config_ignore_keys(capsys, monkeypatch, tmp_path):
    """ignore-keys: the CKD5xx rules leave the matching keys out (here every decoder layer's: no CKD505)."""
    fixture = str(FIXTURES / "core019_reinit_layer_trained_tp1")
    rc, out, _ = _check_with_config(
        capsys, monkeypatch, tmp_path, 'ignore-keys = ["decoder.layers.*"]', "--health", fixture
    )
    assert rc == 0 and json.loads(out)["findings"] == []
    rc, out, _ = _check_with_config(
        capsys, monkeypatch, tmp_path, 'ignore-keys = ["output_layer.*"]', "--health", fixture
    )
    assert rc == 1 and [f["code"] for f in json.loads(out)["findings"]] == ["CKD505"]


def test_config_init_tolerance(capsys, monkeypatch, tmp_path):
    """init-std-tolerance: so wide that the trained layer 0 counts as at its init too: nothing moved, no finding;
    the default finds layer 1."""
    fixture = str(FIXTURES / "core019_reinit_weights_trained_tp1")
    rc, out, _ = _check_with_config(capsys, monkeypatch, tmp_path, "init-std-tolerance = 5", "--health", fixture)
    assert rc == 0 and json.loads(out)["findings"] == []
    rc, out, _ = _check_with_config(capsys, monkeypatch, tmp_path, "init-mean-tolerance = 0.1", "--health", fixture)
    assert rc == 1 and [f["code"] for f in json.loads(out)["findings"]] == ["CKD505"]


@pytest.mark.parametrize(
    "body, why",
    [
        ("init-std-tolerance = -1", "init-std-tolerance must be a non-negative number, got -1"),
        ("init-std-tolerance = 'wide'", "init-std-tolerance must be a non-negative number"),
        ("ignore-keys = [1]", "ignore-keys must be a list of key globs"),
        ("std-tolerance = 0.2", "unknown key 'std-tolerance'"),
    ],
)
def test_bad_health_rules_config_is_a_usage_error(capsys, monkeypatch, tmp_path, body, why):
    rc, _, err = _check_with_config(capsys, monkeypatch, tmp_path, body, "--health", str(FIXTURES / "core019_tp1"))
    assert rc == 2 and "[tool.ckptdoctor.health-rules]" in err and why in err


# --- statistics: exact, the same at any layout of one saved state -----------------------------------------


def test_statistics_equal_across_a_megatron_reshard(capsys):
    """core019_convert_tp4 is core019_convert_src_tp1's model loaded by megatron-core at TP=4 and saved again:
    every statistic and fingerprint of every model key agrees, bit for bit."""
    _, source = _check(capsys, "--health", str(FIXTURES / "core019_convert_src_tp1"))
    _, resharded = _check(capsys, "--health", str(FIXTURES / "core019_convert_tp4"))
    a, b = _stats(source), _stats(resharded)
    model_keys = [k for k in b if not k.startswith("optimizer.")]
    assert len(model_keys) >= 8 and all(k in a for k in model_keys)
    for key in model_keys:
        assert a[key] == b[key], key


def test_statistics_do_not_depend_on_jobs(capsys):
    path = str(FIXTURES / "core019_moe_ep2")
    _, one = _check(capsys, "--health", "--jobs", "1", path)
    _, two = _check(capsys, "--health", "--jobs", "2", path)
    assert one["health"][0]["keys"] == two["health"][0]["keys"]


def test_statistics_match_torch(capsys):
    """count, zeros, min, max, mean, std and L2 norm against torch's float64 on the assembled tensors."""
    torch = pytest.importorskip("torch")
    path = FIXTURES / "core019_tp2"
    _, report = _check(capsys, "--health", str(path))
    stats = _stats(report)
    checkpoint = open_checkpoint(path)
    for key in ("decoder.layers.self_attention.linear_qkv.weight", "optimizer.state.exp_avg_sq.output_layer.weight"):
        values = read_tensor(checkpoint, key).to(torch.float64)
        got = stats[key]
        assert got["count"] == values.numel() and got["zeros"] == int((values == 0).sum())
        assert got["min"] == float(values.min()) and got["max"] == float(values.max())
        assert math.isclose(got["mean"], float(values.mean()), rel_tol=1e-12, abs_tol=1e-300)
        assert math.isclose(got["std"], float(values.std(unbiased=False)), rel_tol=1e-12)
        assert math.isclose(got["l2"], float(values.norm()), rel_tol=1e-12)


def test_fingerprint_changes_with_one_value(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    key = "decoder.final_layernorm.weight"
    _, before = _check(capsys, "--health", str(save))
    # the first element's lowest mantissa bit flipped: the smallest change a float32 can make
    _rewrite_tensor(save / ITER, key, lambda data: bytes([data[0] ^ 1]) + data[1:])
    _, after = _check(capsys, "--health", str(save))
    a, b = _stats(before), _stats(after)
    assert a[key]["fingerprint"] != b[key]["fingerprint"]
    assert a[key]["count"] == b[key]["count"]
    assert all(a[k] == b[k] for k in a if k != key)


def test_zero_padded_vocab_rows_are_not_flagged(capsys, copy_fixture):
    """Rows of the embedding and output layer zeroed (as padded vocab rows are): not a zero weight, the tensor as a
    whole is not zero."""
    save = copy_fixture("core019_tp1")
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):  # [128, 32]: the last 28 rows zeroed
        _rewrite_tensor(save / ITER, key, lambda data: data[: 100 * 32 * 4] + bytes(28 * 32 * 4))
    rc, report = _check(capsys, "--health", "--select", "CKD5", str(save))
    assert rc == 0 and report["findings"] == []
    assert _stats(report)["output_layer.weight"]["zeros"] == 28 * 32


def test_one_layer_at_init_while_the_other_moved(capsys, copy_fixture):
    """Layer 0's qkv norm scale re-saved as 1.0078125 (moved); layer 1 left exactly as initialised: CKD505 for
    layer 1. The fixtures themselves (every layer at its initialisation) get none: nothing moved."""
    save = copy_fixture("core019_tp1")
    key = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"  # [2, 32], a chunk per layer
    _rewrite_tensor(save / ITER, key, lambda data: struct.pack("<32f", *[1.0078125] * 32), chunk=(0, 0))
    rc, report = _check(capsys, "--health", str(save))
    assert rc == 1 and _health_codes(report) == ["CKD505"]
    assert report["findings"][0]["message"] == (
        "layer 1: every norm scale exactly 1, as initialised, while layer(s) 0 moved (never trained?)"
    )


# --- optimizer rules on re-saved copies ---------------------------------------------------------------------


def _moment_keys(iteration_dir: Path) -> list[str]:
    metadata = load_metadata_object(iteration_dir / ".metadata")
    return [k for k in record_attr(metadata, "state_dict_metadata") if k.startswith("optimizer.state.exp_avg")]


def test_optimizer_moments_all_zero_at_iteration_10(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    for key in _moment_keys(save / ITER):
        _rewrite_tensor(save / ITER, key, lambda data: bytes(len(data)))
    rc, report = _check(capsys, "--health", str(save))
    assert rc == 1 and _health_codes(report) == ["CKD510"]
    assert "at iteration 10 (optimizer re-initialised?)" in report["findings"][0]["message"]


def test_distributed_optimizer_buckets_all_zero_at_iteration_10(capsys, copy_fixture):
    """The dp_reshardable buckets (optimizer.distributed...bucket_idx_*.exp_avg/exp_avg_sq) re-saved as zeros."""
    save = copy_fixture("core019_tp2_dp2")
    metadata = load_metadata_object(save / ITER / ".metadata")
    keys = [
        k
        for k in record_attr(metadata, "state_dict_metadata")
        if ".bucket_idx_" in k and k.endswith(("exp_avg", "exp_avg_sq"))
    ]
    assert keys
    for key in keys:
        _rewrite_tensor(save / ITER, key, lambda data: bytes(len(data)))
    rc, report = _check(capsys, "--health", str(save))
    assert rc == 1 and _health_codes(report) == ["CKD510"]
    assert report["findings"][0]["message"].startswith(f"all {len(keys)} exp_avg/exp_avg_sq tensors are zero")


def test_negative_second_moment(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    key = "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight"
    _rewrite_tensor(save / ITER, key, lambda data: struct.pack("<f", -1.0) + data[4:])
    rc, report = _check(capsys, "--health", str(save))
    assert rc == 1 and _health_codes(report) == ["CKD511"]
    assert report["findings"][0]["message"] == f"{key}: negative values (smallest -1)"


def test_moment_missing_for_a_parameter(capsys, copy_fixture):
    save = copy_fixture("core019_tp1")
    dropped = "optimizer.state.exp_avg_sq.output_layer.weight"

    def edit(metadata: object) -> None:
        del record_attr(metadata, "state_dict_metadata")[dropped]
        storage = storage_items(metadata)
        for index in [i for i in storage if index_fqn(i) == dropped]:
            del storage[index]

    _edit_metadata(save / ITER, edit)
    rc, report = _check(capsys, "--health", str(save))
    assert rc == 1 and _health_codes(report) == ["CKD512"]
    assert report["findings"][0]["message"] == "output_layer.weight: optimizer.state.exp_avg without exp_avg_sq"


def test_all_experts_equal_in_every_layer(capsys, copy_fixture):
    """Every expert of every layer re-saved as a copy of that layer's expert 0: CKD503 per layer (a warning)."""
    save = copy_fixture("core019_moe_ep2")
    _copy_expert_zero(save / ITER, layers=(0, 1))
    rc, report = _check(capsys, "--health", str(save))
    assert rc == 1 and _health_codes(report) == ["CKD503", "CKD503"]
    assert {f["severity"] for f in report["findings"]} == {"warning"}
    assert report["findings"][0]["message"] == (
        "decoder.layers.mlp.experts (layer 0): all 4 experts are equal in every tensor (upcycled or never trained?)"
    )


def test_all_experts_equal_in_one_layer(capsys, copy_fixture):
    """Only layer 0's experts copies of its expert 0 while layer 1's differ: CKD504, an error."""
    save = copy_fixture("core019_moe_ep2")
    _copy_expert_zero(save / ITER, layers=(0,))
    rc, report = _check(capsys, "--health", str(save))
    assert rc == 1 and _health_codes(report) == ["CKD504"]
    assert report["findings"][0]["severity"] == "error"
    assert report["findings"][0]["message"].startswith("decoder.layers.mlp.experts (layer 0): all 4 experts")


def _copy_expert_zero(iteration_dir: Path, layers: tuple[int, ...]) -> None:
    """Every expert chunk of ``layers`` re-saved with the bytes of the same layer's expert 0 chunk (same offsets
    otherwise): the experts' chunks are one expert each."""
    metadata = load_metadata_object(iteration_dir / ".metadata")
    items = storage_items(metadata)
    source: dict[tuple, bytes] = {}
    for index, info in items.items():
        if index_fqn(index).endswith("weight") and "experts.experts." in index_fqn(index) and _offset(index)[1] == 0:
            blob = (iteration_dir / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
            source[(index_fqn(index), _offset(index)[0], *_offset(index)[2:])] = blob
    moved = {}
    for index, info in items.items():
        fqn = index_fqn(index)
        if (
            not fqn.endswith("weight")
            or "experts.experts." not in fqn
            or _offset(index)[0] not in layers
            or _offset(index)[1] == 0
        ):
            continue
        ref = load_torch_zip(source[(fqn, _offset(index)[0], *_offset(index)[2:])], fqn)
        path = iteration_dir / info.relative_path
        blob = dump_torch_zip(ref)
        offset = path.stat().st_size
        with open(path, "ab") as f:
            f.write(blob)
        moved[_where(index)] = StorageLocation(info.relative_path, offset, len(blob))

    def edit(metadata: object) -> None:
        for index, info in storage_items(metadata).items():
            if _where(index) in moved:
                set_storage(info, moved[_where(index)])

    _edit_metadata(iteration_dir, edit)


# --- without numpy --------------------------------------------------------------------------------------------


def test_health_without_numpy_is_one_clear_line(capsys, monkeypatch):
    monkeypatch.setattr(numpy_lazy, "_NUMPY", [None])
    rc = main(["check", "--isolated", "--health", str(FIXTURES / "core019_tp1")])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [
        "ckptdoctor: error: check --health (tensor statistics) needs the 'numpy' package, which is not installed: "
        "pip install 'ckptdoctor[torch]'"
    ]


def _offset(index: object) -> tuple[int, ...]:
    offset = record_attr(index, "offset")
    return () if offset is None else tuple(offset)


def _where(index: object) -> tuple:
    """A storage index as a plain key (the key, the chunk's offsets): the same across two reads of .metadata."""
    return index_fqn(index), _offset(index)


# --- the engine: exact, whatever the chunking and whichever path -------------------------------------------------

_DTYPES = {
    "torch.bfloat16": "<u2",
    "torch.float16": "<u2",
    "torch.float32": "<u4",
    "torch.float64": "<u8",
    "torch.int8": "<u1",
    "torch.int32": "<u4",
    "torch.int64": "<u8",
    "torch.uint8": "<u1",
}


def _exact_value(dtype: str, bits: int) -> Fraction | None:
    """One element's value from its bits by the IEEE definition (None: NaN or Inf), or as an integer."""
    kind = KINDS[dtype]
    width = kind.itemsize * 8
    if not kind.is_float:
        return Fraction(bits - (1 << width) if kind.signed and bits >> (width - 1) else bits)
    fraction = bits & ((1 << kind.fraction_bits) - 1)
    exponent = (bits >> kind.fraction_bits) & ((1 << kind.exponent_bits) - 1)
    if exponent == (1 << kind.exponent_bits) - 1:
        return None
    bias = (1 << (kind.exponent_bits - 1)) - 1
    significand = fraction + ((1 << kind.fraction_bits) if exponent else 0)
    value = Fraction(significand) * Fraction(2) ** (max(exponent, 1) - bias - kind.fraction_bits)
    return -value if bits >> (width - 1) else value


def _scan_in_chunks(dtype: str, bits, rows_per_chunk: int):
    """A [4, 3, N] key (a stacked layer axis) fed in chunks of ``rows_per_chunk`` rows of its last axis."""
    scan = HealthScan()
    layers, rows, _ = bits.shape
    for layer in range(layers):
        for start in range(0, rows, rows_per_chunk):
            part = np.ascontiguousarray(bits[layer : layer + 1, start : start + rows_per_chunk])
            scan.scan("decoder.layers.x.weight", dtype, bits.shape, (layer, start, 0), part.shape, part.tobytes())
    return scan.keys["decoder.layers.x.weight"]


@pytest.mark.parametrize("dtype", sorted(_DTYPES))
@pytest.mark.parametrize("size", [7, 4100])  # below and above the bit-pattern count's threshold
def test_engine_exact_and_layout_independent(dtype, size):
    """Random bit patterns (NaN, Inf, subnormals, -0 among them): the exact sums equal the sums of the IEEE values
    as fractions, and every figure is the same for chunks cut along other rows."""
    kind = KINDS[dtype]
    rng = np.random.default_rng(size)
    bits = rng.integers(0, 1 << (8 * kind.itemsize), size=(4, 3, size), dtype=np.uint64, endpoint=False)
    bits = bits.astype(_DTYPES[dtype])
    bits[0, 0, :3] = [0, 1 << (8 * kind.itemsize - 1), 1][: min(3, size)]  # +0, -0, the smallest subnormal
    whole = _scan_in_chunks(dtype, bits, 3)
    for rows in (1, 2):
        assert _scan_in_chunks(dtype, bits, rows).slices == whole.slices
    # per layer, or (an integer key's slices of 21 elements, below MIN_INTEGER_SLICE_ELEMENTS) the key whole
    kept_whole = not kind.is_float and 3 * size < health.MIN_INTEGER_SLICE_ELEMENTS
    assert whole.axes == (() if kept_whole else ("layer",))
    groups = {(): bits.reshape(-1)} if kept_whole else {(layer,): bits[layer].reshape(-1) for layer in range(4)}
    assert sorted(whole.slices) == sorted(groups)
    for index, group in groups.items():
        values = [_exact_value(dtype, int(b)) for b in group]
        finite = [v for v in values if v is not None]
        moments = whole.slices[index]
        scale = Fraction(2) ** kind.scale
        assert moments.finite == len(finite) and moments.count == len(values)
        assert Fraction(moments.total) / scale == sum(finite)
        assert Fraction(moments.total_sq) / scale**2 == sum(v * v for v in finite)
        assert moments.zeros == sum(1 for v in finite if v == 0)
        if finite:
            assert Fraction(moments.low) == min(finite) and Fraction(moments.high) == max(finite)
    summarise("decoder.layers.x.weight", whole)  # mean, std, L2 from the totals: no overflow, no error


def test_fingerprint_tells_slices_apart():
    """Equal slices: equal fingerprints at different positions; one changed element or two swapped ones: another."""
    rng = np.random.default_rng(0)
    layer = rng.integers(0, 1 << 16, size=(3, 64), dtype=np.uint64).astype("<u2")
    bits = np.stack([layer, layer, layer, layer])
    bits[2, 1, 5] ^= 1
    bits[3, 0, [3, 4]] = bits[3, 0, [4, 3]]
    assert bits[3, 0, 3] != bits[3, 0, 4]
    stats = _scan_in_chunks("torch.bfloat16", bits, 2)
    prints = [stats.slices[(i,)].fingerprint for i in range(4)]
    assert prints[0] == prints[1] and len(set(prints[1:])) == 3


def test_whole_is_computed_once_and_follows_later_chunks_and_merges():
    """KeyStats.whole() is kept until the key's slices change: a chunk scanned or a partial result merged after it
    was asked for gives the statistics of all of them."""
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 1 << 32, size=(4, 3, 64), dtype=np.uint64).astype("<u4")
    key = "decoder.layers.x.weight"
    expected = _scan_in_chunks("torch.float32", bits, 3).whole()

    def feed(scan: HealthScan, layers: range) -> KeyStats:
        for layer in layers:
            part = np.ascontiguousarray(bits[layer : layer + 1])
            scan.scan(key, "torch.float32", bits.shape, (layer, 0, 0), part.shape, part.tobytes())
        return scan.keys[key]

    scan = HealthScan()
    stats = feed(scan, range(2))
    early = stats.whole()
    assert stats.whole() is early and early != expected
    assert feed(scan, range(2, 4)).whole() == expected
    first, second = HealthScan(), HealthScan()
    feed(first, range(2)).whole()
    feed(second, range(2, 4)).whole()
    first.merge(second)
    assert first.keys[key].whole() == expected


_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def _scaled_value(dtype: str, bits: int) -> int | None:
    """:func:`_exact_value` times ``2^scale`` (an integer for every finite value), in integer arithmetic."""
    kind = KINDS[dtype]
    width = kind.itemsize * 8
    if not kind.is_float:
        return bits - (1 << width) if kind.signed and bits >> (width - 1) else bits
    exponent = (bits >> kind.fraction_bits) & ((1 << kind.exponent_bits) - 1)
    if exponent == (1 << kind.exponent_bits) - 1:
        return None
    significand = (bits & ((1 << kind.fraction_bits) - 1)) + ((1 << kind.fraction_bits) if exponent else 0)
    value = significand << (max(exponent, 1) - 1)
    return -value if bits >> (width - 1) else value


def _reference_hash(dtype: str, bits: int) -> int:
    """The fingerprint's hash of one element by its definition: a 32-bit multiply-xorshift for 4-byte elements,
    splitmix64 for the others."""
    if KINDS[dtype].itemsize == 4:
        x = (bits * 0x9E3779B1) & 0xFFFFFFFF
        return x ^ (x >> 16)
    return _splitmix64(bits)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16", "torch.float64", "torch.int32"])
def test_engine_blocks_agree_with_the_definitions(dtype):
    """Rows longer than the engine's blocks and slabs of many rows (the blocked passes, their seams), with NaN,
    Inf, -0, subnormals: every count and exact sum as the IEEE values define it, and the fingerprint as
    ``Σ c^i h(v_i) mod 2^64`` over the row-major index, computed element by element."""
    kind = KINDS[dtype]
    rng = np.random.default_rng(38)
    width = 8 * kind.itemsize
    shape = (3, 140_001)
    if kind.is_float and kind.itemsize == 4:  # trained-weight-like values, which take the float32 fast path
        bits = (rng.standard_normal(shape) * 0.02).astype(np.float32).view(np.uint32)
    else:
        bits = rng.integers(0, 1 << width, size=shape, dtype=np.uint64, endpoint=False).astype(_DTYPES[dtype])
    specials = [0, 1 << (width - 1), 1, (1 << (width - 1)) + 1]  # +0, -0, ±the smallest subnormal
    if kind.is_float:
        exponent = ((1 << kind.exponent_bits) - 1) << kind.fraction_bits
        specials += [exponent, exponent | 1, exponent | (1 << (width - 1))]  # +Inf, a NaN, -Inf
    bits[1, 131_070 : 131_070 + len(specials)] = specials  # across the 2^17-element seam
    scan = HealthScan()
    for row in range(shape[0]):  # one chunk per row; then rows 0-1 as one slab
        part = np.ascontiguousarray(bits[row : row + 1])
        scan.scan("x.weight", dtype, shape, (row, 0), part.shape, part.tobytes())
    moments = scan.keys["x.weight"].slices[()]
    flat = [int(b) for b in bits.reshape(-1)]
    values = [_scaled_value(dtype, b) for b in flat]
    finite = [v for v in values if v is not None]
    assert (moments.count, moments.finite) == (len(values), len(finite))
    assert moments.zeros == sum(1 for v in finite if v == 0)
    assert moments.total == sum(finite)
    assert moments.total_sq == sum(v * v for v in finite)
    scale = Fraction(2) ** kind.scale
    assert Fraction(moments.low) == min(finite) / scale and Fraction(moments.high) == max(finite) / scale
    fingerprint, power = 0, 1
    for b in flat:
        fingerprint = (fingerprint + power * _reference_hash(dtype, b)) & ((1 << 64) - 1)
        power = (power * _GOLDEN) & ((1 << 64) - 1)
    assert moments.fingerprint == fingerprint


@pytest.mark.parametrize(
    "name",
    ["core019_nan_weight_tp1", "core019_inf_exp_avg_sq_tp1", "core019_inf_exp_avg_sq_dp2", "core019_trained_tp1"],
)
def test_health_counts_nan_and_inf_as_deep_does(capsys, name):
    """With ``--health`` the NaN/Inf count (CKD313) comes from the statistics' own pass over a chunk that it reads
    whole: the same findings, word for word, as ``--deep``'s count, in model tensors and distributed-optimizer
    buckets (their padding chunks left out by both)."""
    fixture = str(FIXTURES / name)
    _, deep = _check(capsys, "--deep", "--select", "CKD313", fixture)
    _, health = _check(capsys, "--health", "--select", "CKD313", fixture)
    deep_findings = [(f["code"], f["message"]) for f in deep["findings"]]
    assert deep_findings == [(f["code"], f["message"]) for f in health["findings"]]
    assert bool(deep_findings) == (name != "core019_trained_tp1")


# --- many layers: the rules' work grows with the layers, not with their square ---------------------------------


def _slice(low: float, high: float, fingerprint: int = 0) -> Moments:
    return Moments(count=8, finite=8, low=low, high=high, total=1, total_sq=1, fingerprint=fingerprint)


def test_many_layers_of_equal_experts():
    """Thousands of layers (a hostile stacked shape) whose experts are equal: one finding a layer, each told whether
    another layer's experts differ (there: the last layer's)."""
    from ckptdoctor.rules import health as rules

    layers = 4000
    stats = KeyStats("torch.float32", (layers + 1, 2, 8), ("layer", "expert"))
    for layer in range(layers + 1):
        for expert in range(2):
            stats.slices[(layer, expert)] = _slice(0.5, 1.5, fingerprint=expert if layer == layers else 7)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    found = rules._equal_experts(Path("ckpt"), rules._expert_tensors({key: stats}, None))
    assert len(found) == layers
    assert {f.code for f in found} == {rules.EXPERTS_EQUAL_IN_LAYER.code}
    assert "decoder.layers.mlp.experts (layer 3999): all 2 experts are equal" in found[-1].message


def test_many_layers_at_init_beside_many_moved():
    """Half of thousands of layers with every norm scale exactly one, the other half moved: each of the first is a
    finding naming the moved layers the same way."""
    from ckptdoctor.rules import health as rules

    layers = 4000
    stats = KeyStats("torch.float32", (layers, 8), ("layer",))
    for layer in range(layers):
        stats.slices[(layer,)] = _slice(1.0, 1.0) if layer < layers // 2 else _slice(0.5, 1.5)
    model = {"decoder.layers.self_attention.linear_qkv.layer_norm_weight": stats}
    found = rules._layers_at_init(Path("ckpt"), model, None, None, rules.HealthSettings())
    assert len(found) == layers // 2
    assert {f.code for f in found} == {rules.LAYER_AT_INIT.code}
    assert found[0].message.startswith("layer 0: every norm scale exactly 1, as initialised,")  # no biases
    assert all(
        "while layer(s) 2000, 2001, 2002, 2003, 2004, 2005, 2006, 2007 and 1992 more moved" in f.message for f in found
    )


# --- small slices: a budget per checkpoint -----------------------------------------------------------------------


def test_crowded_keys_keep_small_slices_within_a_budget(monkeypatch):
    """Keys of slices under SMALL_SLICE_BYTES are kept per slice in key order while their slices fit the budget; one
    that would pass it is measured whole, a later one that fits is kept; slices of SMALL_SLICE_BYTES and more, and
    keys measured whole anyway, never count. The order the items come in does not matter."""
    import random

    monkeypatch.setattr(health, "MAX_SMALL_SLICES", 64)
    bf16, fp32 = "torch.bfloat16", "torch.float32"
    width = health.SMALL_SLICE_BYTES // 2  # bfloat16 elements of a slice just big enough to be free
    items = [
        ("a.layers.norm.weight", bf16, (40, 8)),  # 40 small slices: kept
        ("b.layers.norm.weight", bf16, (40, 8)),  # 80 would pass 64: measured whole
        ("c.layers.norm.weight", fp32, (24, width // 2 - 1)),  # 64: kept after b
        ("d.layers.fc.weight", bf16, (10_000, width)),  # big enough slices: free
        ("e.layers.experts.experts.scale", fp32, (2, 2, 4)),  # under MIN_SLICE_ELEMENTS: whole anyway
        ("f.norm.weight", bf16, (10_000, 8)),  # not stacked
        ("g.layers.experts.experts.bias", bf16, (4, 4, 8)),  # 16 slices of (layer, expert): 80 would pass 64
        ("h.layers.norm.weight", "torch.int8", (1, 8)),  # no slices below MIN_INTEGER_SLICE_ELEMENTS
        ("i.layers.norm.weight", None, (100, 8)),  # not a tensor dtype the statistics count
    ]
    assert health.crowded_keys(items) == {"b.layers.norm.weight", "g.layers.experts.experts.bias"}
    random.Random(5).shuffle(items)
    assert health.crowded_keys(items) == {"b.layers.norm.weight", "g.layers.experts.experts.bias"}


def test_a_crowded_key_is_measured_whole():
    """A crowded stacked key has the statistics of the same values under an unstacked name, in one slice."""
    values = np.random.default_rng(2).standard_normal((40, 8), dtype=np.float32).tobytes()
    crowded, plain = HealthScan(frozenset({"b.layers.norm.weight"})), HealthScan()
    crowded.scan("b.layers.norm.weight", "torch.float32", (40, 8), (0, 0), (40, 8), values)
    crowded.scan("a.layers.norm.weight", "torch.float32", (40, 8), (0, 0), (40, 8), values)
    plain.scan("b.norm.weight", "torch.float32", (40, 8), (0, 0), (40, 8), values)
    measured = crowded.keys["b.layers.norm.weight"]
    assert measured.axes == () and list(measured.slices) == [()]
    assert measured.whole() == plain.keys["b.norm.weight"].whole()
    assert crowded.keys["a.layers.norm.weight"].axes == ("layer",)
    assert len(crowded.keys["a.layers.norm.weight"].slices) == 40


def test_layer_at_init_names_biases_only_where_the_model_has_them():
    from ckptdoctor.rules import health as rules

    norms = KeyStats("torch.float32", (2, 8), ("layer",))
    norms.slices[(0,)], norms.slices[(1,)] = _slice(0.5, 1.5), _slice(1.0, 1.0)
    biases = KeyStats("torch.float32", (2, 8), ("layer",))
    biases.slices[(0,)] = _slice(-0.1, 0.1)
    biases.slices[(1,)] = Moments(count=8, finite=8, zeros=8, low=0.0, high=0.0)  # as Megatron initialises it
    model = {
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": norms,
        "decoder.layers.self_attention.linear_qkv.bias": biases,
    }
    (found,) = rules._layers_at_init(Path("ckpt"), model, None, None, rules.HealthSettings())
    assert found.message.startswith("layer 1: every norm scale exactly 1 and every bias 0, as initialised,")
