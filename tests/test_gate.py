"""The gate's own mechanisms (issue #33): how a finding names what a pickle does with a global, --trust-global,
safety codes that no selector or config can deselect, configs from inside a checkpoint, saved args.spec, and the
allowlist entries that are data only in the form real checkpoints use. The gadget corpus (test_gate_corpus.py)
proves the verdicts on real payloads in every carrier."""

from __future__ import annotations

import collections
import io
import json
import pickle

import jsonschema
import numpy as np
import pytest
import torch
from conftest import REPO, run_main, shipped_schema
from hostile_corpus import su

from ckptdoctor.errors import UnsafePickleError
from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.policy import UnlistedGlobal, trusting
from ckptdoctor.pickle.stand_ins import StandIn

ITER = "iter_0000010"
HELPER = ("megatron.core.transformer.spec_utils", "build_module")
HELPER_NAME = ".".join(HELPER)


def _spliced(original: bytes, gadget: bytes) -> bytes:
    """``gadget``'s opcodes run and popped before the rest of ``original`` (a real pickle.load runs it)."""
    assert original[:1] == b"\x80"
    return original[:2] + gadget + b"0" + original[2:]


def _global(module: str, name: str) -> bytes:
    return su(module) + su(name) + b"\x93"


CALLED = _global(*HELPER) + su("x") + b"\x85R"  # REDUCE
INSTANTIATED = _global(*HELPER) + b")\x81"  # NEWOBJ
REFERENCED = b"]" + _global(*HELPER) + b"a"  # a list holding the global


def _metadata_gadget(save, gadget: bytes) -> None:
    path = save / ITER / ".metadata"
    path.write_bytes(_spliced(path.read_bytes(), gadget))


def _check(capsys, *args) -> tuple[int, dict]:
    rc, out, _ = run_main(capsys, "check", "--format", "json", *args)
    report = json.loads(out)
    jsonschema.validate(report, shipped_schema("check"))
    return rc, report


@pytest.mark.parametrize(
    "gadget, words",
    [(CALLED, "a called object"), (INSTANTIATED, "an instantiated class"), (REFERENCED, "a referenced global")],
)
def test_the_finding_says_how_the_pickle_uses_the_name(capsys, copy_fixture, gadget, words):
    save = copy_fixture("core019_tp2")
    _metadata_gadget(save, gadget)
    rc, report = _check(capsys, save)
    (failure,) = report["gate"]["failing"]
    assert rc == 1 and report["safe_for_loaders"] is False and failure["code"] == "CKD402"
    assert failure["severity"] == "error" and failure["subject"] == HELPER_NAME
    assert f"{HELPER_NAME}, {words}" in failure["message"]


def test_usage_is_counted_without_importing_anything():
    unlisted: list[UnlistedGlobal] = []
    unpickler.loads(b"\x80\x04" + CALLED + b".", unlisted=unlisted)
    assert [(u.name, u.calls, u.instances, u.builds) for u in unlisted] == [(HELPER_NAME, 1, 0, 0)]
    unlisted.clear()
    unpickler.loads(b"\x80\x04" + INSTANTIATED + b"}b.", unlisted=unlisted)
    assert [(u.calls, u.instances, u.builds) for u in unlisted] == [(0, 1, 1)]
    assert "then applies BUILD state" in unlisted[0].use


