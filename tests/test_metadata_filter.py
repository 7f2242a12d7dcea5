"""The ``.metadata`` of strip-frozen and edit written from the source's bytes (``_metadata_filter.c``, issue #16 §1):
real torch reads what it writes as the object rewrite's edit of the same source, or it declines and the object
rewrite writes instead."""

from __future__ import annotations

import array
import json
import pickle
import pickletools
import random
import tempfile
from pathlib import Path

import pytest
from conftest import FIXTURES

from ckptdoctor.cli import main
from ckptdoctor.formats import metadata_filter, torch_dist
from ckptdoctor.formats.metadata_filter import Expected, Source, write_filtered
from ckptdoctor.formats.torch_dist import StorageLocation
from ckptdoctor.formats.torch_zip import load_torch_zip

pytest.importorskip("torch.distributed.checkpoint")  # the real classes, for pickle.loads

filter_metadata = pytest.importorskip("ckptdoctor._metadata_filter").filter_metadata

# core 0.14-0.15 pickle megatron-core's own classes (MCoreMetadata, MCoreSavePlan): reading them imports it
SOURCES = [
    pytest.param(path, marks=pytest.mark.mcore) if path.parts[-3] < "core016" else path
    for path in sorted(FIXTURES.glob("core0*/iter_*/.metadata"))
]


