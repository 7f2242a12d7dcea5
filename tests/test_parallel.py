"""``--jobs`` and torchrun: the output of check --deep, diff --values and seal does not depend on how the work
was split (worker processes, ranks), byte for byte; a failing worker or rank fails the run with its message."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, free_port, run_cli
from test_check_ux import _poison

from ckptdoctor.cli import main
from ckptdoctor.parallel import map_units, shares

ITER = "iter_0000010"
QKV = "decoder.layers.self_attention.linear_qkv"
MEASURED = ("seconds", "workers", "peak_in_flight", "jobs")  # fields that measure the run, not the checkpoint


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _overwrite_chunk(save: Path, key: str, chunk_index: int) -> str:
    """Fill one chunk's byte range with a zip signature and fixed garbage (undecodable: CKD310)."""
    from ckptdoctor.checkpoint import open_checkpoint

    location = open_checkpoint(save).entries[key].chunks[chunk_index].storage
    assert location is not None
    path = save / ITER / location.relative_path
    data = bytearray(path.read_bytes())
    garbage = b"PK\x03\x04" + random.Random(chunk_index).randbytes(location.length - 4)
    data[location.offset : location.offset + location.length] = garbage
    path.write_bytes(bytes(data))
    return location.relative_path


@pytest.fixture
def damaged(copy_fixture) -> Path:
    """core019_tp2_dp2 (4 data files) with findings in several files: undecodable chunks, NaN/Inf values."""
    save = copy_fixture("core019_tp2_dp2")
    files = {_overwrite_chunk(save, f"{QKV}.weight", i) for i in (0, 1)}
    _poison(save, "decoder.layers.mlp.linear_fc1.weight", [float("nan"), float("inf")], 3)
    _poison(save, "decoder.layers.mlp.linear_fc1.weight", [float("nan")], 0)
    _poison(save, "embedding.word_embeddings.weight", [float("-inf")], 1)
    assert len(files) == 2  # findings come from more than one worker's share
    return save


def _masked(text: str) -> str:
    """A diff's text or JSON with the figures that measure the run (time, workers, peak bytes) blanked."""
    text = re.sub(r"in \d+\.\d+ s", "in X s", text)
    return re.sub(r'"(' + "|".join(MEASURED) + r')": [0-9.]+', r'"\1": X', text)


def test_shares_are_balanced_and_deterministic():
    weights = [5, 1, 9, 3, 3, 7, 2, 8]
    cut = shares(weights, 3)
    assert sorted(i for s in cut for i in s) == list(range(8)) and all(s == sorted(s) for s in cut)
    loads = [sum(weights[i] for i in s) for s in cut]
    assert max(loads) - min(loads) <= max(weights) and cut == shares(weights, 3)
    assert shares([], 2) == [[], []] and shares([4], 3) == [[0], [], []]


def test_map_units_keeps_unit_order_and_first_failure():
    assert map_units([1] * 7, lambda i: i * i, jobs=3) == [i * i for i in range(7)]
    assert map_units([1] * 5, lambda i: -i, jobs=2, threads=True) == [0, -1, -2, -3, -4]

    def task(i: int) -> int:
        if i in (2, 4):
            raise ValueError(f"unit {i} failed")
        return i

    for jobs in (1, 3):
        with pytest.raises(ValueError, match="unit 2 failed"):
            map_units([1] * 6, task, jobs=jobs)


