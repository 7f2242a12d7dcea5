"""A corpus of hostile pickles and archives, built here, run through the real CLI in a child process.

Each case expects a check rule code (or a one-line error naming the file from the other commands), and a
marker file that a payload would create must never appear. Every child runs under an address-space limit
and a timeout, so a case that balloons or hangs fails instead of taking the machine down.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from conftest import FIXTURES, run_ckptdoctor
from hostile_corpus import (
    DEEP_LISTS,
    RESOURCE_CASES,
    billion_laughs,
    call,
    colliding_pairs,
    deflate_bomb,
    stack_global,
    torch_zip,
)

from ckptdoctor.errors import CkptError, PickleLimitError, UnsafePickleError
from ckptdoctor.formats.torch_dist import (
    StorageLocation,
    dump_metadata_object,
    index_fqn,
    load_metadata_object,
    set_storage,
    storage_items,
)
from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.policy import trusting
from ckptdoctor.pickle.torch_stand_ins import DtypeRef

COMMON_ERA = "core016_tp1"  # common state in common.pt
ITER = "iter_0000010"
# Address space each child may add to what it starts with: far above a metadata command (whose read of
# .metadata asks for a buffer of the 1 GiB pickle limit), far below a balloon.
MEMORY_LIMIT = 1536 << 20


def run_limited(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m ckptdoctor ARGS`` in a child process (forked: see conftest.run_ckptdoctor) with an
    address-space limit and a timeout (a hang fails the test)."""
    return run_ckptdoctor(*args, timeout=timeout, memory_headroom=MEMORY_LIMIT)


@pytest.fixture
def save_dir(tmp_path):
    def _copy(name: str = COMMON_ERA) -> Path:
        dest = tmp_path / name
        shutil.copytree(FIXTURES / name, dest)
        return dest

    return _copy


def check_json(*paths: Path, deep: bool = False) -> tuple[int, dict]:
    args = ["check", "--format", "json", *(["--deep"] if deep else []), *map(str, paths)]
    proc = run_limited(*args)
    assert proc.returncode in (0, 1), proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def codes(report: dict) -> list[str]:
    return [f["code"] for f in report["findings"]]


WRITE_COMMANDS = frozenset({"fix-args", "edit", "strip-frozen", "repair", "seal"})


def assert_one_line_error(proc: subprocess.CompletedProcess, names: str) -> None:
    """One line naming ``names``; exit 2, or 1 where a write command refuses what fails the gate (a finding
    about the checkpoint, with its CKD4xx code)."""
    write = any(str(arg) in WRITE_COMMANDS for arg in list(proc.args)[:6])
    expected = 1 if write and re.search(r"CKD40[1-5] ", proc.stderr) else 2
    assert proc.returncode == expected, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptdoctor: error: "), proc.stderr
    assert names in lines[0], lines[0]
    assert "internal error" not in proc.stderr


def marker_payloads(marker: Path) -> dict[str, bytes]:
    """Pickles that would create ``marker`` if a real loader ran them (each refused by name)."""
    touch = f"touch {marker}"
    return {
        "os.system": f"cos\nsystem\n(S'{touch}'\ntR.".encode(),
        "posix.system": call("posix", "system", touch),
        "torch + dotted os.system": call("torch", "os.system", touch),
        "torch.jit execWrapper": call("torch.jit.unsupported_tensor_ops", "execWrapper", touch),
        "numpy runstring": call("numpy.testing._private.utils", "runstring", f"open({str(marker)!r}, 'w')"),
        "builtins.eval": call("builtins", "eval", f"open({str(marker)!r}, 'w')"),
        "newline in name": b"\x80\x04"
        + stack_global("torch", "Size\n0cposix\nsystem\n(Vtouch x\ntR0ctorch\nSize")
        + b")R.",
        "torch.storage._load_from_bytes": call("torch.storage", "_load_from_bytes", touch),
        "subprocess via getattr": call("builtins", "getattr", "subprocess"),
    }


MARKER_CASES = list(marker_payloads(Path("/x")))


