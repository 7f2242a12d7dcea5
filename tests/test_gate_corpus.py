"""The safety gate against a corpus of real code-execution gadgets (tests/gadget_corpus.py), planted where
PyTorch DCP, megatron-core, Transformer Engine and Megatron-Bridge read them (issue #33).

``check`` exit 0 means nothing in the checkpoint runs code when those loaders load it: every gadget, in every
carrier, is an error naming one of its globals (CKD401 refused, CKD402 unlisted, CKD403 limit or shared-class
mutation, CKD405 refused ``_target_``), ``safe_for_loaders`` is false, no ``--ignore``/``--select``/pyproject
setting can silence it, ``latest-good`` skips the iteration and every write command refuses and writes nothing.
``--trust-global`` is the one way to accept an unlisted megatron name.

test_gadgets_run_under_megatron (mcore) proves the gadgets real: a real megatron-core 0.19.2 load runs them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, require_mcore, run_main
from gadget_corpus import ALL_GADGETS, GADGET, GADGETS, Gadget, pairs, plant

SAFETY = re.compile(r"CKD40[1235]")
ALL_PAIRS = pairs()
# The contract beyond check's verdict, on a sample: every carrier with one megatron helper gadget (a refused
# _target_ for run_config), and every gadget in .metadata and in the core 0.19 common state.
SAMPLE = sorted(
    {(g.name, c) for g, c in ALL_PAIRS if g.name in ("mcore_spec_import_module", "bridge_target_exec")}
    | {(g.name, c) for g, c in ALL_PAIRS if c in ("metadata", "common_state_item", "run_config")},
    key=lambda p: (p[1], p[0]),
)
# chunk blobs: read only by check --deep; the save dir's latest_train_state.pt: no write of an iteration carries it
# (a written save dir's Bridge tracker is a copy of the iteration's train_state.pt)
WRITE_SAMPLE = [p for p in SAMPLE if p[1] not in ("tensor_chunk", "latest_train_state")]
# latest_train_state.pt is the save dir's, in no iteration: latest-good's verdict is about iterations
ITERATION_SAMPLE = [p for p in SAMPLE if p[1] != "latest_train_state"]
TRUSTABLE = [
    g
    for g in GADGETS
    if g.unlisted and all(n.split(".")[0] in ("megatron", "transformer_engine", "nemo") for n in g.globals)
]


def _id(pair) -> str:
    return f"{pair[0]}@{pair[1]}"


@pytest.fixture
def planted(tmp_path, request):
    name, carrier = request.param
    return GADGET[name], plant(carrier, GADGET[name], tmp_path / "save", tmp_path / "marker")


def _deep(carrier: str) -> list[str]:
    return ["--deep"] if carrier == "tensor_chunk" else []


def _names_a_global(gadget: Gadget, text: str) -> bool:
    return any(name in text for name in gadget.globals)


def _safety_lines(gadget: Gadget, out: str) -> list[str]:
    return [line for line in out.splitlines() if SAFETY.search(line) and _names_a_global(gadget, line)]


@pytest.mark.parametrize("planted", [(g.name, c) for g, c in ALL_PAIRS], ids=_id, indirect=True)
def test_check_refuses_the_gadget(capsys, planted, tmp_path):
    gadget, p = planted
    rc, out, err = run_main(capsys, "check", p.save_dir, *_deep(p.carrier))
    assert rc == 1, out + err
    assert _safety_lines(gadget, out + err), out + err
    rc, out, err = run_main(capsys, "check", p.save_dir, *_deep(p.carrier), "--format", "json")
    report = json.loads(out)
    assert rc == 1 and report["safe_for_loaders"] is False, out
    assert any(f.get("subject") in gadget.globals for f in report["gate"]["failing"]), out
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("planted", SAMPLE, ids=_id, indirect=True)
@pytest.mark.parametrize("flags", [["--ignore", "CKD402"], ["--select", "CKD401"], ["--ignore", "CKD4"]], ids=str)
def test_safety_codes_cannot_be_ignored(capsys, planted, flags):
    _, p = planted
    rc, out, err = run_main(capsys, "check", p.save_dir, *_deep(p.carrier), *flags)
    assert rc == 2 and "names a safety rule (CKD4xx)" in err, out + err


@pytest.mark.parametrize("planted", SAMPLE, ids=_id, indirect=True)
def test_selecting_other_rules_keeps_the_gate(capsys, planted):
    gadget, p = planted
    rc, out, err = run_main(capsys, "check", p.save_dir, *_deep(p.carrier), "--select", "CKD1")
    assert rc == 1 and _safety_lines(gadget, out), out + err


@pytest.mark.parametrize("planted", SAMPLE, ids=_id, indirect=True)
def test_pyproject_inside_the_save_dir_is_not_read(capsys, planted, monkeypatch):
    gadget, p = planted
    (p.save_dir / "pyproject.toml").write_text('[tool.ckptdoctor]\nignore = ["CKD401", "CKD402"]\n')
    monkeypatch.chdir(p.save_dir)
    rc, out, err = run_main(capsys, "check", ".", *_deep(p.carrier))
    assert rc == 1, out + err
    assert _safety_lines(gadget, out + err), out + err


@pytest.mark.parametrize("planted", ITERATION_SAMPLE, ids=_id, indirect=True)
def test_latest_good_skips_the_poisoned_iteration(capsys, planted):
    gadget, p = planted
    rc, out, err = run_main(capsys, "latest-good", p.save_dir, *_deep(p.carrier))
    assert rc == 1, out + err
    assert p.iter_dir.name not in out
    assert _names_a_global(gadget, err) or SAFETY.search(err), err


def _write_commands(p, out: Path) -> dict[str, list]:
    return {
        "strip-frozen": ["strip-frozen", p.iter_dir, "--output", out, "--trainable", "linear_proj"],
        "edit": ["edit", p.iter_dir, "--output", out, "--remove", r"decoder\.final_layernorm\.weight"],
        "fix-args": ["fix-args", p.save_dir, "--output", out],
        "seal": ["seal", p.iter_dir],
    }


@pytest.mark.parametrize("command", ["strip-frozen", "edit", "fix-args", "seal"])
@pytest.mark.parametrize("planted", WRITE_SAMPLE, ids=_id, indirect=True)
def test_write_commands_refuse(capsys, planted, command, tmp_path):
    gadget, p = planted
    out_dir = tmp_path / "out"
    rc, out, err = run_main(capsys, *_write_commands(p, out_dir)[command])
    assert not (tmp_path / "marker").exists()
    if rc == 0 and command in ("strip-frozen", "edit") and p.carrier == "metadata":
        # the .metadata is written anew from its objects: a gadget spliced beside the Metadata (built, then
        # popped) is not one of them, so the output carries nothing of it, and the gate says so
        rc, out, err = run_main(capsys, "check", out_dir, "--format", "json")
        assert rc == 0 and json.loads(out)["safe_for_loaders"] is True, out + err
        return
    if rc == 0 and command == "strip-frozen" and p.carrier == "extra_state":
        # strip-frozen drops every model _extra_state: it gates what it carries (issue #35 item 13), and the
        # output holds nothing of the gadget
        rc, out, err = run_main(capsys, "check", out_dir, "--format", "json")
        assert json.loads(out)["safe_for_loaders"] is True, out + err
        return
    assert rc == 1, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and _names_a_global(gadget, lines[0]), err
    assert re.search(r"CKD40[12345]", lines[0]), lines[0]
    assert not out_dir.exists()
    assert not (p.iter_dir / "integrity.json").exists()


@pytest.mark.parametrize("planted", [(g.name, "metadata") for g in TRUSTABLE], ids=_id, indirect=True)
def test_trust_global_accepts_the_named_megatron_global(capsys, planted):
    gadget, p = planted
    trust = [arg for name in gadget.globals for arg in ("--trust-global", name)]
    rc, out, err = run_main(capsys, "check", p.save_dir, *trust)
    reported = [line for line in out.splitlines() if "CKD402" in line and _names_a_global(gadget, line)]
    assert rc == 0 or not reported, out + err
    assert _names_a_global(gadget, out), out


# --- real megatron-core: the gadgets are real -----------------------------------------------------------------

SCRIPT = REPO / "tests" / "mcore_load_gadget.py"
# (gadget, carrier, how the real loader reads it); "load_common" of core 0.19's common_state item and
# "load_object" of an rng_state ShardedObject go through PyTorch DCP's load_bytes: torch.load(weights_only=False).
REAL_LOADS = [
    ("mcore_spec_import_module", "metadata", "read_metadata"),
    ("mcore_spec_import_module", "common_state_item", "load_common"),
    ("mcore_spec_import_module", "sharded_object", "load_object"),
    ("mcore_modulespec_call", "common_state_item", "load_common"),
    ("mcore_build_module", "metadata", "read_metadata"),
    ("mcore_get_module", "sharded_object", "load_object"),
    ("mcore_fp8_resolve_callable", "sharded_object", "load_object"),
    ("mcore_tokenizer_getattr_chain", "metadata", "read_metadata"),
    ("mtraining_locate", "common_state_item", "load_common"),
    ("copyreg_reconstructor_mcore", "sharded_object", "load_object"),
    ("slot_state_class_swap", "metadata", "read_metadata"),
    ("torch_rebuild_from_type_v2_mcore", "common_state_item", "load_common"),
    ("mcore_enum_class_setstate", "common_state_item", "load_common"),
    ("namespace_class_setstate", "sharded_object", "load_object"),
    ("operator_attrgetter_itemgetter", "metadata", "read_metadata"),
]


@pytest.mark.mcore
def test_gadgets_run_under_megatron(tmp_path):
    """Each real_run gadget's payload unpickled with megatron-core imported, and a sample planted in a checkpoint
    and loaded by real megatron-core 0.19.2 / PyTorch DCP: the marker file exists afterwards (the load may fail
    after the payload ran, e.g. a gadget that changed argparse.Namespace)."""
    require_mcore()
    cases, markers = [], {}
    for g in ALL_GADGETS:
        if not g.real_run:
            continue
        case = f"{g.name}@payload"
        markers[case] = tmp_path / f"{case}.marker"
        (tmp_path / f"{case}.pkl").write_bytes(g.payload(markers[case]))
        cases.append({"name": case, "via": "pickle_loads", "path": str(tmp_path / f"{case}.pkl")})
    for name, carrier, via in REAL_LOADS:
        case = f"{name}@{carrier}"
        markers[case] = tmp_path / f"{case}.marker"
        p = plant(carrier, GADGET[name], tmp_path / case, markers[case])
        cases.append({"name": case, "via": via, "path": str(p.iter_dir), "key": p.item})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "cases.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            _, case, found = line.split(" ", 2)
            results[case] = json.loads(found)
    assert sorted(results) == sorted(markers), proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = {case: marker.exists() for case, marker in markers.items()}
    print(json.dumps({case: dict(results[case], ran=ran[case]) for case in sorted(results)}, indent=1))
    for g in ALL_GADGETS:
        if g.real_run:
            assert ran[f"{g.name}@payload"] == g.runs_under_megatron, (g.name, results[f"{g.name}@payload"])
    for name, carrier, _ in REAL_LOADS:
        case = f"{name}@{carrier}"
        assert ran[case], (case, results[case])
        assert results[case]["outcome"] in ("loads", "fails"), results[case]
