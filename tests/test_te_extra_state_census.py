"""What ckptdoctor reads in Transformer Engine ``_extra_state`` items, and what it predicts TE does with them at
load, on real megatron-core 0.19.2 checkpoints whose items hold what each TE generation's ``get_extra_state``
writes (fixtures/te_extra_state.py: TE 2.20's own recipe classes pickled by real pickle, torch.save for TE 1.x).
The prediction of TE >= 2.18's refusal is compared with the verdict TE 2.20's own ``_classify_extra_state_pickle``
gave each payload when the fixtures were made (``fixtures/manifests/<name>.te.json``)."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import sys
import types
from pathlib import Path

import pytest
from conftest import run_ckptdoctor
from test_hostile_round2 import _edit_metadata, _point_item_at

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.formats.torch_dist import StorageLocation, index_fqn, set_storage, storage_items

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# TE's _PickledExtraStateAction -> ckptdoctor's words; None: a BytesIO, which set_extra_state refuses unclassified
TE_VERDICT = {"unsafe_load": "refuse", "ignore": "ignore", None: "refuse"}
TE_FIXTURES = ["core019_te_delayed", "core019_te_mixed", "core019_te_v20"]


def _json(*args: str) -> dict:
    proc = run_ckptdoctor(*args, "--format", "json")
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def _manifest(name: str) -> dict:
    return json.loads((FIXTURES / "manifests" / f"{name}.te.json").read_text())["items"]


@pytest.mark.parametrize("name", TE_FIXTURES)
def test_the_prediction_equals_each_releases_own_classifier_as_recorded(name):
    """The verdicts each release's classifier gave when the fixtures were made (tests/test_te_classifier_live.py
    runs them live where the releases are installed)."""
    for item, expected in _manifest(name).items():
        (view,) = _json("show", str(FIXTURES / name), item)["extra_state"]
        assert view["error"] is None
        assert set(expected["te_classifiers"]) == {"2.16.1", "2.17.1", "2.18.0", "2.19.0", "2.20.2"}
        for version, verdict in expected["te_classifiers"].items():
            assert view["state"]["te_2_18"] == TE_VERDICT[verdict], (item, version, view)


FORMS = {
    # payload made by the fixture script -> (form, generation, recipe, fp8, needed)
    "te1_bytesio": ("bytesio", "TE 1.x", None, True, True),
    "te1_none": ("bytesio", "TE 1.x", None, False, False),
    "te2_delayed": ("pickle", "TE >= 2.0", "DelayedScaling", True, True),
    "te20_delayed": ("pickle", "TE 2.0-2.1", "DelayedScaling", True, True),  # TE 2.0's own class: has interval
    "te2_current": ("pickle", "TE 2.0-2.17", "Float8CurrentScaling", True, False),
    "te20_none": ("pickled-none", "TE 2.0-2.3", None, False, False),
    "te24_empty": ("empty", "TE >= 2.4", None, False, False),
}


@pytest.mark.parametrize("name", TE_FIXTURES)
def test_show_decodes_each_generation(name):
    for item, expected in _manifest(name).items():
        form, generation, recipe, fp8, needed = FORMS[expected["payload"]]
        state = _json("show", str(FIXTURES / name), item)["extra_state"][0]["state"]
        assert (state["form"], state["generation"], state["recipe"], state["fp8"], state["needed"]) == (
            form,
            generation,
            recipe,
            fp8,
            needed,
        ), item


def test_show_gives_recipe_fields_tensor_shapes_and_extra_variables():
    key = "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2"
    state = _json("show", str(FIXTURES / "core019_te_delayed"), key)["extra_state"][0]["state"]
    assert state["recipe_fields"]["fp8_format"] == "HYBRID"
    assert state["recipe_fields"]["amax_history_len"] == 16 and state["recipe_fields"]["amax_compute_algo"] == "max"
    assert state["tensors"] == {
        "scale_fwd": [3],
        "amax_history_fwd": [16, 3],
        "scale_bwd": [2],
        "amax_history_bwd": [16, 2],
    }
    assert state["extra_fp8_variables"]["num_gemms"] == 1
    text = run_ckptdoctor(
        "show", str(FIXTURES / "core019_te_mixed"), "decoder.layers.self_attention.linear_proj._extra_state"
    )
    assert "TE 1.x  (bytesio" in text.stdout and "scale_inv_fwd 3" in text.stdout
    assert "refused unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1" in text.stdout


def test_te_2_0s_own_payloads_decode_and_are_judged():
    """core019_te_v20: what TE 2.0's get_extra_state writes (its own DelayedScaling, from the v2.0 source: with the
    interval field TE 2.2 removed), a delayed-scaling FP8 run whose last layer ran in BF16 (pickle.dumps(None))."""
    ckpt = str(FIXTURES / "core019_te_v20")
    state = _json("show", ckpt, "decoder.layers.mlp.linear_fc2._extra_state/shard_0_2")["extra_state"][0]["state"]
    assert state["generation"] == "TE 2.0-2.1" and state["recipe"] == "DelayedScaling"
    assert state["recipe_fields"]["interval"] == -1 and state["recipe_fields"]["amax_history_len"] == 16
    assert state["tensors"]["amax_history_fwd"] == [16, 3] and state["te_2_18"] == "refuse"
    census = _json("inspect", ckpt, "--extra-state")["extra_state"]
    assert census["generations"] == {"TE 2.0-2.1": 4, "TE 2.0-2.3": 4} and census["te_2_18_refused"] == 4
    found = _findings(ckpt)
    assert set(found) == {"CKD230"}, found  # one generation (2.0-2.1 wrote both forms), FP8 args agree
    assert "will refuse 4 _extra_state items" in found["CKD230"][0]
    older = _sections(ckpt, "--target", "tp=1", "--te-version", "2.0")["extra_state"]
    assert older["verdict"] == "loads"
    newer = _sections(ckpt, "--target", "tp=1", "--te-version", "2.19.0")["extra_state"]
    assert newer["verdict"] == "fails" and "TE 2.19.0 refuses 4 of the 8" in newer["why"]


def test_a_te_2_0_state_beside_an_empty_one_is_mixed(copy_fixture):
    """TE 2.0-2.1 never saved an empty tensor (TE >= 2.4 does): one beside the other is CKD231."""
    torch = pytest.importorskip("torch")
    save = copy_fixture("core019_te_v20")
    buf = io.BytesIO()
    torch.save([torch.empty(0, dtype=torch.uint8)], buf)
    _point_item_at(save, "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2", buf.getvalue())
    (message,) = _findings(str(save))["CKD231"]
    assert "never saved together" in message and "TE 2.0-2.1" in message and "TE >= 2.4" in message


def test_a_local_spec_checkpoint_has_no_te_state_and_no_findings():
    state = _json("show", str(FIXTURES / "core019_tp1"), "decoder.layers.mlp.linear_fc1._extra_state")
    assert {v["state"]["form"] for v in state["extra_state"]} == {"none"}
    census = _json("inspect", str(FIXTURES / "core019_tp1"), "--extra-state")["extra_state"]
    assert census["generations"] == {"no TE": census["items"]} and census["te_2_18_refused"] == 0
    codes = {f["code"] for f in _json("check", str(FIXTURES / "core019_tp1"))["findings"]}
    assert not codes & {"CKD230", "CKD231", "CKD232", "CKD233"}


def test_inspect_counts_the_extra_state():
    census = _json("inspect", str(FIXTURES / "core019_te_mixed"), "--extra-state")["extra_state"]
    assert census["items"] == 8 and census["unreadable"] == 0
    assert census["generations"] == {"TE 1.x": 2, "TE 2.0-2.17": 2, "TE 2.0-2.3": 2, "TE >= 2.4": 2}
    assert census["recipes"] == {"Float8CurrentScaling": 2}
    assert (census["fp8_on"], census["fp8_off"], census["te_2_18_refused"], census["redundant"]) == (3, 5, 2, 7)
    assert "extra_state" not in _json("inspect", str(FIXTURES / "core019_te_mixed"))  # metadata only by default


def _findings(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in _json("check", str(FIXTURES / name))["findings"]:
        out.setdefault(f["code"], []).append(f["message"])
    return out


def test_check_warns_of_te_2_18_refusals_with_the_env_var_and_the_fix():
    found = _json("check", str(FIXTURES / "core019_te_delayed"))["findings"]
    refused = [f for f in found if f["code"] == "CKD230"]
    assert len(refused) == 1 and refused[0]["severity"] == "warning"
    assert "refuse 8 _extra_state items unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1" in refused[0]["message"]
    assert "--drop-extra-state" in refused[0]["fix"]
    assert {f["code"] for f in found} == {"CKD230"}  # one recipe, one generation, args say FP8 hybrid


def _refusal(*args: str, cwd: Path | None = None) -> tuple[int, dict, dict]:
    """check's exit code, its JSON report and its one CKD230 finding on core019_te_delayed (8 pickled
    delayed-scaling items, nothing else to report)."""
    extra = {"cwd": cwd} if cwd is not None else {}
    proc = run_ckptdoctor("check", FIXTURES / "core019_te_delayed", *args, "--format", "json", **extra)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    (finding,) = [f for f in report["findings"] if f["code"] == "CKD230"]
    return proc.returncode, report, finding


def test_check_with_a_release_without_the_classifier_reports_the_refusal_as_info_and_passes():
    rc, report, finding = _refusal("--te-version", "2.17.0")
    assert rc == 0 and report["counts"] == {"error": 0, "warning": 0, "info": 1}
    assert finding["severity"] == "info"
    assert finding["message"].startswith(
        "TE 2.17.0 loads 8 _extra_state items that an upgrade to TE 2.16.1, 2.17.1 and >= 2.18 will refuse"
    )
    text = run_ckptdoctor("check", FIXTURES / "core019_te_delayed", "--te-version", "2.15")
    assert text.returncode == 0 and "CKD230 [info]" in text.stdout
    assert "All checks passed (1 checkpoint; 1 info finding)." in text.stdout
    github = run_ckptdoctor("check", FIXTURES / "core019_te_delayed", "--te-version", "2.16.0", "--format", "github")
    assert github.returncode == 0 and github.stdout.startswith("::notice ")
    sarif = run_ckptdoctor("check", FIXTURES / "core019_te_delayed", "--te-version", "2.17.0", "--format", "sarif")
    assert sarif.returncode == 0
    assert [r["level"] for r in json.loads(sarif.stdout)["runs"][0]["results"]] == ["note"]


@pytest.mark.parametrize(
    ("version", "whose"),
    [
        ((), "TE 2.16.1, 2.17.1 and >= 2.18"),
        (("--te-version", "2.18"), "TE 2.18.0"),
        (("--te-version", "2.20.2"), "TE 2.20.2"),
        # the classifier was backported to these patch releases (their .0 releases load the items)
        (("--te-version", "2.17.1"), "TE 2.17.1"),
        (("--te-version", "2.16.1"), "TE 2.16.1"),
    ],
)
def test_check_with_a_refusing_release_warns(version, whose):
    rc, report, finding = _refusal(*version)
    assert rc == 1 and finding["severity"] == "warning" and report["counts"]["warning"] == 1
    assert finding["message"].startswith(f"{whose} will refuse 8 _extra_state items")


def test_check_takes_the_te_version_from_the_config_and_the_command_line_overrides_it(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.ckptdoctor]\nte-version = "2.16.0"\n')
    rc, report, finding = _refusal(cwd=tmp_path)
    assert rc == 0 and finding["severity"] == "info" and finding["message"].startswith("TE 2.16.0 loads")
    assert report["config"]["changed"] == {"te-version": "2.16.0"}
    rc, _, finding = _refusal("--te-version", "2.19", cwd=tmp_path)
    assert rc == 1 and finding["severity"] == "warning"


def test_check_refuses_a_te_version_that_is_no_major_minor(tmp_path):
    proc = run_ckptdoctor("check", FIXTURES / "core019_te_delayed", "--te-version", "2")
    assert proc.returncode == 2 and "--te-version" in proc.stderr and "give MAJOR.MINOR[.PATCH]" in proc.stderr
    # 2.17.0 loads what 2.17.1 refuses: the minor alone does not say
    proc = run_ckptdoctor("check", FIXTURES / "core019_te_delayed", "--te-version", "2.17")
    assert proc.returncode == 2 and "2.17.0 loads pickled extra state, 2.17.1 and later refuse it" in proc.stderr
    (tmp_path / "pyproject.toml").write_text('[tool.ckptdoctor]\nte_version = "two.eighteen"\n')
    proc = run_ckptdoctor("check", FIXTURES / "core019_te_delayed", cwd=tmp_path)
    assert proc.returncode == 2 and "[tool.ckptdoctor] te-version" in proc.stderr, proc.stderr
    (tmp_path / "pyproject.toml").write_text("[tool.ckptdoctor]\nte-version = 2.18\n")  # a float, not a string
    proc = run_ckptdoctor("check", FIXTURES / "core019_te_delayed", cwd=tmp_path)
    assert proc.returncode == 2 and "te-version must be str" in proc.stderr, proc.stderr


def test_check_reports_mixed_generations_and_fp8_state_the_args_deny():
    found = _findings("core019_te_mixed")
    assert "2 TE 1.x BytesIO" in found["CKD230"][0]
    assert any("generations that never saved together" in m for m in found["CKD231"])
    assert "with delayed-scaling FP8 state, but the saved args say fp8=None" in found["CKD232"][0]


def test_check_reports_fp8_args_without_delayed_state(copy_fixture):
    """The reverse of CKD232: args say FP8 with the delayed recipe, no module saved FP8 state (here: every item
    replaced by the empty tensor of a TE >= 2.4 module with FP8 off)."""
    torch = pytest.importorskip("torch")
    save = copy_fixture("core019_te_delayed")
    buf = io.BytesIO()
    torch.save([torch.empty(0, dtype=torch.uint8)], buf)
    for key in _json("inspect", str(save), "--keys")["keys"]:
        if key["key"].endswith(("_0_2", "_1_2")) and "_extra_state" in key["key"]:
            _point_item_at(save, key["key"], buf.getvalue())
    found = _findings(str(save))
    assert "the saved args say fp8='hybrid' with the delayed recipe but none" in found["CKD232"][0]
    assert "CKD230" not in found


def test_drop_redundant_keeps_only_items_with_delayed_scaling_state(tmp_path):
    plan = _json("edit", str(FIXTURES / "core019_te_mixed"), "--drop-redundant-extra-state")["plan"]
    removed = {c["key"] for c in plan["removed"]}
    manifest = _manifest("core019_te_mixed")
    # linear_proj's layer 1 holds no FP8 state, but its layer 0 does: the key is kept whole (a partial key
    # does not load), and the report says so
    assert removed == {k for k in manifest if "linear_proj" not in k}
    assert any("kept 1 _extra_state key(s) whole" in note for note in plan["load_notes"])
    assert {c["reason"] for c in plan["removed"]} == {"--drop-redundant-extra-state"}
    # nothing redundant in a delayed-scaling run: the edit changes nothing and says so
    proc = run_ckptdoctor("edit", str(FIXTURES / "core019_te_delayed"), "--drop-redundant-extra-state")
    assert proc.returncode == 2 and "matches no key" in proc.stderr


# --- hostile payloads stay refused ----------------------------------------------------------------------------


class _Reduce:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _uint8_item(payload: bytes) -> bytes:
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], buf)
    return buf.getvalue()


KEY = "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"


def test_a_hostile_payload_in_extra_state_is_refused_by_the_gate_and_never_run(copy_fixture, tmp_path):
    marker = tmp_path / "marker"
    save = copy_fixture("core019_te_delayed")
    payload = pickle.dumps({"recipe": None, "scale_fwd": _Reduce(__import__("os").system, (f"touch {marker}",))})
    _point_item_at(save, KEY, _uint8_item(payload))
    found = _json("check", str(save))["findings"]
    assert "CKD401" in {f["code"] for f in found}
    # the other 7 items are still refused by TE, but the fix edit refuses this checkpoint at its gate: no fix line
    (refused,) = [f for f in found if f["code"] == "CKD230"]
    assert refused["fix"] is None
    view = _json("show", str(save), KEY)["extra_state"][0]
    assert view["state"] is None and "system" in view["error"]
    census = _json("inspect", str(save), "--extra-state")["extra_state"]
    assert census["unreadable"] == 1
    proc = run_ckptdoctor("edit", str(save), "--drop-redundant-extra-state", "-o", str(tmp_path / "out"))
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    assert not marker.exists()


def _custom_recipe_payload(monkeypatch) -> bytes:
    """A CustomRecipe with a factory, pickled the way pickle names them (module and class by name; the modules
    exist here only for pickle's lookup: nothing of TE is imported)."""
    recipe_module = types.ModuleType("transformer_engine.common.recipe")

    class CustomRecipe:
        def __init__(self, qfactory):
            self.qfactory = qfactory

    CustomRecipe.__module__, CustomRecipe.__qualname__ = recipe_module.__name__, "CustomRecipe"
    recipe_module.CustomRecipe = CustomRecipe
    factory_module = types.ModuleType("mypkg.quant")

    def make_quantizer(role):  # never called
        raise AssertionError

    make_quantizer.__module__, make_quantizer.__qualname__ = factory_module.__name__, "make_quantizer"
    factory_module.make_quantizer = make_quantizer
    for name, module in [
        ("transformer_engine", types.ModuleType("transformer_engine")),
        ("transformer_engine.common", types.ModuleType("transformer_engine.common")),
        ("transformer_engine.common.recipe", recipe_module),
        ("mypkg", types.ModuleType("mypkg")),
        ("mypkg.quant", factory_module),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    return pickle.dumps({"recipe": CustomRecipe(make_quantizer), "extra_fp8_variables": {}})


def test_a_custom_recipe_is_refused_and_its_factory_named(copy_fixture, monkeypatch):
    save = copy_fixture("core019_te_delayed")
    payload = _custom_recipe_payload(monkeypatch)
    monkeypatch.undo()
    _point_item_at(save, KEY, _uint8_item(payload))
    found = _findings(str(save))
    assert any("mypkg.quant.make_quantizer" in m for m in found["CKD401"])
    state = _json("show", str(save), KEY)["extra_state"][0]["state"]
    assert state["recipe"] == "CustomRecipe" and state["custom_factory"] == "mypkg.quant.make_quantizer"
    assert state["te_2_18"] == "ignore"  # TE >= 2.18 ignores a payload naming CustomRecipe (policy "dynamic")


def test_grouped_experts_with_fp8_state_in_some_experts_only(copy_fixture, tmp_path):
    """TEGroupedLinear's keys (one _extra_state per linear, a shard per expert): sequential experts' keys renamed to
    them, and expert 0 of layer 0 given a real delayed-scaling state (core019_te_delayed's item bytes)."""
    save = copy_fixture("core019_moe_ep2")
    proc = run_ckptdoctor("edit", str(save), "--rename", r"experts\.experts\.", "experts.", "--in-place", "--no-backup")
    assert proc.returncode == 0, proc.stderr
    assert "CKD233" not in _findings(str(save))  # all empty: nothing to merge
    source = open_checkpoint(FIXTURES / "core019_te_delayed")
    blob, _ = source.bytes_item_data("decoder.layers.mlp.linear_fc1._extra_state/shard_0_2")
    key = "decoder.layers.mlp.experts.linear_fc1._extra_state/shard_0.0_2.4"
    location = open_checkpoint(save).entries[key].chunks[0].storage
    data_file = save / "iter_0000010" / location.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)

    def edit(metadata) -> None:
        for index, info in storage_items(metadata).items():
            if index_fqn(index) == key:
                set_storage(info, StorageLocation(info.relative_path, offset, len(blob)))

    _edit_metadata(save, edit)
    (message,) = _findings(str(save))["CKD233"]
    assert "FP8 state in expert(s) 0, empty in expert(s) 1, 2, 3" in message


# --- can-load: TE's refusal as a load failure -----------------------------------------------------------------


def _sections(*args: str) -> dict[str, dict]:
    report = _json("can-load", *args)
    return {s["section"]: s for s in report["sections"]}


def test_can_load_predicts_tes_refusal_with_the_env_var_as_the_fix():
    ckpt = str(FIXTURES / "core019_te_delayed")
    section = _sections(ckpt, "--target", "tp=1", "--no-load-optim")["extra_state"]
    assert section["verdict"] == "fails" and "TE 2.20.2 refuses 8 of the 8" in section["why"]
    assert "Refusing to load pickled Transformer Engine extra state" in section["error"]
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1" in section["fix"] and "--drop-extra-state" in section["fix"]
    proc = run_ckptdoctor("can-load", ckpt, "--target", "tp=1", "--no-load-optim")
    assert proc.returncode == 1
    older = _sections(ckpt, "--target", "tp=1", "--no-load-optim", "--te-version", "2.17.0")["extra_state"]
    assert (
        older["verdict"] == "loads"
        and "8 of them pickled states that TE 2.16.1, 2.17.1 and >= 2.18 refuse" in (older["why"])
    )
    patched = _sections(ckpt, "--target", "tp=1", "--no-load-optim", "--te-version", "2.17.1")["extra_state"]
    assert patched["verdict"] == "fails" and "TE 2.17.1 refuses 8 of the 8" in patched["why"]
    allowed = run_ckptdoctor("can-load", ckpt, "--target", "tp=1", "--no-load-optim", "--te-unsafe-pickle")
    assert allowed.returncode == 0, allowed.stdout


def test_can_load_counts_only_what_te_refuses_and_says_nothing_without_te_state():
    mixed = _sections(str(FIXTURES / "core019_te_mixed"), "--target", "tp=1", "--te-version", "2.18")["extra_state"]
    assert mixed["verdict"] == "fails" and "refuses 2 of the 8" in mixed["why"]
    assert "extra_state" not in _sections(str(FIXTURES / "core019_tp1"), "--target", "tp=2")


# --- diff --values: Transformer Engine state compared as state, not as its pickle ---------------------------------


def _payload_of(save: Path) -> bytes:
    obj = open_checkpoint(save).read_bytes_item(KEY)
    return bytes(obj.storage.data()[obj.storage_offset : obj.storage_offset + obj.numel])


def _values(a: Path, b: Path) -> dict:
    return _json("diff", str(a), str(b), "--values")["values"]


def test_diff_values_compares_extra_state_as_tes_state(tmp_path):
    """An item re-pickled without its unused memo entries (pickletools.optimize: other bytes, the same objects) is
    equal; one whose scale_fwd data changed differs at tensor_data.scale_fwd."""
    import pickletools

    from ckptdoctor.pickle import unpickler

    source = FIXTURES / "core019_te_delayed"
    payload = _payload_of(source)
    same = tmp_path / "same"
    shutil.copytree(source, same)
    optimized = pickletools.optimize(payload)
    assert optimized != payload
    _point_item_at(same, KEY, _uint8_item(optimized))
    values = _values(source, same)
    assert values["different"] == 0 and values["equal"] == values["compared"], values

    nested: list[bytes] = []
    unpickler.loads_prefix(payload, None, None, nested_saves=nested)
    start = payload.find(nested[0])  # scale_fwd's storage, the first tensor pickled: its data ends the save
    changed = bytearray(payload)
    changed[start + len(nested[0]) - 4 : start + len(nested[0])] = b"\x00\x00\x00\x40"  # its last 1.0 -> 2.0
    other = tmp_path / "other"
    shutil.copytree(source, other)
    _point_item_at(other, KEY, _uint8_item(bytes(changed)))
    values = _values(source, other)
    assert values["different"] == 1 and values["different_keys"][0]["key"] == KEY.split("/")[0], values
    fields = [f["path"] for f in values["different_keys"][0]["fields"]]
    assert any(path.endswith("tensor_data.scale_fwd") for path in fields), fields


@pytest.mark.mcore
def test_te_module_families_are_megatron_cores_te_spec():
    """CKD221 names the TE module at a path as megatron-core 0.19.2's TE layer spec builds it (dense and shared
    experts; grouped experts need TE itself to be chosen, so they are read from the spec's source, not checked)."""
    import subprocess

    from conftest import require_mcore

    from ckptdoctor.formats.te_extra_state import TE_MODULE_FAMILIES

    require_mcore()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "mcore_te_spec.py")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    spec = json.loads(proc.stdout)
    built = {path: name for layer in spec.values() for path, name in layer.items() if name.startswith("TE")}
    checked = {path: family for path, family in TE_MODULE_FAMILIES.items() if not path.startswith("mlp.experts.")}
    assert {path: built.get(path) for path in checked} == checked