@pytest.mark.parametrize("case", MARKER_CASES)
def test_unsafe_metadata_is_ckd401_and_an_error_elsewhere(save_dir, tmp_path, case):
    marker = tmp_path / "marker"
    save = save_dir()
    (save / ITER / ".metadata").write_bytes(marker_payloads(marker)[case])
    rc, report = check_json(save)
    assert rc == 1 and codes(report) == ["CKD401"], report
    assert ".metadata" in report["findings"][0]["path"]
    for command in (["inspect"], ["fix-args"], ["strip-frozen", "--dry-run"]):
        assert_one_line_error(run_limited(*command, str(save)), ".metadata")
    assert not marker.exists()


@pytest.mark.parametrize("case", MARKER_CASES)
def test_unsafe_common_state_is_ckd401(save_dir, tmp_path, case):
    marker = tmp_path / "marker"
    save = save_dir()
    (save / ITER / "common.pt").write_bytes(torch_zip(marker_payloads(marker)[case]))
    rc, report = check_json(save)
    assert rc == 1 and "CKD401" in codes(report), report
    assert_one_line_error(run_limited("inspect", str(save)), "common.pt")
    assert not marker.exists()


def test_newline_name_never_reaches_a_written_pickle():
    # Reading refuses it; and even a stand-in made for such a name cannot be written back.
    with pytest.raises(UnsafePickleError, match="not a valid dotted Python name"):
        unpickler.loads(b"\x80\x04" + stack_global("torch", "Size\ncposix\nsystem") + b".")
    with pytest.raises(UnsafePickleError):
        unpickler.loads(b"\x80\x04" + stack_global("megatron.core\nx", "Enum") + b".")
    from ckptdoctor.pickle.stand_ins import stand_in_class

    with pytest.raises(ValueError):
        stand_in_class("torch", "Size\ncposix\nsystem")


def test_every_written_pickle_is_read_back_through_the_allowlist(monkeypatch):
    from ckptdoctor.pickle import stand_ins

    value = stand_ins.stand_in_class("megatron.core.enums", "ModelType")(1)
    assert unpickler.loads(unpickler.dumps(value)) == value
    # Corrupt the alias table as a bug would: the written bytes now name os.system, and dumps refuses them.
    alias = next(k for k, v in stand_ins.ALIAS_TARGETS.items() if v == b"megatron.core.enums\nModelType\n")
    monkeypatch.setitem(stand_ins.ALIAS_TARGETS, alias, b"os\nsystem\n")
    with pytest.raises(CkptError, match="os.system"):
        unpickler.dumps(value)


def test_unlisted_megatron_global_fails_the_gate_but_inspect_reads_it(save_dir):
    save = save_dir()
    path = save / ITER / "common.pt"
    state = load_torch_zip(path, str(path))
    with trusting(["megatron.core.brand_new.FutureConfig"]):  # our writer refuses it otherwise
        state["extra"] = unpickler.loads(call("megatron.core.brand_new", "FutureConfig", "x"))
        path.write_bytes(dump_torch_zip(state))
    rc, report = check_json(save)
    assert rc == 1 and codes(report) == ["CKD402"], report  # the next loader imports and calls it
    assert report["findings"][0]["severity"] == "error" and report["safe_for_loaders"] is False
    assert "megatron.core.brand_new.FutureConfig, a called object" in report["findings"][0]["message"]
    assert run_limited("inspect", str(save)).returncode == 0  # still read (as an inert stand-in) to look at


# --- resources ---------------------------------------------------------------------------------------------


RESOURCE_CODES = {"deque(range(10**15))": "CKD401", "_reconstructor of bytes": "CKD401"}


@pytest.mark.parametrize("case", list(RESOURCE_CASES))
def test_resource_case_in_metadata_is_a_finding(save_dir, case):
    save = save_dir()
    (save / ITER / ".metadata").write_bytes(RESOURCE_CASES[case])
    rc, report = check_json(save)
    assert rc == 1 and codes(report) == [RESOURCE_CODES.get(case, "CKD403")], report
    assert_one_line_error(run_limited("inspect", str(save)), ".metadata")