def test_a_worker_error_of_ours_stays_a_one_line_error():
    # MissingExtraError (torch not installed) cannot be unpickled as itself; it came back as a RuntimeError,
    # an "internal error" with exit 2, instead of its one line.
    from ckptdoctor.errors import CkptError, MissingExtraError

    def task(i: int) -> int:
        if i == 1:
            raise MissingExtraError("torch", "torch", "comparing tensor values")
        return i

    with pytest.raises(CkptError, match="comparing tensor values needs the 'torch' package") as caught:
        map_units([1] * 4, task, jobs=2)
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_check_deep_same_output_for_any_jobs(capsys, damaged, fmt):
    runs = [_cli(capsys, "check", "--isolated", "--deep", "--format", fmt, "--jobs", j, str(damaged)) for j in "142"]
    assert runs[0][0] == 1 and runs[0][2] == ""
    assert runs[0] == runs[1] == runs[2]
    out = runs[0][1]
    for code in ("CKD310", "CKD313"):
        assert code in out
    if fmt == "json":
        messages = [f["message"] for f in json.loads(out)["findings"] if f["code"] == "CKD313"]
        assert len(messages) == 2 and "1 NaN and 1 Inf" not in messages[0]


def test_check_deep_jobs_progress_counts_every_byte(damaged):
    from ckptdoctor.ops.check import CheckOptions, check_paths
    from ckptdoctor.progress import Progress

    class Count(Progress):
        total = done = 0

        def start(self, label: str, total_bytes: int) -> None:
            self.total = total_bytes

        def advance(self, nbytes: int) -> None:
            self.done += nbytes

    for jobs in (1, 3):
        seen = Count()
        check_paths([str(damaged)], CheckOptions(deep=True, jobs=jobs), seen)
        assert seen.done == seen.total > 0


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_diff_values_same_output_for_any_jobs(capsys, fmt):
    pytest.importorskip("torch")
    args = ["diff", "--values", "--report", "3", "--format", fmt, "--all"]
    pair = [str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2")]  # layouts and optimizer values differ
    runs = [_cli(capsys, *args, "--jobs", jobs, *pair) for jobs in ("1", "4")]
    assert runs[0][0] == runs[1][0] == 1 and runs[0][2] == runs[1][2] == ""
    assert _masked(runs[0][1]) == _masked(runs[1][1])
    if fmt == "json":
        values = [json.loads(out)["values"] for _, out, _ in runs]
        assert values[0]["workers"] == 1 and values[1]["workers"] > 1 and values[0]["different"] > 0


def test_seal_same_manifest_for_any_jobs(capsys, tmp_path):
    """The same manifest at any --jobs; the report's jobs are the threads that hashed (one a file at most: it said
    99999999999 for -j 99999999999)."""
    sealed = []
    for jobs, threads in (("1", 1), ("4", 4), ("99999999999", 6)):
        save = tmp_path / f"jobs{jobs}"
        shutil.copytree(FIXTURES / "core019_tp2_dp2", save)
        rc, out, err = _cli(capsys, "seal", "--format", "json", "--jobs", jobs, str(save))
        assert rc == 0, err
        report = json.loads(out)
        assert report["jobs"] == threads and report["files"] == 6  # 4 data files, .metadata, metadata.json
        sealed.append((save / ITER / "integrity.json").read_bytes())
    assert sealed[0] == sealed[1] == sealed[2]


# --- torchrun (gloo on loopback) -----------------------------------------------------------------------------


def _torchrun(
    nproc: int, *args: str, script: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    target = [str(REPO / "tests" / script)] if script else ["-m", "ckptdoctor"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", *target, *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=full_env)


def _ours(stderr: str) -> list[str]:
    """ckptdoctor's lines on a torchrun's stderr (torchrun adds its own banner)."""
    return [line for line in stderr.splitlines() if line.startswith("ckptdoctor:")]


@pytest.mark.mcore
@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_check_deep_equals_single_process(capsys, damaged, nproc, tmp_path):
    pytest.importorskip("torch")
    for fmt in ("text", "json"):
        args = ["check", "--isolated", "--deep", "--format", fmt, str(damaged)]
        rc, single, _ = _cli(capsys, *args)
        log = tmp_path / f"log-{fmt}"
        log.mkdir()
        run = _torchrun(nproc, *args, script="dist_rank.py", env={"CKD_TEST_LOG": str(log)})
        assert (run.returncode, run.stdout) == (rc, single), run.stderr
        assert rc == 1 and _ours(run.stderr) == []
        read = {p.name: p.read_text().split() for p in log.iterdir()}
        files = sorted(f for names in read.values() for f in names)
        assert files == [f"__{i}_0.distcp" for i in range(4)]  # every file read once, by one rank
        assert len(read) == min(nproc, 4)  # each rank took a share


@pytest.mark.mcore
def test_torchrun_check_health_equals_single_process(capsys):
    """check --health's statistics merged across torchrun ranks: the JSON of one process, key for key."""
    pytest.importorskip("torch")
    args = ["check", "--isolated", "--health", "--format", "json", str(FIXTURES / "core019_moe_dup_expert_ep2")]
    rc, single, _ = _cli(capsys, *args)
    run = _torchrun(2, *args)
    assert (run.returncode, run.stdout) == (rc, single), run.stderr
    assert rc == 1 and '"CKD502"' in single and '"health"' in single


@pytest.mark.mcore
def test_torchrun_diff_values_equals_single_process(capsys):
    pytest.importorskip("torch")
    args = ["diff", "--values", "--report", "2", "--format", "json", "--all"]
    args += [str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2")]
    rc, single, _ = _cli(capsys, *args)
    run = _torchrun(2, *args)
    assert run.returncode == rc == 1, run.stderr  # rc 1 (differences) on every rank, torchrun exits 1
    assert _masked(run.stdout) == _masked(single)


@pytest.mark.mcore
def test_torchrun_seal_equals_single_process(capsys, tmp_path):
    pytest.importorskip("torch")
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(FIXTURES / "core019_tp2_dp2", one)
    shutil.copytree(FIXTURES / "core019_tp2_dp2", two)
    rc, single, _ = _cli(capsys, "seal", "--format", "json", str(one))
    run = _torchrun(2, "seal", "--format", "json", str(two))
    assert run.returncode == rc == 0, run.stderr
    assert (two / ITER / "integrity.json").read_bytes() == (one / ITER / "integrity.json").read_bytes()
    assert _masked(run.stdout).replace(str(two), str(one)) == _masked(single)


@pytest.mark.mcore
@pytest.mark.parametrize("stage", ["unit", "early"])
def test_torchrun_failing_rank_fails_the_run_with_its_message(damaged, stage):
    pytest.importorskip("torch")
    run = _torchrun(
        2, "check", "--isolated", "--deep", str(damaged), script="dist_rank.py", env={"CKD_TEST_FAIL": stage}
    )
    # rank 0 exits 2 first (torchrun itself exits 1 when a rank fails and names the first failure's code)
    root = run.stderr.split("Root Cause")[-1]
    assert run.returncode == 1 and "rank      : 0 " in root and "exitcode  : 2 " in root, run.stderr
    assert run.stdout == ""
    lines = _ours(run.stderr)
    assert len(lines) == 1, run.stderr
    if stage == "unit":
        assert lines[0].startswith("ckptdoctor: error: ") and "(rank 1: Input/output error)" in lines[0]
    else:
        assert lines[0] == "ckptdoctor: error: rank 1: stale file handle while scanning"


# --- archive layouts reused across chunks (values.archive_memo) ----------------------------------------------


def _saved(tensor) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def test_archive_layout_reused_only_for_an_identical_directory():
    torch = pytest.importorskip("torch")
    from ckptdoctor.formats.archive import parse_archive
    from ckptdoctor.values import archive_memo

    first, second = _saved(torch.arange(12.0).view(3, 4)), _saved(torch.ones(3, 4))
    assert len(first) == len(second) and first != second  # same layout, other values and CRCs
    archive_memo.remember(first, parse_archive(first, "first"))
    layout = archive_memo.lookup(second)
    assert layout is not None
    start, size = layout.records["0"]
    assert second[start : start + size] == struct.pack("<12f", *[1.0] * 12)
    other_name = bytearray(second)
    at = other_name.rfind(b"data/0")  # the name in the central directory
    other_name[at + 5 : at + 6] = b"1"
    assert archive_memo.lookup(bytes(other_name)) is None
    moved = bytearray(second)
    pkl_header = layout.headers[0][0]
    moved[pkl_header + 28] ^= 1  # the local header's extra length: data.pkl would start elsewhere
    assert archive_memo.lookup(bytes(moved)) is None
    assert archive_memo.lookup(second + b"") is not None


def test_diff_values_reads_the_memo_path_like_the_full_parse(capsys):
    """A second diff in the same process (layouts remembered) gives the same values report."""
    pytest.importorskip("torch")
    args = ["diff", "--values", "--format", "json", "--jobs", "1", "--section", "optimizer"]
    pair = [str(FIXTURES / "core019_tp1"), str(FIXTURES / "core019_tp2")]
    first, second = _cli(capsys, *args, *pair), _cli(capsys, *args, *pair)
    assert first[0] == second[0] == 1 and _masked(first[1]) == _masked(second[1])


# --- the value engine across layouts (values.tensor) ---------------------------------------------------------


def test_plan_overlaps_finds_exactly_the_overlapping_chunks():
    from ckptdoctor.formats.torch_dist import DcpChunk, chunk_overlap
    from ckptdoctor.values.tensor import plan_overlaps

    def grid(rows: int, cols: int, shape=(12, 8)) -> list[DcpChunk]:
        h, w = shape[0] // rows, shape[1] // cols
        return [DcpChunk((r * h, c * w), (h, w), None) for r in range(rows) for c in range(cols)]

    for coarse, fine in ((grid(2, 1), grid(4, 4)), (grid(3, 2), grid(2, 4)), (grid(1, 1), grid(12, 8))):
        plan = plan_overlaps(coarse, fine)
        assert plan.disjoint
        for chunk, found in zip(plan.coarse, plan.overlaps):
            expected = {j for j, other in enumerate(fine) if chunk_overlap(chunk, other) is not None}
            assert set(found) == expected and len(found) == len(expected)


def test_bitwise_equal_across_layouts_stops_at_the_first_difference(monkeypatch):
    pytest.importorskip("torch")
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.values.io import Files
    from ckptdoctor.values.tensor import tensors_bitwise_equal

    tp4, tp1 = open_checkpoint(FIXTURES / "core019_convert_tp4"), open_checkpoint(FIXTURES / "core019_convert_src_tp1")
    keys = [k for k, e in tp1.entries.items() if e.section == "model" and e.kind == "tensor"]
    assert all(tensors_bitwise_equal(tp4, tp4.entries[k], tp1, tp1.entries[k]) for k in keys)  # a reshard
    a, b = open_checkpoint(FIXTURES / "core019_tp2"), open_checkpoint(FIXTURES / "core019_tp1")
    reads: list[str] = []
    inner = Files.read
    monkeypatch.setattr(
        Files, "read", lambda self, ckpt, loc, limit=None: reads.append(loc) or inner(self, ckpt, loc, limit)
    )
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"  # TP=1 and TP=2 runs differ (~1e-6)
    assert not tensors_bitwise_equal(a, a.entries[key], b, b.entries[key])
    assert 0 < len(reads) < len(a.entries[key].chunks) + len(b.entries[key].chunks)


def test_ctrl_c_ends_the_workers_at_once(tmp_path):
    """SIGINT to the whole process group (a terminal's Ctrl-C) while workers run: exit 130 at once, one line,
    and no worker left running (they would otherwise finish the queued files, or wait forever for more)."""
    import signal
    import time

    marker = tmp_path / "started"
    child = (
        "import sys, time, pathlib\n"
        "from ckptdoctor import parallel\n"
        "from ckptdoctor.cli import main\n"
        "def slow(i):\n"
        f"    pathlib.Path({str(marker)!r}).touch()\n"
        "    time.sleep(30)\n"
        "    return i\n"
        "import ckptdoctor.rules.deep_decode as deep_decode\n"
        "deep_decode.check_deep = lambda *a, **k: parallel.map_units([1] * 8, slow, jobs=2) and []\n"
        "sys.exit(main(['check', '--isolated', '--deep', sys.argv[1]]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child, str(FIXTURES / "core019_tp1")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=20)  # EOF on the pipes: no worker holds them open
    assert proc.returncode == 130 and err == "ckptdoctor: interrupted\n", err
    assert time.monotonic() - start < 10
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of the group is left


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "command",
    [("strip-frozen", "core019_peft_full_tp2"), ("edit", "--compact", "--drop-section", "rng", "core019_tp2_dp2")],
    ids=["strip-frozen", "edit-compact"],
)
def test_compact_copies_are_the_same_for_any_jobs(tmp_path, command):
    """--jobs threads copy data files concurrently; every output file is byte-identical to --jobs 1's. Each run
    in its own process: a re-pickled .metadata's memo can differ between two writes in one process."""
    *args, name = command
    trees = []
    for jobs in ("1", "4"):
        out = tmp_path / f"out{jobs}"
        proc = run_cli(*args, str(FIXTURES / name), "--output", str(out), "--jobs", jobs)
        assert proc.returncode == 0, proc.stderr
        trees.append(_tree_bytes(out))
    assert len([n for n in trees[0] if n.endswith(".distcp")]) > 2  # several files, so the threads share work
    assert trees[0] == trees[1]


def test_plan_overlaps_is_not_slowed_by_intervals_built_to_collide():
    """The plan's tables of intervals (offset, size) per axis are keyed so that 60,000 intervals sharing one tuple
    hash (crafted in a .metadata: ``hostile_corpus.colliding_pairs``) cost no more than any others; keyed by the
    tuples, 40,000 took 68 s in one plan. Run in a child with a timeout: a stall fails the test."""
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from hostile_corpus import colliding_pairs\n"
        "from ckptdoctor.formats.torch_dist import DcpChunk\n"
        "from ckptdoctor.values.tensor import plan_overlaps\n"
        "pairs = colliding_pairs(60_000, small_second=True)\n"
        "assert len({hash(p) for p in pairs[:100]}) == 1\n"
        "fine = [DcpChunk((offset, 0), (size, 1), None) for offset, size in pairs]\n"
        "plan = plan_overlaps([DcpChunk((0, 0), (1 << 62, 1), None)], fine)\n"
        "assert sorted(plan.overlaps[0]) == list(range(len(fine)))\n"
        "print('ok')\n"
    )
    if len({hash(p) for p in __import__("hostile_corpus").colliding_pairs(50, small_second=True)}) != 1:
        pytest.skip("this Python hashes tuples differently: the pairs do not collide")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.mcore
def test_torchrun_write_commands_refuse_before_writing(tmp_path):
    """strip-frozen, edit, fix-args and convert write from one process: under torchrun each rank would write the
    same output (seen: "another ckptdoctor command is writing this checkpoint", an output "exists", two backups).
    Each refuses before any write with one line (rank 0 speaks; torchrun then stops the job, exit 1), and leaves
    the source as it was and no output."""
    pytest.importorskip("torch")
    source = tmp_path / "src"
    shutil.copytree(FIXTURES / "core019_peft_full_tp2", source)
    before = {p.relative_to(source): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    commands = [
        ["strip-frozen", str(source), "--in-place"],
        ["edit", str(source), "--remove", "rng_state", "--output", str(tmp_path / "edited")],
        ["fix-args", str(source), "--set", "lr=0.5", "--output", str(tmp_path / "fixed")],
        ["convert", str(source), "--to", "fsdp_dtensor", "--output", str(tmp_path / "converted")],
    ]
    for command in commands:
        run = _torchrun(2, *command)
        lines = _ours(run.stderr)
        assert run.returncode != 0 and len(lines) == 1, (command, run.stderr[-2000:])
        assert "writes from one process, not under torchrun" in lines[0] or "convert runs in one process" in lines[0]
    assert {p.relative_to(source): p.read_bytes() for p in source.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
