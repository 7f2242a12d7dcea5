"""The CLI end to end: inspect every fixture, JSON schema, bad inputs, no torch / no megatron needed."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REPO, fixture_names, manifest, run_ckptdoctor, run_cli_each, shipped_schema

from ckptdoctor.cli import main

NAMES = fixture_names()
SCHEMA = shipped_schema("inspect")

# 512 random bytes, fixed: random garbage sometimes starts with an opcode we refuse by policy (CKD403)
# rather than damage (CKD111); a fixed draw keeps the test deterministic.
GARBAGE_METADATA = random.Random(1).randbytes(512)


def _run(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_version(capsys):
    from ckptdoctor import __version__

    rc, out, _ = _run(capsys, "--version")
    assert rc == 0 and __version__ in out
    from ckptdoctor.formats import dcp_index
    from ckptdoctor.pickle import scanner

    assert ("pickle pre-pass: C;" in out) == (scanner._scan_c is not None)  # which walk runs, said
    from ckptdoctor.values import slab_stats

    assert ("index loops: C;" in out) == dcp_index._use_c
    assert ("health statistics: C;" in out) == (slab_stats.native is not None)
    from ckptdoctor.formats import crc

    assert ("CRC-32: C (" in out) == (crc.native_crc32 is not None)
    assert "rewrites" not in out  # every .metadata is written as objects: nothing to say


@pytest.mark.parametrize(
    "args",
    [["inspect", "@core019_tp1"], ["check", "--deep", "--isolated", "@core014_zarr_tp2"], ["inspect", "/no/such/dir"]],
)
def test_forked_runner_answers_like_a_fresh_interpreter(args):
    """conftest.run_ckptdoctor (a forked copy of the test process, used by the write-safety and hostile-input
    tests) gives what ``python -m ckptdoctor`` in a new interpreter gives: exit code, stdout, stderr."""
    argv = [str(FIXTURES / a[1:]) if a.startswith("@") else a for a in args]
    fresh = subprocess.run([sys.executable, "-m", "ckptdoctor", *argv], cwd=REPO, capture_output=True, text=True)
    forked = run_ckptdoctor(*argv)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "ckptdoctor", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "inspect" in result.stdout


@pytest.mark.parametrize("name", NAMES)
def test_inspect_json_matches_schema_and_manifest(capsys, name):
    rc, out, _ = _run(capsys, "inspect", str(FIXTURES / name), "--format", "json", "--keys")
    assert rc == 0
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    info = manifest(name)
    assert report["layout"]["tp"] == info["tp"]
    assert report["layout"]["pp"] == (None if report["format"]["backend"] == "zarr" else info["pp"])
    assert report["iteration"] == 10 and report["tracker"]["value"] == "10"
    assert report["args"]["parallelism"]["tensor_model_parallel_size"] == info["tp"]
    assert "tensor_parallel_num_weight_shards" in report["args"]["parallelism-derived"]
    assert report["sections"]["model"]["keys"] > 0
    has_optimizer = any(re.match(r"(chained_[0-9]+\.)?optimizer\.", k) for k in info["keys"])  # a ChainedOptimizer's
    assert (report["sections"]["optimizer"]["keys"] > 0) == has_optimizer
    if report["format"]["backend"] == "torch_dist":
        assert report["data_files"]["count"] == len([f for f in info["files"] if f.endswith(".distcp")])
    assert len(report["keys"]) == sum(s["entries"] for s in report["sections"].values())  # one row per DCP entry


def test_inspect_table(capsys):
    rc, out, _ = _run(capsys, "inspect", str(FIXTURES / "core019_tp2"))
    assert rc == 0
    assert "TP=2 PP=1" in out and "core >= 0.19" in out and "common_state/shard_0_1" in out
    assert "tensor_parallel_num_weight_shards=2" in out


def test_inspect_of_a_half_written_save_names_the_missing_file_and_keeps_its_layout(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    (save / "iter_0000010" / "__1_0.distcp").unlink()
    rc, out, _ = _run(capsys, "inspect", str(save), "--format", "json")
    report = json.loads(out)
    jsonschema.validate(report, SCHEMA)
    assert rc == 0 and report["data_files"]["missing"] == ["__1_0.distcp"] and report["data_files"]["count"] == 1
    assert report["layout"]["writer_ranks"] == [0, 1]  # the ranks the index names: it said "1 writer"
    rc, out, _ = _run(capsys, "inspect", str(save))
    flat = " ".join(out.split())
    assert "1 file," in flat and "1 more the index references is MISSING: __1_0.distcp (check: CKD113)" in flat
    assert "TP=2 PP=1 (2 writers)" in out
    rc, out, _ = _run(capsys, "inspect", str(FIXTURES / "core019_tp2"), "--format", "json")
    assert json.loads(out)["data_files"]["missing"] == []


def test_inspect_filter(capsys):
    rc, out, _ = _run(capsys, "inspect", str(FIXTURES / "core016_tp2"), "--filter", r"linear_qkv\.weight$")
    assert rc == 0
    assert "decoder.layers.self_attention.linear_qkv.weight" in out
    assert "linear_proj.weight" not in out


def test_locate_iteration_dir_file_inside_and_tracker(capsys):
    base = FIXTURES / "core016_tp1"
    for target in (
        base,
        base / "iter_0000010",
        base / "iter_0000010" / "metadata.json",
        base / "latest_checkpointed_iteration.txt",
    ):
        rc, out, _ = _run(capsys, "inspect", str(target), "--format", "json")
        assert rc == 0, target
        assert json.loads(out)["iteration_dir"].endswith("iter_0000010")


def test_iteration_option_and_release(capsys, copy_fixture):
    save = copy_fixture("core016_tp1")
    shutil.copytree(save / "iter_0000010", save / "release")
    rc, out, _ = _run(capsys, "inspect", str(save), "--iteration", "release", "--format", "json")
    assert rc == 0 and json.loads(out)["release"] is True
    (save / "latest_checkpointed_iteration.txt").write_text("release")
    rc, out, _ = _run(capsys, "inspect", str(save), "--format", "json")
    assert rc == 0 and json.loads(out)["iteration_dir"].endswith("release")
    rc, _, err = _run(capsys, "inspect", str(save), "--iteration", "20")
    assert rc == 2 and "iter_0000020" in err


def test_iteration_option_on_an_iteration_dir_is_refused_unless_it_names_that_dir(capsys, copy_fixture):
    """--iteration picks a save dir's iteration dir: given an iteration dir (or a file in one) naming another, the
    command stops (a write would go to the dir the user did not ask for); a negative number is no iteration."""
    save = copy_fixture("core019_tp2")
    shutil.copytree(save / "iter_0000010", save / "iter_0000020")
    for target in (save / "iter_0000010", save / "iter_0000010" / "__0_0.distcp"):
        rc, _, err = _run(capsys, "inspect", str(target), "--iteration", "20")
        assert rc == 2 and "not the iter_0000020 that --iteration 20 asks for" in err and str(save) in err
    before = (save / "iter_0000010" / "common.pt").exists(), sorted(p.name for p in (save / "iter_0000010").iterdir())
    rc, _, err = _run(capsys, "edit", str(save / "iter_0000010"), "-i", "20", "--drop-section", "rng", "--in-place")
    assert rc == 2 and "--iteration" in err
    assert before == (
        (save / "iter_0000010" / "common.pt").exists(),
        sorted(p.name for p in (save / "iter_0000010").iterdir()),
    )
    rc, out, _ = _run(capsys, "inspect", str(save / "iter_0000010"), "--iteration", "10", "--format", "json")
    assert rc == 0 and json.loads(out)["iteration_dir"].endswith("iter_0000010")
    rc, _, err = _run(capsys, "inspect", str(save), "--iteration", "-1")
    assert rc == 2 and "not an iteration number: '-1'" in err


def _break(kind: str, save: Path) -> Path:
    iteration_dir = save / "iter_0000010"
    if kind == "missing path":
        return save / "nope"
    if kind == "not a checkpoint":
        empty = save.parent / "empty"
        empty.mkdir()
        (empty / "notes.txt").write_text("hi")
        return empty
    if kind == "tracker to missing iteration":
        (save / "latest_checkpointed_iteration.txt").write_text("20")
    elif kind == "garbage tracker":
        (save / "latest_checkpointed_iteration.txt").write_text("\x00\x01garbage")
    elif kind == "no metadata.json":
        (iteration_dir / "metadata.json").unlink()
    elif kind == "bad metadata.json":
        (iteration_dir / "metadata.json").write_text("{not json")
    elif kind == "garbage .metadata":
        (iteration_dir / ".metadata").write_bytes(GARBAGE_METADATA)
    elif kind == "truncated .metadata":
        data = (iteration_dir / ".metadata").read_bytes()
        (iteration_dir / ".metadata").write_bytes(data[: len(data) // 2])
    elif kind == "missing .metadata":
        (iteration_dir / ".metadata").unlink()
    elif kind == "garbage common.pt":
        (iteration_dir / "common.pt").write_bytes(b"PK\x03\x04" + os.urandom(300))
    elif kind == "truncated common.pt":
        data = (iteration_dir / "common.pt").read_bytes()
        (iteration_dir / "common.pt").write_bytes(data[: len(data) // 2])
    elif kind == "truncated common_state data file":
        for distcp in iteration_dir.glob("*.distcp"):
            with open(distcp, "r+b") as f:
                f.truncate(100)
    elif kind == "legacy mp_rank":
        legacy = save.parent / "legacy" / "iter_0000010" / "mp_rank_00"
        legacy.mkdir(parents=True)
        (legacy / "model_optim_rng.pt").write_bytes(b"x")
        return legacy.parent
    elif kind == "unsupported backend":
        (iteration_dir / "metadata.json").write_text('{"sharded_backend": "fsdp_dtensor"}')
    return save


BAD = {
    "missing path": "no such file or directory",
    "not a checkpoint": "not a Megatron checkpoint",
    "tracker to missing iteration": "iter_0000020",
    "garbage tracker": "not an iteration number",
    "no metadata.json": "iter_0000010: metadata.json missing (incomplete save",
    "bad metadata.json": "metadata.json: not valid JSON",
    "garbage .metadata": ".metadata: corrupt DCP metadata",
    "truncated .metadata": ".metadata: corrupt DCP metadata",
    "missing .metadata": "iter_0000010: .metadata missing",
    "garbage common.pt": "common.pt: not a readable torch.save file",
    "truncated common.pt": "common.pt: not a readable torch.save file",
    "legacy mp_rank": "legacy non-distributed checkpoint",
    "unsupported backend": "'fsdp_dtensor' is not supported",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_input_exit_2_one_line(capsys, copy_fixture, kind):
    save = _break(kind, copy_fixture("core016_tp1"))
    rc, out, err = _run(capsys, "inspect", str(save))
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckptdoctor: error: ")
    assert BAD[kind] in lines[0]
    assert "Traceback" not in err


def test_truncated_common_state_item_names_the_file(capsys, copy_fixture):
    save = _break("truncated common_state data file", copy_fixture("core019_tp1"))
    rc, _, err = _run(capsys, "inspect", str(save))
    assert rc == 2 and "__0_0.distcp: truncated" in err and len(err.strip().splitlines()) == 1


def test_unsafe_common_pt_refused_without_executing(capsys, copy_fixture, tmp_path):
    """A common.pt whose pickle would create a marker file: refused, marker never appears."""
    import io
    import zipfile

    marker = tmp_path / "marker"
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    save = copy_fixture("core016_tp1")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("archive/data.pkl", payload)
        archive.writestr("archive/version", "3\n")
    (save / "iter_0000010" / "common.pt").write_bytes(buf.getvalue())
    rc, _, err = _run(capsys, "inspect", str(save))
    assert rc == 2 and "refusing unsafe pickle" in err and "os.system" in err and "common.pt" in err
    assert not marker.exists()


@pytest.fixture(scope="module")
def inspected_with_torch_blocked():
    """``inspect --keys`` of every fixture in one interpreter where torch and megatron cannot be imported."""
    results, imported = run_cli_each(
        [["inspect", str(FIXTURES / name), "--keys"] for name in NAMES], block=("megatron", "torch")
    )
    return dict(zip(NAMES, results)), imported


@pytest.mark.parametrize("name", NAMES)
def test_inspect_with_megatron_and_torch_blocked(inspected_with_torch_blocked, name):
    results, imported = inspected_with_torch_blocked
    rc, out, err = results[name]
    assert rc == 0, err
    assert "saved layout" in out
    assert imported == []  # neither torch nor megatron was imported


def test_inspect_in_a_venv_without_torch(tmp_path):
    """A virtualenv holding only ckptdoctor, click and tabulate (no torch) inspects every fixture."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    import click
    import tabulate

    for module in (click, tabulate):
        src = Path(module.__file__)
        if src.name == "__init__.py":
            shutil.copytree(src.parent, Path(purelib) / src.parent.name)
        else:
            shutil.copy(src, purelib)
    shutil.copytree(REPO / "ckptdoctor", Path(purelib) / "ckptdoctor")
    probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0  # torch really is absent here
    results, _ = run_cli_each([["inspect", str(FIXTURES / name)] for name in NAMES], python=str(python), cwd=tmp_path)
    for name, (rc, out, err) in zip(NAMES, results):
        assert rc == 0, (name, err)
        assert "saved layout" in out, name