@pytest.mark.parametrize("case", list(RESOURCE_CASES))
def test_resource_case_in_common_state_is_a_finding(save_dir, case):
    save = save_dir()
    (save / ITER / "common.pt").write_bytes(torch_zip(RESOURCE_CASES[case]))
    rc, report = check_json(save)
    assert rc == 1 and RESOURCE_CODES.get(case, "CKD403") in codes(report), report
    for command in ("inspect", "fix-args"):
        assert_one_line_error(run_limited(command, str(save)), "common.pt")


def test_billion_laughs_in_args_is_bounded(save_dir):
    save = save_dir()
    path = save / ITER / "common.pt"
    state = load_torch_zip(path, str(path))
    state["args"].hidden_size = billion_laughs()
    state["args"].made_up_arg = billion_laughs()
    path.write_bytes(dump_torch_zip(state))
    assert path.stat().st_size < 100_000
    for command in (
        ["inspect"],
        ["inspect", "--format", "json"],
        ["check"],
        ["fix-args"],
        ["diff", str(FIXTURES / COMMON_ERA)],
    ):
        proc = run_limited(*command, str(save), timeout=60)
        assert proc.returncode in (0, 1, 2) and "internal error" not in proc.stderr, (command, proc.stderr[-500:])
        if proc.returncode == 2:  # internal errors exit 2 too: a clean one is one "ckptdoctor: error:" line
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("ckptdoctor: error: "), (command, proc.stderr[-500:])
        assert len(proc.stdout) < 2_000_000, command


def test_a_huge_int_in_args_is_a_limit_not_an_internal_error(save_dir):
    save = save_dir()
    path = save / ITER / "common.pt"
    state = load_torch_zip(path, str(path))
    state["args"].seq_length = 10**5000  # ~2 KB of pickle; str() of it raises ValueError (4,300-digit limit)
    path.write_bytes(dump_torch_zip(state))
    rc, report = check_json(save)
    assert rc == 1 and codes(report) == ["CKD403"] and "integer of" in report["findings"][0]["message"], report
    for command in (["inspect"], ["fix-args"]):
        assert_one_line_error(run_limited(*command, str(save)), "common.pt")
    proc = run_limited("can-load", "--target", "tp=1", str(save))  # a prediction: the load fails the gate
    assert proc.returncode == 1 and "safety     fails     unsafe: loading runs code" in proc.stdout, proc.stdout
    assert "CKD403" in proc.stdout and "Traceback" not in proc.stderr


def test_a_key_with_a_lone_surrogate_is_shown_escaped(save_dir):
    """A pickle's strings may hold lone surrogates, which no output encoding can write (UnicodeEncodeError)."""
    save = save_dir("core019_tp1")
    path = save / ITER / ".metadata"
    metadata = load_metadata_object(path)
    old, new = "decoder.final_layernorm.weight", "decoder.final_\ud800layernorm.weight"
    metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
    storage = storage_items(metadata)
    for index in [i for i in storage if index_fqn(i) == old]:
        index.__dict__["fqn"] = new
        storage[index] = storage.pop(index)
    path.write_bytes(dump_metadata_object(metadata))
    for command in (
        ["inspect", "--keys", str(save)],
        ["diff", str(save), str(FIXTURES / "core019_tp1")],
        ["edit", str(save), "--rename", "final_", "FINAL_", "--dry-run", "--keys"],
        ["strip-frozen", str(save), "--dry-run", "--keys"],
        ["show", str(save), "decoder.final_"],
    ):
        proc = run_limited(*command)
        assert proc.returncode in (0, 1, 2) and "internal error" not in proc.stderr, (command, proc.stderr)
        assert "final_\\ud800layernorm" in proc.stdout + proc.stderr, (command, proc.stdout)