def test_trust_global_overrides_only_the_named_global(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    _metadata_gadget(save, CALLED)
    rc, report = _check(capsys, "--trust-global", "megatron.core.other.Name", save)
    assert rc == 1 and report["gate"]["trusted"] == ["megatron.core.other.Name"]
    rc, report = _check(capsys, "--trust-global", HELPER_NAME, save)
    assert rc == 0 and report["safe_for_loaders"] is True and report["findings"] == []
    assert [f["subject"] for f in report["gate"]["overridden"]] == [HELPER_NAME]
    rc, out, _ = run_main(capsys, "check", "--trust-global", HELPER_NAME, save)
    assert f"Trusted globals (--trust-global): {HELPER_NAME}." in out
    assert "(1 checkpoint; 1 safety finding overridden by --trust-global)" in out
    rc, out, _ = run_main(capsys, "check", save)  # the next command in this process trusts nothing
    assert rc == 1 and "CKD402" in out
    rc, _, err = run_main(capsys, "check", "--trust-global", "not a name", save)
    assert rc == 2 and "is not MODULE.NAME" in err


def test_trusted_global_is_written_back_and_untrusted_refused(capsys, copy_fixture, tmp_path):
    save = copy_fixture("core016_tp1")
    path = save / ITER / "common.pt"
    state = load_torch_zip(path, str(path))
    with trusting([HELPER_NAME]):
        state["extra"] = unpickler.loads(b"\x80\x04" + CALLED + b".")
        path.write_bytes(dump_torch_zip(state))
    rc, _, err = run_main(capsys, "fix-args", save, "--set", "seed=3", "--output", tmp_path / "o")
    assert rc == 1 and "CKD402" in err and HELPER_NAME in err and not (tmp_path / "o").exists()
    args = ("fix-args", save, "--set", "seed=3", "--output", tmp_path / "o", "--trust-global", HELPER_NAME)
    rc, _, err = run_main(capsys, *args)
    assert rc == 0, err
    rc, report = _check(capsys, "--trust-global", HELPER_NAME, tmp_path / "o")
    assert rc == 0 and [f["subject"] for f in report["gate"]["overridden"]] == [HELPER_NAME]


@pytest.mark.parametrize("option", ["--ignore", "--select"])
@pytest.mark.parametrize("value", ["CKD402", "CKD4", "CKD401,CKD1"])
def test_safety_codes_cannot_be_named(capsys, option, value):
    rc, _, err = run_main(capsys, "check", option, value, REPO / "fixtures/core019_tp2")
    assert rc == 2 and "names a safety rule (CKD4xx)" in err
    rc, _, err = run_main(capsys, "latest-good", option, value, REPO / "fixtures/core019_tp2")
    assert rc == 2 and "names a safety rule (CKD4xx)" in err


@pytest.mark.parametrize("setting", ['ignore = ["CKD402"]', 'select = ["CKD401"]', 'per-path-ignores = {"*" = "CKD4"}'])
def test_no_config_names_a_safety_code(tmp_path, monkeypatch, capsys, setting):
    (tmp_path / "pyproject.toml").write_text(f"[tool.ckptdoctor]\n{setting}\n")
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_main(capsys, "check", REPO / "fixtures/core019_tp2")
    assert rc == 2 and "names a safety rule (CKD4xx)" in err and "pyproject.toml" in err


def test_a_config_inside_a_checkpoint_is_never_read(capsys, copy_fixture, monkeypatch, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text('[tool.ckptdoctor]\nignore = ["CKD210"]\n')
    save = copy_fixture("core019_convert_tp4")
    moved = repo / "model"
    save.rename(moved)
    (moved / "pyproject.toml").write_text('[tool.ckptdoctor]\nignore = ["CKD2", "CKD1"]\n')
    (moved / ITER / "pyproject.toml").write_text('[tool.ckptdoctor]\nignore = ["CKD2"]\n')
    for where in (moved, moved / ITER):
        monkeypatch.chdir(where)
        rc, report = _check(capsys, ".")
        assert report["config"]["path"] == str(repo / "pyproject.toml")  # the repository's own, above
        assert report["config"]["changed"] == {"ignore": ["CKD210"]}
        assert str(moved / "pyproject.toml") in report["config"]["not_read"]
        codes = {f["code"] for f in report["findings"]}
        assert "CKD210" not in codes and "CKD212" in codes  # the repository's ignore applied, not the model's
    rc, out, _ = run_main(capsys, "check", ".")
    assert f'Config: {repo / "pyproject.toml"} [tool.ckptdoctor] set ignore=["CKD210"].' in out
    assert f"Config: {moved / ITER / 'pyproject.toml'} not read (inside a checkpoint dir" in out
    rc, report = _check(capsys, "--isolated", ".")
    assert report["config"] is None and "CKD210" in {f["code"] for f in report["findings"]}


def _set_spec(save, spec) -> None:
    path = save / ITER / "common.pt"
    state = load_torch_zip(path, str(path))
    state["args"].spec = spec
    path.write_bytes(dump_torch_zip(state))


@pytest.mark.parametrize(
    "spec, safe",
    [
        (None, True),
        (["megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"], True),
        (["os", "system"], False),
        (["antigravity", "x"], False),
        ("megatron.core.models.gpt", False),  # not the (module, name) pair Megatron imports: cannot be vouched for
    ],
)
def test_saved_args_spec_is_code_with_use_checkpoint_args(capsys, copy_fixture, tmp_path, spec, safe):
    save = copy_fixture("core016_tp1")
    _set_spec(save, spec)
    rc, report = _check(capsys, save)
    assert report["safe_for_loaders"] is safe, report
    if not safe:
        assert [f["code"] for f in report["gate"]["failing"]] == ["CKD405"]
        assert "--use-checkpoint-args" in report["gate"]["failing"][0]["message"]
        rc, _, err = run_main(capsys, "edit", save, "--drop-section", "rng", "-o", tmp_path / "o")
        assert rc == 1 and "CKD405" in err and not (tmp_path / "o").exists()
    if spec == ["os", "system"]:
        rc, report = _check(capsys, "--trust-global", "os.system", save)
        assert report["safe_for_loaders"] is True


# --- allowlist entries that are data in one form only (the audit in docs/allowlist.md) ---------------------------


def test_real_numpy_arrays_and_generators_still_read():
    array = unpickler.loads(pickle.dumps(np.arange(6, dtype=np.float32).reshape(2, 3), protocol=2))
    assert isinstance(array, StandIn)
    buf = io.BytesIO()
    torch.save([torch.Generator().manual_seed(3)], buf)
    (generator,) = load_torch_zip(buf.getvalue(), "x")
    assert generator.stand_in_state[0] == 3
    assert unpickler.loads(pickle.dumps(collections.defaultdict(dict, {1: {}}), protocol=2)) == {1: {}}
    assert unpickler.loads(pickle.dumps(collections.defaultdict(collections.OrderedDict), protocol=2)) == {}
    assert unpickler.loads(pickle.dumps(bytearray(b"\xff"), protocol=2)) == bytearray(b"\xff")


@pytest.mark.parametrize(
    "data, name",
    [
        (b"\x80\x02cnumpy\nndarray\nK\x01\x85X\x01\x00\x00\x00OC\x08AAAAAAAA\x87R.", "numpy.ndarray"),
        (b"\x80\x02cnumpy\nndarray\n)\x81.", "numpy.ndarray"),
        (b"\x80\x02ctorch._C\nGenerator\n)\x81](K\x01K\x02eb.", "torch._C.Generator"),
        (b"\x80\x02cbuiltins\nbytearray\nX\x03\x00\x00\x00abcX\x04\x00\x00\x00idna\x86R.", "builtins.bytearray"),
        (b"\x80\x02cbuiltins\nbytes\nX\x01\x00\x00\x00aX\x05\x00\x00\x00utf-8X\x03\x00\x00\x00bad\x87R.", "bytes"),
        (
            b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncargparse\nNamespace\nK\x00\x85C\x01b\x87R.",
            "numpy.core.multiarray._reconstruct",
        ),
    ],
)
def test_forms_that_are_not_data_are_refused(data, name):
    with pytest.raises(UnsafePickleError) as info:
        unpickler.loads(data)
    assert name in info.value.global_name


def test_show_and_diff_say_what_they_read_as_stand_ins_in_json_too(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    _metadata_gadget(save, CALLED)
    note = f"not allowlisted {HELPER_NAME}: read as inert stand-ins here; a real load runs them (check: CKD402)"
    for what in ("decoder.final_layernorm.weight", "args.lr"):
        rc, out, _ = run_main(capsys, "show", save, what, "--format", "json")
        report = json.loads(out)
        jsonschema.validate(report, shipped_schema("show"))
        assert rc == 0 and note in report["notes"], what
    rc, out, _ = run_main(capsys, "diff", REPO / "fixtures/core019_tp2", save, "--format", "json")
    report = json.loads(out)
    jsonschema.validate(report, shipped_schema("diff"))
    assert report["b"]["stand_ins_read"] == [HELPER_NAME] and "stand_ins_read" not in report["a"]
    rc, out, _ = run_main(capsys, "show", REPO / "fixtures/core019_tp2", "args.lr", "--format", "json")
    assert not any("allowlisted" in n for n in json.loads(out)["notes"])


def test_inspect_reads_a_strange_checkpoint_and_says_so(capsys, copy_fixture):
    save = copy_fixture("core019_tp2")
    _metadata_gadget(save, CALLED)
    rc, out, _ = run_main(capsys, "inspect", save)
    assert rc == 0 and f"not allowlisted {HELPER_NAME}: read as inert stand-ins here" in out
    rc, out, _ = run_main(capsys, "inspect", "--format", "json", save)
    report = json.loads(out)
    jsonschema.validate(report, shipped_schema("inspect"))
    assert rc == 0 and report["stand_ins_read"] == [HELPER_NAME]
    rc, out, _ = run_main(capsys, "inspect", "--format", "json", REPO / "fixtures/core019_tp2")
    assert "stand_ins_read" not in json.loads(out)  # absent where there are none: outputs unchanged


def test_a_run_config_too_large_to_read_fails_the_gate_one_not_text_does_not(capsys, copy_fixture, tmp_path):
    save = copy_fixture("core019_tp2")
    path = save / ITER / "run_config.yaml"
    with path.open("wb") as f:  # sparse: larger than the 16 MiB the scanner reads
        f.write(b"model:\n  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n")
        f.truncate(17 << 20)
    rc, report = _check(capsys, save)
    assert [f["code"] for f in report["gate"]["failing"]] == ["CKD405"]
    assert "cannot be checked" in report["gate"]["failing"][0]["message"]
    path.write_bytes(b"model:\n  \xff\xfe: 1\n")  # not UTF-8: Bridge's yaml.safe_load fails on it, nothing runs
    rc, report = _check(capsys, save)
    assert report["safe_for_loaders"] is True
    path.write_text("model:\n  _target_: os.system\n  _args_: [touch x]\n")
    rc, report = _check(capsys, save)
    assert rc == 1 and report["gate"]["failing"][0]["subject"] == "os.system"
    rc, report = _check(capsys, "--trust-global", "os.system", save)
    assert report["safe_for_loaders"] is True and report["gate"]["overridden"][0]["code"] == "CKD405"


def test_safe_for_loaders_vouches_only_for_what_was_read(capsys, tmp_path):
    """An empty dir, or a missing path beside a checkpoint: the gate read nothing there, so it vouches for nothing;
    what --select shows does not change what was read."""
    (tmp_path / "empty").mkdir()
    fixture = REPO / "fixtures" / "core019_tp1"
    for paths, rc_want in (([tmp_path / "empty"], 1), ([fixture, tmp_path / "gone"], 2)):
        rc, out, _ = run_main(capsys, "check", *paths, "--format", "json")
        report = json.loads(out)
        assert rc == rc_want and report["safe_for_loaders"] is False and report["gate"]["failing"] == [], paths
    rc, out, _ = run_main(capsys, "check", tmp_path / "empty", "--select", "CKD3", "--format", "json")
    assert json.loads(out)["safe_for_loaders"] is False
    rc, out, _ = run_main(capsys, "check", fixture, "--select", "CKD3", "--format", "json")
    assert rc == 0 and json.loads(out)["safe_for_loaders"] is True


@pytest.mark.parametrize("command", [("inspect",), ("show", "decoder.final_layernorm.weight"), ("diff", "SELF")])
def test_read_only_commands_take_trust_global_and_name_it(capsys, copy_fixture, command):
    """inspect, show and diff read the pickles too and take the same override, which stderr names; their note of a
    global off the allowlist (show and diff read on without one) goes once it is trusted."""
    save = copy_fixture("core019_tp2")
    _metadata_gadget(save, CALLED)
    name, *rest = command
    args = [save if a == "SELF" else a for a in rest]
    rc, plain, err = run_main(capsys, name, save, *args)
    assert rc == 0 and "trusted globals" not in err
    rc, out, err = run_main(capsys, name, "--trust-global", HELPER_NAME, save, *args)
    assert rc == 0 and out and f"trusted globals (--trust-global): {HELPER_NAME}" in err
    assert f"not allowlisted {HELPER_NAME}: read as inert stand-ins here" in " ".join(plain.split())
    assert "not allowlisted" not in out
