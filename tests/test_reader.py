"""Our reader against megatron-core's own report of every fixture (manifests made by fixtures/generate.py)."""

from __future__ import annotations

import json
import random
import re

import pytest
from conftest import FIXTURES, fixture_names, manifest

from ckptdoctor.args import args_as_dict
from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.parallelism import infer_layout

NAMES = fixture_names()


def test_fixtures_present():
    assert {"core016_tp1", "core016_tp2", "core019_tp1", "core019_tp2"} <= set(NAMES)


def _expected_entries(name: str) -> dict[str, dict]:
    """DCP keys as megatron-core names them: tensors by key, ShardedObjects as key/shard_<off>_<shape>."""
    expected = {}
    for key, meta in manifest(name)["keys"].items():
        if meta["kind"] == "tensor":
            expected[key] = meta
        else:
            for shard in meta["shards"]:
                expected[f"{key}/{shard}"] = meta
    return expected


@pytest.mark.parametrize("name", NAMES)
def test_keys_shapes_dtypes_match_megatron(name):
    ckpt = open_checkpoint(FIXTURES / name)
    expected = _expected_entries(name)
    assert set(ckpt.entries) == set(expected)
    for key, meta in expected.items():
        entry = ckpt.entries[key]
        if meta["kind"] == "tensor":
            assert entry.kind == "tensor", key
            assert list(entry.shape) == meta["global_shape"], key
            assert entry.dtype == meta["dtype"], key
            assert len(entry.chunks) == meta["chunks"], key
            covered = sum(_prod(c.sizes) for c in entry.chunks)
            assert covered == entry.numel, key  # chunks tile the global shape
        else:
            assert entry.kind == "bytes", key
        assert all(c.storage is not None for c in entry.chunks), key


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


@pytest.mark.parametrize("name", NAMES)
def test_inferred_layout_matches_manifest_and_saved_args(name):
    info = manifest(name)
    ckpt = open_checkpoint(FIXTURES / name)
    layout = infer_layout(ckpt)
    args = args_as_dict(ckpt.args)
    assert layout.tp == info["tp"] == args["tensor_model_parallel_size"]
    if ckpt.location.backend == "zarr":
        assert layout.pp is None  # zarr chunk files carry no writer rank
    else:
        assert layout.pp == info["pp"] == args["pipeline_model_parallel_size"]
        assert 1 <= len(layout.writer_ranks) <= info["world_size"]
    if info.get("ep", 1) > 1:
        assert layout.ep == info["ep"] == args["expert_model_parallel_size"]
    if args.get("num_experts"):  # how one expert is cut: ETP, TP where the run set none
        assert layout.etp == info.get("etp", layout.tp)
        if "converted_from" not in info:  # converters copy ETP from their source (check: CKD203)
            assert layout.etp == (args.get("expert_tensor_parallel_size") or layout.tp)
    else:
        assert layout.etp is None


@pytest.mark.parametrize("name", NAMES)
def test_common_state_matches_manifest(name):
    info = manifest(name)
    ckpt = open_checkpoint(FIXTURES / name)
    common = ckpt.common_state()
    assert sorted(common) == sorted(info["common_state_keys"])
    assert common["iteration"] == info["iteration"]
    assert ckpt.location.iteration == info["iteration"]
    core = info["megatron_core"]
    expect_common_pt = tuple(int(x) for x in core.split(".")[:2]) <= (0, 18)
    assert ckpt.location.has_common_pt == expect_common_pt
    assert ckpt.common_source == ("common.pt" if expect_common_pt else "common_state/shard_0_1")