def test_json_output_stays_strict_json_with_non_finite_floats(save_dir):
    """NaN and Infinity are no JSON (json.dumps writes them anyway; strict parsers, jq, JavaScript refuse)."""
    save = save_dir()
    path = save / ITER / "common.pt"
    state = load_torch_zip(path, str(path))
    state["args"].lr, state["args"].hidden_size = float("nan"), float("inf")
    state["num_floating_point_operations_so_far"] = float("-inf")
    path.write_bytes(dump_torch_zip(state))

    def refuse(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant}")

    for command in (
        ["inspect", str(save)],
        ["diff", str(save), str(FIXTURES / COMMON_ERA)],
        ["fix-args", str(save)],
        ["check", str(save)],
        ["can-load", str(save), "--target", "tp=1"],
    ):
        proc = run_limited(*command, "--format", "json")
        assert proc.returncode in (0, 1), proc.stderr
        report = json.loads(proc.stdout, parse_constant=refuse)
        if command[0] == "inspect":
            assert report["args"]["model shape"]["hidden_size"] == "Infinity", report["args"]


@pytest.mark.parametrize(
    "sizes, why",
    [
        ((2**500,), "an int of 501 bits"),
        ((2**62, 4), "2**63 elements or more"),
        ((-1,), "-1, not an int64 size"),
    ],
)
def test_sizes_that_are_no_int64_are_refused_by_the_reader(save_dir, sizes, why):
    """A chunk's sizes and a global shape are int64 in torch; from a pickle they could be any int, and an
    element count of thousands of digits cannot be printed (nor turned into a float)."""
    save = save_dir("core019_tp1")
    path = save / ITER / ".metadata"
    metadata = load_metadata_object(path)
    item = metadata.state_dict_metadata["decoder.final_layernorm.weight"]
    size_type = type(item.size)

    def size(dims: tuple) -> tuple:  # built as a pickle would have it (Size() itself refuses what torch.Size does)
        return tuple.__new__(size_type, dims)

    item.__dict__["size"] = size(sizes)
    item.chunks[0].__dict__.update(sizes=size(sizes), offsets=size((0,) * len(sizes)))
    path.write_bytes(unpickler._pickled(metadata, None))  # unchecked: ckptdoctor's own writer refuses to write it
    rc, report = check_json(save)
    found = [f for f in report["findings"] if f["code"] == "CKD111"]
    assert rc == 1 and found and why in found[0]["message"], report
    for command in ("inspect", "diff"):
        args = [command, str(save)] + ([str(FIXTURES / "core019_tp1")] if command == "diff" else [])
        assert_one_line_error(run_limited(*args), why)


def test_a_size_that_is_an_object_is_named_by_its_type():
    """A reader-built object where a size belongs (a mutated pickle's callable, say) is named by its type, or by the
    global a stand-in stands for: its repr would name the reader's internals, which differ between the C and the
    Python reads, so the same file gave two messages."""
    from ckptdoctor.formats.dcp_index import IndexValueError, int64_dims
    from ckptdoctor.pickle.stand_ins import stand_in_class

    for value, shown in (
        (functools.partial(len, "x"), "a functools.partial object"),
        (object.__new__(stand_in_class("fractions", "Fraction")), "a fractions.Fraction object"),
        (1.5, "1.5"),
    ):
        with pytest.raises(IndexValueError) as raised:
            int64_dims((3, value), "k", "sizes")
        assert str(raised.value) == f"'k': sizes hold {shown}, not an int64 size"


@pytest.mark.parametrize("shape, why", [([2**62, 4], "int64 sizes"), ([10**4000, 10**4000], "4001 digits")])
def test_a_zarr_shape_that_is_no_int64_is_invalid_metadata(save_dir, shape, why):
    """Each int64, their element count not; or ints of thousands of digits (each prints, their product does not)."""
    save = save_dir("core014_zarr_tp2")
    zarray = save / ITER / "decoder.final_layernorm.weight" / ".zarray"
    meta = json.loads(zarray.read_text())
    meta["shape"] = meta["chunks"] = shape
    zarray.write_text(json.dumps(meta))
    rc, report = check_json(save)
    assert rc == 1 and "CKD111" in codes(report), report
    assert_one_line_error(run_limited("inspect", str(save)), why)