# --- can-load: a checkpoint whose redundant extra state was dropped (Megatron-LM #5552's load side) ---------------


def test_can_load_says_which_strictness_and_megatron_accept_dropped_extra_state(tmp_path):
    """megatron-core 0.19.2 requests every module's _extra_state: the dropped ones are missing under the default
    strictness (test_edit_mcore.py loads it for real), load under a dropping strictness, and are not requested by
    a run with Megatron-LM's --ckpt-drop-redundant-extra-state (PR #5552) unless it trains with delayed scaling."""
    lean = tmp_path / "lean"
    proc = run_ckptdoctor("edit", FIXTURES / "core019_te_mixed", "--drop-redundant-extra-state", "-o", lean)
    assert proc.returncode == 0, proc.stderr
    run = (str(lean), "--target", "tp=1", "--no-load-optim", "--te-unsafe-pickle")
    model = _sections(*run)["model"]
    assert model["verdict"] == "fails" and "requests 3 keys the checkpoint lacks" in model["why"]
    assert model["error"].startswith("CheckpointException: Missing key in checkpoint state_dict: decoder.layers.mlp")
    assert "--dist-ckpt-strictness log_unexpected" in model["fix"]
    assert "--ckpt-drop-redundant-extra-state" in model["fix"] and "PR #5552" in model["fix"]
    assert "not in megatron-core 0.19.x" in model["fix"]
    for strictness in ("log_unexpected", "log_all", "ignore_all"):
        report = _json("can-load", *run, "--strictness", strictness)
        assert report["will_load"], (strictness, report["sections"])
        assert any("dropped under strictness" in w for w in report["warnings"])
    flagged = _json("can-load", *run, "--ckpt-drop-redundant-extra-state")
    assert flagged["will_load"] and flagged["options"]["drop_redundant_extra_state"] is True
    assert any("PR #5552" in w for w in flagged["warnings"])
    (extra,) = [s for s in flagged["sections"] if s["section"] == "extra_state"]
    assert extra["verdict"] == "loads" and "not requested" in extra["why"]
    # without --te-unsafe-pickle too: TE never reads what the run does not request
    assert _json("can-load", str(lean), "--target", "tp=1", "--no-load-optim", "--ckpt-drop-redundant-extra-state")[
        "will_load"
    ]
    # a delayed-scaling run keeps its extra state persistent: requested, missing, as without the flag
    delayed = _sections(*run, "--ckpt-drop-redundant-extra-state", "--set", "fp8=hybrid")["model"]
    assert delayed["verdict"] == "fails" and "Missing key in checkpoint state_dict" in delayed["error"]
    # the whole checkpoint, nothing dropped: loads as before, with or without the flag
    assert _json("can-load", str(FIXTURES / "core019_tp1"), "--target", "tp=1")["will_load"]
    assert _json("can-load", str(FIXTURES / "core019_tp1"), "--target", "tp=1", "--ckpt-drop-redundant-extra-state")[
        "will_load"
    ]