@pytest.mark.parametrize("name", NAMES)
def test_sections(name):
    ckpt = open_checkpoint(FIXTURES / name)
    sections = {e.section for e in ckpt.entries.values()}
    assert "model" in sections
    # an MoE model's ChainedOptimizer saves its dp_reshardable buckets under chained_<i>. (dense 0, experts 1)
    optimizer_key = re.compile(r"(chained_[0-9]+\.)?optimizer\.")
    expected_optimizer = any(optimizer_key.match(k) for k in manifest(name)["keys"])
    assert ("optimizer" in sections) == expected_optimizer
    assert ("rng" in sections) == any(k.startswith("rng_state") for k in manifest(name)["keys"])
    assert all(optimizer_key.match(e.key) for e in ckpt.section_entries("optimizer"))
    assert all(e.kind == "bytes" for e in ckpt.section_entries("rng"))


def test_read_chunk_decodes_the_stored_blob():
    """Our chunk decoder against torch's own loader on the same byte range, for every chunk of one key."""
    torch = pytest.importorskip("torch")
    import io

    from ckptdoctor.formats.torch_dist import read_range
    from ckptdoctor.values.read import read_chunk, read_tensor

    ckpt = open_checkpoint(FIXTURES / "core019_tp2")
    key = "decoder.layers.mlp.linear_fc1.weight"
    entry = ckpt.entries[key]
    for index, chunk in enumerate(entry.chunks):
        blob = read_range(ckpt.iteration_dir, chunk.storage)
        reference = torch.load(io.BytesIO(blob), weights_only=True)
        ours = read_chunk(ckpt, key, index)
        assert ours.dtype == reference.dtype and torch.equal(ours, reference)
    whole = read_tensor(ckpt, key)
    assert list(whole.shape) == list(entry.shape)
    assert not torch.isnan(whole).any()


@pytest.mark.mcore
def test_common_state_values_equal_torch_load():
    torch = pytest.importorskip("torch")
    from conftest import require_mcore

    require_mcore()
    ckpt = open_checkpoint(FIXTURES / "core016_tp1")
    ours = args_as_dict(ckpt.args)
    real = vars(torch.load(FIXTURES / "core016_tp1/iter_0000010/common.pt", weights_only=False)["args"])
    assert set(ours) == set(real)
    plain = (int, float, str, bool, type(None))
    compared = 0
    for k, v in real.items():
        if isinstance(v, plain) or (isinstance(v, list) and all(isinstance(x, plain) for x in v)):
            assert ours[k] == v, k
            compared += 1
    assert compared > 40


def test_corrupt_storage_record_is_a_clean_error(copy_fixture):
    """A flipped byte inside a chunk's data record fails its CRC: one CkptError naming the chunk, no zipfile error."""
    pytest.importorskip("torch")
    import zipfile

    from ckptdoctor.errors import CkptError
    from ckptdoctor.values.read import read_chunk

    save = copy_fixture("core019_tp1")
    ckpt = open_checkpoint(save)
    key = "embedding.word_embeddings.weight"
    storage = ckpt.entries[key].chunks[0].storage
    path = ckpt.iteration_dir / storage.relative_path
    data = bytearray(path.read_bytes())
    blob = bytes(data[storage.offset : storage.offset + storage.length])
    import io

    info = next(i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist() if "/data/" in i.filename)
    import struct

    name_len, extra_len = struct.unpack_from("<HH", blob, info.header_offset + 26)  # the local header's own
    data[storage.offset + info.header_offset + 30 + name_len + extra_len + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CkptError, match="fails its CRC-32"):
        read_chunk(open_checkpoint(save), key, 0)