@pytest.mark.parametrize("target", ["iter_0000010/metadata.json", "iter_0000010/integrity.json"])
def test_a_json_int_of_thousands_of_digits_is_invalid_json(save_dir, target):
    """json.loads raises a plain ValueError past 4,300 digits (not JSONDecodeError): it was an internal error."""
    save = save_dir("core019_tp1")
    (save / target).write_text('{"sharded_backend": "torch_dist", "files": {}, "n": ' + "9" * 5000 + "}")
    rc, report = check_json(save)
    assert rc == 1 and report["findings"], report
    assert any("5000 digits" in f["message"] for f in report["findings"]), report
    if target.endswith("metadata.json"):
        assert_one_line_error(run_limited("inspect", str(save)), "5000 digits")


def test_deeply_nested_lists_are_one_line(save_dir):
    save = save_dir()
    # [[[[...]]]] a million deep: lists nest without the tuple limit, so every command must stay clean.
    (save / ITER / "common.pt").write_bytes(torch_zip(DEEP_LISTS))
    for command in ("inspect", "check", "fix-args"):
        proc = run_limited(command, str(save))
        assert proc.returncode in (1, 2) and "internal error" not in proc.stderr, (command, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_pickle_size_limit_is_configurable(save_dir):
    save = save_dir()
    rc = run_limited("--max-pickle-bytes", "1000", "inspect", str(save))
    assert_one_line_error(rc, ".metadata")
    assert "--max-pickle-bytes" in rc.stderr
    assert run_limited("--max-pickle-bytes", "64MiB", "inspect", str(save)).returncode == 0
    for size in ("1e400", "9" * 5000):  # infinite as a float: was an OverflowError (internal error)
        proc = run_limited("--max-pickle-bytes", size, "inspect", str(save))
        assert proc.returncode == 2 and "is not a size" in proc.stderr and "internal error" not in proc.stderr


# --- archives ----------------------------------------------------------------------------------------------


def test_deflate_bomb_in_common_state(save_dir):
    save = save_dir()
    blob = deflate_bomb()
    assert len(blob) < 1 << 20
    (save / ITER / "common.pt").write_bytes(blob)
    rc, report = check_json(save)
    assert rc == 1 and "CKD403" in codes(report), report
    assert_one_line_error(run_limited("inspect", str(save)), "common.pt")


def _append_blob(iteration_dir: Path, key: str, blob: bytes) -> None:
    """Append ``blob`` to the item's data file and point the item's first storage entry at it."""
    path = iteration_dir / ".metadata"
    metadata = load_metadata_object(path)
    info = next(info for index, info in storage_items(metadata).items() if index_fqn(index) == key)
    data_file = iteration_dir / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)
    set_storage(info, StorageLocation(info.relative_path, offset, len(blob)))
    path.write_bytes(dump_metadata_object(metadata))