def test_values_without_torch_names_the_extra(tmp_path):
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from ckptdoctor.checkpoint import open_checkpoint\n"
        "from ckptdoctor.values.read import read_chunk\n"
        "from ckptdoctor.errors import CkptError\n"
        f"ckpt = open_checkpoint({str(FIXTURES / 'core016_tp1')!r})\n"
        "try:\n"
        "    read_chunk(ckpt, 'embedding.word_embeddings.weight', 0)\n"
        "except CkptError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout
    assert "ckptdoctor[torch]" in out
    # the CPU wheel, and why: the default CUDA build is multi-GB
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in out and "multi-GB" in out


def test_shell_completion_documented_and_working():
    """docs/install.md's completion recipe (click's _CKPTDOCTOR_COMPLETE) produces a bash script."""
    readme = (REPO / "docs" / "install.md").read_text()
    for shell in ("bash", "zsh", "fish"):
        assert f"_CKPTDOCTOR_COMPLETE={shell}_source ckptdoctor" in readme
    env = dict(os.environ, _CKPTDOCTOR_COMPLETE="bash_source")
    result = subprocess.run(
        [sys.executable, "-c", "from ckptdoctor.cli import run; run()"],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0 and "_ckptdoctor_completion" in result.stdout


def test_nemo_style_weights_subdir(capsys, tmp_path):
    """A NeMo 2 / Megatron-Bridge export keeps the distributed checkpoint in <ckpt>/weights/."""
    nemo = tmp_path / "model_ckpt"
    shutil.copytree(FIXTURES / "core019_tp2" / "iter_0000010", nemo / "weights")
    (nemo / "context").mkdir()
    (nemo / "context" / "model.yaml").write_text("model: gpt\n")
    rc, out, _ = _run(capsys, "inspect", str(nemo), "--format", "json")
    assert rc == 0
    report = json.loads(out)
    assert report["iteration_dir"].endswith("weights") and report["layout"]["tp"] == 2
    rc, out, _ = _run(capsys, "check", str(nemo))
    assert rc == 0 and "1 checkpoint" in out
    (nemo / "weights" / "metadata.json").unlink()
    rc, out, _ = _run(capsys, "check", str(nemo))
    assert rc == 1 and "CKD101" in out


@pytest.mark.parametrize("name", ["core019_tp2", "core016_tp1"])
def test_inspect_and_diff_count_keys_alike(capsys, name):
    rc, out, _ = _run(capsys, "inspect", str(FIXTURES / name), "--format", "json")
    sections = json.loads(out)["sections"]
    rc, out, _ = _run(capsys, "diff", str(FIXTURES / name), str(FIXTURES / name), "--format", "json")
    side = json.loads(out)["a"]
    assert sum(s["keys"] for s in sections.values()) == side["keys"]
    assert sum(s["entries"] for s in sections.values()) == side["entries"]
    assert sections["model"]["entries"] > sections["model"]["keys"]  # _extra_state shards count once as keys


@pytest.mark.parametrize(
    "words, cword, expected",
    [
        ("ckptdoctor check --select CKD40", 3, set()),  # the gate's codes cannot be selected: not offered
        ("ckptdoctor latest-good --ignore CKD15", 3, {"CKD150", "CKD151"}),
        ("ckptdoctor rules ckd40", 2, {"CKD401", "CKD402", "CKD403", "CKD404", "CKD405"}),
        ("ckptdoctor check --ignore CKD115,CKD40", 3, set()),
    ],
)
def test_shell_completion_of_rule_codes(words, cword, expected):
    env = {**os.environ, "_CKPTDOCTOR_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor"], env=env, capture_output=True, text=True, timeout=60)
    got = {line.split(",", 1)[1] for line in proc.stdout.splitlines() if line.startswith("plain,")}
    assert got == expected, proc.stdout + proc.stderr