@pytest.mark.parametrize("name", [n for n in NAMES if (FIXTURES / n).is_dir() and "zarr" not in n])
def test_index_only_reading_builds_the_index_the_rewrite_path_builds(name):
    """``read_metadata`` (index-only records, emptied as they are read) and ``read_metadata_for_rewrite``
    (faithful stand-ins, kept whole for writing back) give equal indexes; equal tuples are shared."""
    from ckptdoctor.formats import torch_dist
    from ckptdoctor.locate import locate

    path = locate(FIXTURES / name).iteration_dir / ".metadata"
    lean = torch_dist.read_metadata(path)
    faithful, metadata = torch_dist.read_metadata_for_rewrite(path)
    assert list(lean.items) == list(faithful.items)
    assert all(item == faithful.items[key] for key, item in lean.items.items())
    assert (lean.version, lean.metadata_class, lean.checkpoint_id, lean.extra, lean.unlisted) == (
        faithful.version,
        faithful.metadata_class,
        faithful.checkpoint_id,
        faithful.extra,
        faithful.unlisted,
    )
    assert torch_dist.storage_items(metadata)  # the rewrite path's object is left whole
    sizes = [c.sizes for item in lean.items.values() for c in item.chunks]
    assert len({id(s) for s in sizes}) == len(set(sizes))  # one tuple object per distinct value
    paths = [c.storage.relative_path for item in lean.items.values() for c in item.chunks if c.storage]
    assert len({id(p) for p in paths}) == len(set(paths))


def _groups_unit_by_unit(spans: list[tuple[int, int, set]]) -> tuple[int, int]:
    """(units, groups) of writer-rank spans the plain way: a set of ranks per unit, units joined by a shared rank."""
    ranks_of: dict[int, set] = {}
    for start, end, ranks in spans:
        for unit in range(start, end):
            ranks_of.setdefault(unit, set()).update(r for r in ranks if r is not None)
    groups: list[tuple[set, set]] = []  # (units, ranks)
    for unit, ranks in ranks_of.items():
        joined = [g for g in groups if g[1] & ranks]
        merged = ({unit} | set().union(*(g[0] for g in joined)), set(ranks).union(*(g[1] for g in joined)))
        groups = [g for g in groups if not g[1] & ranks] + [merged]
    return len(ranks_of), len(groups)


def test_layer_and_expert_groups_by_spans_equal_unit_by_unit():
    """infer_layout's pipeline stages (and expert groups) from chunk spans equal the unit-by-unit count: overlapping,
    touching and disjoint spans, a rank on several spans, chunks without a named writer rank."""
    from ckptdoctor.parallelism import _Coverage

    rng = random.Random(11)
    for _ in range(3000):
        coverage, spans = _Coverage(), []
        for _ in range(rng.randrange(1, 7)):
            start = rng.randrange(-3, 12)
            span = (start, start + rng.randrange(0, 5), set(rng.sample([0, 1, 2, 3, 4, None], rng.randrange(0, 3))))
            spans.append(span)
            if len(span[2]) == 1:  # one chunk's writer rank (or None: no named rank)
                coverage.add_one(span[0], span[1], next(iter(span[2])))
            else:
                coverage.add(*span)
        units, groups = _groups_unit_by_unit(spans)
        assert (coverage.units(), coverage.groups() if coverage else 0) == (units, groups if units else 0), spans


def test_a_chunk_of_two_to_the_forty_layers_is_read_at_once(copy_fixture):
    """A hostile .metadata giving one stacked chunk 2^40 layers (a few bytes): the layout is inferred from spans,
    not layer by layer (which took 80 s and GBs in every command that shows the layout)."""
    import subprocess
    import sys

    from ckptdoctor.formats.torch_dist import dump_metadata_object, load_metadata_object

    save = copy_fixture("core015_tp2")
    path = save / "iter_0000010" / ".metadata"
    metadata = load_metadata_object(path)
    item = metadata.state_dict_metadata["decoder.layers.mlp.linear_fc1.weight"]
    chunk = item.chunks[-1]
    chunk.__dict__["sizes"] = type(chunk.sizes)((1 << 40, *chunk.sizes[1:]))
    item.__dict__["size"] = type(item.size)((chunk.offsets[0] + (1 << 40), *item.size[1:]))
    path.write_bytes(dump_metadata_object(metadata))
    command = [sys.executable, "-m", "ckptdoctor", "inspect", "--format", "json", str(save)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    layout = json.loads(proc.stdout)["layout"]
    assert layout["layers"] == chunk.offsets[0] + (1 << 40) and layout["pp"] == 1