def test_deflate_bomb_in_a_chunk_record(save_dir):
    save = save_dir("core019_tp1")
    it = save / "iter_0000010"
    key = "decoder.final_layernorm.weight"
    metadata = load_metadata_object(it / ".metadata")
    info = next(info for index, info in storage_items(metadata).items() if index_fqn(index) == key)
    blob = (it / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        pkl_name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        pickled = archive.read(pkl_name)
        record = next(n for n in archive.namelist() if "/data/" in n)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr(pkl_name, pickled)
        archive.writestr(record, b"\0" * (300 << 20), compress_type=zipfile.ZIP_DEFLATED)
    _append_blob(it, key, buf.getvalue())
    rc, report = check_json(save, deep=True)
    assert rc == 1 and report["findings"], report
    assert any(key in f["message"] for f in report["findings"]), report


def _args_pickle(tp: int) -> bytes:
    import argparse

    return pickle.dumps({"args": argparse.Namespace(tensor_model_parallel_size=tp), "iteration": 10}, protocol=2)


@pytest.mark.parametrize("layout", ["duplicate data.pkl", "two prefixes", "parent dir name", "absolute name"])
def test_archive_anomalies_are_ckd404(save_dir, layout):
    save = save_dir()
    first, second = _args_pickle(1), _args_pickle(2)
    buf = io.BytesIO()
    with (
        zipfile.ZipFile(buf, "w") as archive,
        pytest.warns(UserWarning) if layout == "duplicate data.pkl" else _nothing(),
    ):
        archive.writestr("archive/data.pkl", first)
        if layout == "duplicate data.pkl":
            archive.writestr("archive/data.pkl", second)
        elif layout == "two prefixes":
            archive.writestr("other/data/0", b"\0" * 4)
        elif layout == "parent dir name":
            archive.writestr("archive/../../etc/data.pkl", second)
        else:
            archive.writestr("/archive/data/0", b"\0" * 4)
    (save / ITER / "common.pt").write_bytes(buf.getvalue())
    rc, report = check_json(save)
    assert rc == 1 and "CKD404" in codes(report), report
    assert_one_line_error(run_limited("inspect", str(save)), "common.pt")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --- no state shared between reads ------------------------------------------------------------------------


def test_a_poisoning_pickle_does_not_change_later_reads(save_dir, tmp_path):
    poisoned = save_dir()
    (poisoned / ITER / "common.pt").write_bytes(torch_zip(RESOURCE_CASES["BUILD on a shared torch function"]))
    intact = tmp_path / "intact"
    shutil.copytree(FIXTURES / "core019_tp2", intact)
    rc, report = check_json(poisoned, intact, deep=True)
    assert rc == 1
    assert all(str(poisoned) in f["path"] for f in report["findings"]), report
    assert codes(report) == ["CKD403"]


def test_shared_stand_ins_are_read_only():
    dtype = DtypeRef.get("float32")
    with pytest.raises(AttributeError):
        dtype.name = "int8"
    with pytest.raises(PickleLimitError):
        unpickler.loads(RESOURCE_CASES["BUILD on a shared torch function"])
    from ckptdoctor.pickle.stand_ins import stand_in_class

    cls = stand_in_class("megatron.core.enums", "ModelType")
    with pytest.raises(AttributeError):
        cls.__reduce__ = lambda self: (print, ("x",))
    assert dtype.name == "float32"


# --- write commands never carry a refused pickle ----------------------------------------------------------


@pytest.mark.parametrize("name", ["core019_tp1", "core019_peft_full_tp1"])
def test_write_commands_refuse_to_copy_an_unsafe_bytes_item(save_dir, tmp_path, name):
    marker = tmp_path / "marker"
    save = save_dir(name)
    it = save / "iter_0000010"
    _append_blob(it, "rng_state/shard_0.0_1.1", torch_zip(marker_payloads(marker)["torch + dotted os.system"]))
    rc, report = check_json(save, deep=True)
    assert rc == 1 and "CKD401" in codes(report), report
    before = {p.name: p.read_bytes() for p in it.iterdir() if p.is_file()}
    commands = [
        ["fix-args", "--output", str(tmp_path / "out-fix"), "--set", "seed=2"],
        ["fix-args", "--in-place", "--set", "seed=2"],
        ["fix-args", "--in-place", "--force", "--set", "seed=2"],
    ]
    if name == "core019_peft_full_tp1":
        commands += [
            ["strip-frozen", "--preset", "lora", "--output", str(tmp_path / "out-strip")],
            ["strip-frozen", "--preset", "lora", "--in-place", "--force"],
        ]
    for command in commands:
        proc = run_limited(*command[:1], str(save), *command[1:])
        assert_one_line_error(proc, "rng_state/shard_0.0_1.1")
        assert "torch.os.system" in proc.stderr
    assert {p.name: p.read_bytes() for p in it.iterdir() if p.is_file()} == before
    assert not (tmp_path / "out-fix" / "iter_0000010").exists() and not (tmp_path / "out-strip").exists()
    assert not marker.exists()


@pytest.mark.parametrize("victim", ["common.pt", "__0_0.distcp"])
def test_a_fifo_in_place_of_a_file_never_hangs(save_dir, victim):
    import os

    save = save_dir()
    path = save / ITER / victim
    path.unlink()
    os.mkfifo(path)
    rc, report = check_json(save, deep=True)  # run_limited's timeout fails the test on a hang
    assert rc == 1 and report["findings"], report
    assert any(victim in f["path"] or victim in f["message"] for f in report["findings"]), report
    proc = run_limited("inspect", str(save), timeout=60)
    assert proc.returncode in (0, 2) and "internal error" not in proc.stderr  # inspect opens no data file


def test_a_range_longer_than_its_item_is_never_read(save_dir, tmp_path):
    # A hostile .metadata points the common state (a bytes item) and a tensor chunk at huge ranges of a sparse
    # data file: no command may try to read them into memory.
    save = save_dir("core019_tp1")
    it = save / "iter_0000010"
    sparse = it / "__0_0.distcp"
    with open(sparse, "r+b") as f:
        f.truncate(8 << 30)  # 8 GiB, sparse: costs no disk
    path = it / ".metadata"
    metadata = load_metadata_object(path)
    for index, info in storage_items(metadata).items():
        if index_fqn(index) in ("common_state/shard_0_1", "decoder.final_layernorm.weight"):
            set_storage(info, StorageLocation(info.relative_path, 0, 6 << 30))
    path.write_bytes(dump_metadata_object(metadata))
    rc, report = check_json(save, deep=True)
    assert rc == 1 and "CKD403" in codes(report), report
    assert_one_line_error(run_limited("inspect", str(save)), "longer than its item can need")
    proc = run_limited("diff", "--values", str(FIXTURES / "core019_tp1"), str(save))
    assert proc.returncode == 2 and "internal error" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("where", ["../../outside.distcp", "/ABSOLUTE/outside.distcp", "./__0_0.distcp", ""])
def test_a_data_file_outside_the_iteration_dir_is_never_read_or_written(save_dir, tmp_path, where):
    """A hostile .metadata names a data file outside the checkpoint (torch's reader would follow it): check
    refuses the .metadata (CKD111), nothing reads through it and a compacting write creates nothing outside."""
    save = save_dir("core019_tp2")
    it = save / "iter_0000010"
    outside = tmp_path / "outside.distcp"  # the bytes the hostile entries point at: a real data file
    shutil.copyfile(it / "__0_0.distcp", outside)
    name = where.replace("/ABSOLUTE", str(tmp_path))
    path = it / ".metadata"
    metadata = load_metadata_object(path)
    for info in storage_items(metadata).values():
        if info.relative_path == "__0_0.distcp":
            set_storage(info, StorageLocation(name, info.offset, info.length))
    path.write_bytes(dump_metadata_object(metadata))
    outside.unlink()  # a compacting write would now be free to create it
    rc, report = check_json(save, deep=True)
    found = [f for f in report["findings"] if f["code"] == "CKD111"]
    assert rc == 1 and found and "outside the iteration dir" in found[0]["message"], report
    assert_one_line_error(run_limited("inspect", str(save)), "outside the iteration dir")
    for args in (
        ["diff", "--values", str(FIXTURES / "core019_tp2"), str(save)],
        ["edit", str(save), "--remove", "^optimizer", "--compact", "-o", str(tmp_path / "out")],
        ["strip-frozen", str(save), "--force", "-o", str(tmp_path / "out2")],
    ):
        proc = run_limited(*args)
        assert proc.returncode == 2 and "outside the iteration dir" in proc.stderr, proc.stdout + proc.stderr
    assert not outside.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [save.name]


DEEP_JSON = "[" * 100_000 + "]" * 100_000  # exhausts json's recursion: a clean error, never "internal error"


@pytest.mark.parametrize(
    "name, target",
    [
        ("core019_tp1", "iter_0000010/metadata.json"),
        ("core019_tp1", "iter_0000010/integrity.json"),
        ("core014_zarr_tp2", "iter_0000010/decoder.final_layernorm.weight/.zarray"),
    ],
)
def test_json_bombs_are_one_clean_line(save_dir, name, target):
    save = save_dir(name)
    (save / target).write_text(DEEP_JSON)
    rc, report = check_json(save)
    assert rc == 1 and report["findings"], report
    assert any(Path(target).name in f["path"] or Path(target).name in f["message"] for f in report["findings"])
    for command in (["inspect"], ["fix-args", "--output", str(save.parent / "out"), "--set", "seed=3"]):
        proc = run_limited(*command[:1], str(save), *command[1:])
        assert proc.returncode in (0, 2) and "internal error" not in proc.stderr, proc.stderr


def test_a_huge_tracker_is_one_line(save_dir):
    save = save_dir("core019_tp1")
    (save / "latest_checkpointed_iteration.txt").write_text("1" * 1_000_000)
    proc = run_limited("inspect", str(save))
    assert_one_line_error(proc, "latest_checkpointed_iteration.txt")


def test_a_symlink_to_the_root_or_above_is_not_followed_by_a_recursive_check(tmp_path):
    """A tree from someone else that links ``/`` (or a dir above the one checked) would make ``check DIR`` walk the
    whole filesystem; a link to a sibling tree is still followed (a save dir on other storage)."""
    tree, elsewhere = tmp_path / "tree", tmp_path / "elsewhere"
    tree.mkdir()
    elsewhere.mkdir()
    shutil.copytree(FIXTURES / "core019_tp1", tree / "ckpt")
    shutil.copytree(FIXTURES / "core019_tp2", elsewhere / "other")
    (tree / "root").symlink_to("/")
    (tree / "up").symlink_to(tmp_path)
    (tree / "self").symlink_to(tree)
    (tree / "linked").symlink_to(elsewhere)
    rc, report = check_json(tree)
    assert rc == 0, report
    assert sorted(Path(p).parent.name for p in report["checked"]) == ["ckpt", "other"], report["checked"]


def test_a_very_deep_tree_is_searched_without_recursion(tmp_path):
    deep = tmp_path / "tree"
    deep.mkdir()
    for _ in range(1100):  # deeper than Python's recursion limit (1000); one mkdir a level (no recursion here)
        deep = deep / "d"
        deep.mkdir()
    try:
        shutil.copytree(FIXTURES / "core019_tp1", deep / "ckpt")
        rc, report = check_json(tmp_path / "tree")
        assert rc == 0 and len(report["checked"]) == 1, report
    finally:  # shutil.rmtree (and so pytest's tmp cleanup) recurses: take the tree down level by level,
        shutil.rmtree(deep / "ckpt", ignore_errors=True)  # each rmdir relative to an open parent (not a
        here = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)  # 1,100-component path resolved every time)
        while deep != tmp_path:
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            os.rmdir(deep.name, dir_fd=parent)
            here, deep = parent, deep.parent
        os.close(here)