def same(a, b, path="$"):
    """Where two unpickled objects differ (types, dict keys in order, fields), or None."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys differ"
        return next((d for k in a if (d := same(a[k], b[k], f"{path}[{k!r}]"))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: {len(a)} != {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := same(x, y, f"{path}[{i}]"))), None)
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return same(vars(a), vars(b), path + ".")
    return None if a == b else f"{path}: {a!r} != {b!r}"


def edited(metadata, keep: set[str], compact: bool = False, repoint=None):
    """What the filter must write, made on the real torch objects: every place a key is listed edited as
    ``dcp_keys.edit_metadata`` does, storage compacted as ``dcp_writer.layout`` lays it out."""
    metadata.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items() if k in keep}
    metadata.storage_data = {i: v for i, v in metadata.storage_data.items() if i.fqn in keep}
    if isinstance(metadata.planner_data, dict):
        metadata.planner_data = {k: v for k, v in metadata.planner_data.items() if k in keep}
    plans = getattr(metadata, "all_local_plans", None) or []
    for holder in [metadata, *plans]:
        mcore_data = getattr(holder, "mcore_data", None)
        if isinstance(mcore_data, dict):
            for key in [k for k in mcore_data if k not in keep]:
                del mcore_data[key]
    for plan in plans:
        plan.items[:] = [w for w in plan.items if w.index.fqn in keep]
    ranges: dict[str, list] = {}
    if compact:
        by_file: dict[str, list] = {}
        for index, info in metadata.storage_data.items():
            if repoint is None or index.fqn != repoint[0]:
                by_file.setdefault(info.relative_path, []).append(info)
        for name, infos in sorted(by_file.items()):
            infos.sort(key=lambda s: (s.offset, s.length))
            ranges[name] = [(s.offset, s.length) for s in infos]
            position = 0
            for info in infos:
                info.offset, position = position, position + info.length
    if repoint is not None:
        for index, info in metadata.storage_data.items():
            if index.fqn == repoint[0]:
                info.relative_path, info.offset, info.length = repoint[1], 0, repoint[2]
    return metadata, ranges


def run_filter(data: bytes, keep, ranges=None, repoint=None) -> tuple[dict, bytes]:
    packed = None
    if ranges is not None:
        packed = {
            name: array.array("q", [v for pair in pairs for v in pair]).tobytes() for name, pairs in ranges.items()
        }
    with tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as out:
        source.write(data)
        source.flush()
        stats = filter_metadata(source.fileno(), keep, packed, repoint, out.fileno())
        out.seek(0)
        return stats, out.read()


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.parts[-3])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("compact", [False, True])
def test_the_filter_writes_what_the_object_edit_makes(source: Path, fraction: float, compact: bool):
    data = source.read_bytes()
    keys = list(pickle.loads(data).state_dict_metadata)
    rng = random.Random(f"{source}-{fraction}")
    keep = {k for k in keys if rng.random() < fraction}
    common = [k for k in keys if k.startswith("common_state")]
    repoint = (common[0], "common_state.new.distcp", 4321) if common and compact else None
    keep |= set(common[:1]) if repoint else set()
    want, ranges = edited(pickle.loads(data), keep, compact, repoint)
    stats, written = run_filter(data, keep, ranges if compact else None, repoint)
    assert "declined" not in stats, stats
    assert same(want, pickle.loads(written)) is None
    assert stats["keys_kept"] == len(keep) and stats["keys_dropped"] == len(keys) - len(keep)
    assert stats["storage_kept"] == len(want.storage_data)
    assert stats["repointed"] == (repoint is not None)
    if compact:
        assert stats["file_sizes"] == {name: sum(n for _o, n in pairs) for name, pairs in ranges.items()}
    if fraction == 1.0 and not compact:
        assert written == data  # nothing left out: the same bytes (frames rebuilt as the pickler lays them)


@pytest.mark.parametrize("protocol", [2, 4, 5, "optimized"])
def test_pickles_of_other_protocols_and_writers(protocol):
    """Protocol 2 (explicit memo indices: what ckptdoctor's own rewrites write), 5, and pickletools.optimize's
    output (unread memo writes dropped, the others renumbered)."""
    source = FIXTURES / "core019_tp2_dp2" / "iter_0000010" / ".metadata"
    metadata = pickle.loads(source.read_bytes())
    if protocol == "optimized":
        data = pickletools.optimize(source.read_bytes())
    else:
        data = pickle.dumps(metadata, protocol=protocol)
    keys = list(metadata.state_dict_metadata)
    keep = set(keys[::3])
    stats, written = run_filter(data, keep)
    assert "declined" not in stats
    assert same(edited(pickle.loads(data), keep)[0], pickle.loads(written)) is None


def _declined(data: bytes, keep=frozenset()) -> str:
    stats, _written = run_filter(data, set(keep))
    assert "declined" in stats, stats
    return stats["declined"]


def test_it_declines_what_it_cannot_edit_for_certain():
    source = FIXTURES / "core019_tp1" / "iter_0000010" / ".metadata"
    metadata = pickle.loads(source.read_bytes())
    metadata.planner_data = metadata.state_dict_metadata  # one dict in two places: the second is a memo read
    assert "not a plain one" in _declined(pickle.dumps(metadata, protocol=4))
    # a memo write of an index other than the next one (the text PUT's and some writers' way)
    data = pickle.dumps(pickle.loads(source.read_bytes()), protocol=2)
    second_put = [pos for op, _arg, pos in pickletools.genops(data) if op.name == "BINPUT"][1]
    assert "sequence" in _declined(data[: second_put + 1] + b"\xc8" + data[second_put + 2 :])
    assert "protocol" in _declined(pickle.dumps(pickle.loads(source.read_bytes()), protocol=1))
    assert "Metadata" in _declined(b"\x80\x04N.")
    # a batch of 100k items on the stack (Python's pickler batches 1,000): declined before it takes GBs
    assert "deeper" in _declined(b"\x80\x04(" + b"N" * 100_000 + b"l.")


def test_a_build_through_a_memo_read_is_declined():
    """A second BUILD of an object (here through a memo read, before the STOP) could change what the filter
    edited after it edited it."""
    data = (FIXTURES / "core019_tp1" / "iter_0000010" / ".metadata").read_bytes()
    stop = data.rindex(b".")
    assert "memo read" in _declined(data[:stop] + b"h\x03}b0" + data[stop:])


def test_counts_that_differ_from_the_index_keep_nothing(tmp_path: Path):
    source = FIXTURES / "core019_tp1" / "iter_0000010" / ".metadata"
    index = torch_dist.read_metadata(source)
    keep = set(list(index.items)[:5])
    chunks = sum(1 for k in keep for c in index.items[k].chunks if c.storage is not None)
    read = Source(source, index.source_identity)
    wrong = Expected(len(keep) + 1, chunks)
    outcome = write_filtered(read, tmp_path / ".metadata", keep, wrong, None)
    assert outcome.reason is not None and "kept" in outcome.reason
    assert list(tmp_path.iterdir()) == []  # the temp file went with it
    right = Expected(len(keep), chunks)
    outcome = write_filtered(read, tmp_path / ".metadata", keep, right, None)
    assert outcome.reason is None and [p.name for p in tmp_path.iterdir()] == [".metadata"]
    assert set(torch_dist.read_metadata(tmp_path / ".metadata").items) == keep


def _metadata_objects(out: Path):
    """The .metadata written, the common state's item checked against its file and its length then left out of the
    comparison (one process pickles the same common state to more or fewer bytes, as its string sharing goes)."""
    path = next(out.rglob(".metadata"))
    metadata = pickle.loads(path.read_bytes())
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("common_state") and info.relative_path.startswith("common_state."):
            assert info.offset == 0 and info.length == (path.parent / info.relative_path).stat().st_size
            info.length = None
    return metadata


@pytest.mark.parametrize(
    "command",
    [
        ["strip-frozen", str(FIXTURES / "core019_peft_full_tp2")],
        ["strip-frozen", str(FIXTURES / "core016_peft_full_tp1")],
        ["edit", str(FIXTURES / "core019_moe_ep2"), "--remove", r"^optimizer\.", "--compact"],
        pytest.param(["edit", str(FIXTURES / "core015_tp2"), "--drop-section", "optimizer"], marks=pytest.mark.mcore),
        pytest.param(
            ["edit", str(FIXTURES / "core014_tp1"), "--drop-extra-state", "--compact"], marks=pytest.mark.mcore
        ),
    ],
    ids=["strip-019", "strip-016", "edit-compact", "edit-drop-015", "edit-extra-014"],
)
def test_commands_write_what_the_object_rewrite_writes(monkeypatch, tmp_path: Path, capsys, command):
    results = {}
    for how in ("filtered", "objects"):
        if how == "objects":
            monkeypatch.setenv("CKPTDOCTOR_NO_METADATA_FILTER", "1")
        out = tmp_path / how
        assert main([*command, "--output", str(out), "--format", "json"]) == 0
        report = json.loads(capsys.readouterr().out)
        results[how] = (out, report)
    (filtered, report), (objects, _) = results["filtered"], results["objects"]
    assert report["result"]["metadata_filter"] == "filtered"
    assert same(_metadata_objects(objects), _metadata_objects(filtered)) is None
    for path in sorted(objects.rglob("*.distcp")):
        twin = filtered / path.relative_to(objects)
        if path.name.startswith("common_state."):  # the same state, pickled in one process to other bytes
            assert load_torch_zip(twin, str(twin)) == load_torch_zip(path, str(path))
        else:
            assert twin.read_bytes() == path.read_bytes()
    assert main(["check", str(filtered)]) == 0


def test_a_declined_filter_leaves_the_object_rewrite_to_write(monkeypatch, tmp_path: Path, capsys):
    def declining(src_fd, keep, expected, repoint, out_fd):
        return {"declined": "told to"}

    monkeypatch.setattr(metadata_filter, "_filter", declining)
    source = FIXTURES / "core019_peft_full_tp1"
    assert main(["strip-frozen", str(source), "--output", str(tmp_path / "out"), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["result"]["metadata_filter"] == "declined: told to"
    assert main(["check", str(tmp_path / "out")]) == 0
    assert not [p for p in (tmp_path / "out").rglob("*") if ".part" in p.name]


def test_the_repointed_location_is_what_the_hook_wrote():
    location = StorageLocation("common_state.x.distcp", 0, 17)
    source = FIXTURES / "core019_tp1" / "iter_0000010" / ".metadata"
    keys = list(pickle.loads(source.read_bytes()).state_dict_metadata)
    common = next(k for k in keys if k.startswith("common_state"))
    stats, written = run_filter(source.read_bytes(), set(keys), None, (common, location.relative_path, location.length))
    info = next(v for i, v in pickle.loads(written).storage_data.items() if i.fqn == common)
    assert (info.relative_path, info.offset, info.length) == tuple(location)


def test_only_the_file_the_index_read_unchanged_and_allowlisted_is_filtered(tmp_path: Path):
    """The filter copies the source's globals: it writes only from bytes the index read passed (same file, not
    written since) and only where that read met no global outside the allowlist."""
    source = tmp_path / ".metadata"
    source.write_bytes((FIXTURES / "core019_tp1" / "iter_0000010" / ".metadata").read_bytes())
    index = torch_dist.read_metadata(source)
    keep = set(index.items)
    expected = Expected(len(keep), sum(1 for k in keep for c in index.items[k].chunks if c.storage is not None))
    out = tmp_path / "out"
    out.mkdir()
    unlisted = write_filtered(Source(source, index.source_identity, ("megatron.x.Y",)), out / "m", keep, expected, None)
    assert unlisted.reason is not None and "allowlist" in unlisted.reason
    with source.open("r+b") as f:  # written since (the same bytes: only the inode's change time tells)
        f.write(source.read_bytes()[:1])
    changed = write_filtered(Source(source, index.source_identity), out / "m", keep, expected, None)
    assert changed.reason is not None and "changed" in changed.reason
    assert list(out.iterdir()) == []
    fresh = torch_dist.read_metadata(source)
    assert write_filtered(Source(source, fresh.source_identity), out / "m", keep, expected, None).reason is None