def test_check_reads_each_extra_state_item_once(monkeypatch, capsys, copy_fixture):
    """check gates every bytes item, the census judges the _extra_state ones, and the fix line (edit
    --drop-extra-state, CKD230) is verified: one read of each item for all three (the gate's ranged pass and the
    single-item reads counted)."""
    from collections import Counter

    from ckptdoctor.cli import main
    from ckptdoctor.formats import torch_dist
    from ckptdoctor.rules import safety

    save = copy_fixture("core019_te_delayed")
    reads: Counter[str] = Counter()
    ranged, single = safety.read_ranges, torch_dist.read_range

    def counting_ranges(files):
        for path, key, blob in ranged(files):
            reads[key] += 1
            yield path, key, blob

    def counting_range(iteration_dir, location, max_length=None):
        reads[(location.relative_path, location.offset)] += 1
        return single(iteration_dir, location, max_length)

    monkeypatch.setattr(safety, "read_ranges", counting_ranges)
    monkeypatch.setattr(torch_dist, "read_range", counting_range)
    assert main(["check", str(save), "--format", "json"]) == 1
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["code"] == "CKD230" and "--drop-extra-state" in finding["fix"]  # the fix line was verified
    checkpoint = open_checkpoint(save)
    items = {k: e.chunks[0].storage for k, e in checkpoint.entries.items() if "_extra_state" in k}
    assert len(items) == 8
    for key, location in items.items():
        assert reads[key] + reads[(location.relative_path, location.offset)] == 1, (key, reads)