def test_chunk_offsets_built_to_collide_do_not_stall_the_index(save_dir):
    """40,000 chunk records whose offsets all have one tuple hash (5.6 MB of pickle): the index build's tables of
    offsets and sizes, and the sharing of sizes while unpickling, are keyed so that this costs nothing (it took
    98 s per command when they were keyed by the tuples). Every command answers at once; the chunks lie outside
    the shape, which check reports."""
    import copy

    pairs = colliding_pairs(40_000)
    if len({hash(pair) for pair in pairs[:100]}) != 1:
        pytest.skip("this Python hashes tuples differently: the pairs do not collide")
    save = save_dir("core019_tp1")
    path = save / ITER / ".metadata"
    metadata = load_metadata_object(path)
    key = "decoder.final_layernorm.weight"
    item = metadata.state_dict_metadata[key]
    first = item.chunks[0]
    storage = storage_items(metadata)
    index, info = next((i, v) for i, v in storage.items() if index_fqn(i) == key)
    size_type = type(first.offsets)
    for pair in pairs:
        chunk = copy.copy(first)
        chunk.__dict__.update(offsets=size_type(pair), sizes=size_type((1, 1)))
        item.chunks.append(chunk)
        entry = copy.copy(index)
        entry.__dict__["offset"] = size_type(pair)
        storage[entry] = copy.copy(info)
    item.__dict__["size"] = size_type((2, 2))
    first.__dict__.update(offsets=size_type((0, 0)), sizes=size_type((2, 2)))
    path.write_bytes(dump_metadata_object(metadata))
    checked = run_limited("check", "--format", "json", str(save), timeout=60)
    assert checked.returncode == 1 and "CKD220" in codes(json.loads(checked.stdout)), checked.stderr
    for command in (["inspect", str(save)], ["diff", str(save), str(save)]):
        proc = run_limited(*command, timeout=60)
        assert proc.returncode in (0, 1), proc.stderr