# --- issue #35 point 11 ------------------------------------------------------------------------------------


def test_a_file_of_no_checkpoint_is_named_not_its_dir(capsys, tmp_path):
    """`inspect /etc/passwd` blamed `/etc`: the file given is named."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    for path in [notes] + ([Path("/etc/passwd")] if Path("/etc/passwd").is_file() else []):
        for command in (["inspect"], ["show", "--format", "json"], ["can-load", "--target", "tp=1"]):
            argv = [command[0], str(path), *(["output_layer.weight"] if command[0] == "show" else []), *command[1:]]
            rc, out, err = _run(capsys, *argv)
            why = "not a Megatron checkpoint file (no metadata.json, .metadata or tracker beside it)"
            # text: nothing on stdout; --format json: the same error as a JSON object
            assert rc == 2 and out == ("" if "json" not in argv else out), (argv, out)
            if "json" in argv:
                assert json.loads(out)["error"] == f"{path}: {why}"
            assert err == f"ckptdoctor: error: {path}: {why}\n", argv


def test_zarr_layout_says_what_is_known(capsys):
    """A zarr checkpoint's chunk files name no writer rank: no "PP=? (0 writers)", the TP it shows and why PP is
    not known (text and JSON, inspect and diff)."""
    zarr = str(FIXTURES / "core014_zarr_tp2")
    rc, out, _ = _run(capsys, "inspect", zarr)
    expected = "TP=2 (PP not known: no data file names the rank that wrote it)"
    assert rc == 0 and f"saved layout    {expected}\n" in out and "writers" not in out
    rc, out, _ = _run(capsys, "inspect", zarr, "--format", "json")
    assert json.loads(out)["layout"]["summary"] == expected
    rc, out, _ = _run(capsys, "diff", zarr, str(FIXTURES / "core016_tp2"))
    assert f"layout  A: {expected}  B: TP=2 PP=1 (2 writers)" in out and "0 writers" not in out


@pytest.mark.parametrize(
    "args, code",
    [
        (["inspect", "--keys", "@core019_moe_mixed_shared_ep2"], 0),
        (["inspect", "--keys", "--format", "json", "@core019_moe_mixed_shared_ep2"], 0),
        (["diff", "--all", "@core019_tp1", "@core019_tp2"], 1),
        (["check", "@core019_convert_tp4"], 1),  # findings: the exit code stands, the pipe closed or not
        (["latest-good", "@core019_tp2"], 0),
    ],
)
def test_a_reader_that_closes_the_pipe_ends_the_output_quietly(args, code):
    """`ckptdoctor inspect CKPT | head -c 100` with more than a pipe's 64 KiB of output: head exits, the next write
    fails with EPIPE. A pipe whose reader is already gone fails the first write the same way: the command exits
    with its own code (0 for inspect, as cat ends) and nothing on stderr, for every command (cli.py)."""
    argv = [str(FIXTURES / a[1:]) if a.startswith("@") else a for a in args]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptdoctor", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=REPO,
            timeout=300,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr.decode()) == (code, "")


def test_head_c_100_of_inspect_exits_0_quietly(tmp_path):
    """The shell pipeline of the issue, with pipefail: ckptdoctor's own exit code is 0 and stderr empty."""
    cmd = f"set -o pipefail; {sys.executable} -m ckptdoctor inspect --keys {FIXTURES / 'core019_moe_mixed_shared_ep2'}"
    proc = subprocess.run(
        ["bash", "-c", cmd + " | head -c 100 > /dev/null"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    assert (proc.returncode, proc.stderr) == (0, "")


def test_every_command_help_states_its_exit_codes(capsys):
    """docs/exit-codes.md: each command's --help says what its exit codes mean."""
    from ckptdoctor.commands import COMMAND_MODULES

    for name in sorted(COMMAND_MODULES):
        rc, out, _ = _run(capsys, name, "--help")
        text = " ".join(out.split())
        assert rc == 0 and re.search(r"\bExit( code| status)?:? 0\b.*?\b2\b", text), name
