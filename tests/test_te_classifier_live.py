"""ckptdoctor's prediction of Transformer Engine's extra-state refusal against each released classifier, run live.

scripts/test.sh installs the pure-Python ``transformer-engine`` wheel of every release that matters here
(``--no-deps --target .venv/transformer-engine/<version>``: 2.16.1, 2.17.1, 2.18.0, 2.19.0 and 2.20.2 carry the
classifier, 2.17.0 is the last without it), and tests/te_classify.py runs one release's own
``_classify_extra_state_pickle`` in a child process (TE's Python only: no torch, no CUDA extension). Each
``_extra_state`` payload of the TE fixtures, and a corpus pickled from each release's real recipe classes, must get
the verdict ckptdoctor predicts. ``CKPTDOCTOR_TE_PYTHON`` names another folder of such installs; without any, the
tests skip (CI sets ``CKPTDOCTOR_REQUIRE_TE=1``: they fail instead).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_ckptdoctor

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.formats import te_extra_state as te
from ckptdoctor.pickle.torch_stand_ins import TensorRef

FIXTURES = REPO / "fixtures"
TE_FIXTURES = ("core019_te_delayed", "core019_te_mixed", "core019_te_v20")
CLASSIFY = Path(__file__).resolve().parent / "te_classify.py"
VERDICT = {"unsafe_load": "refuse", "ignore": "ignore"}  # TE's _PickledExtraStateAction -> ckptdoctor's word


TE_ROOT = Path(os.environ.get("CKPTDOCTOR_TE_PYTHON") or REPO / ".venv" / "transformer-engine")


def _installed_releases(root: Path = TE_ROOT) -> dict[str, Path]:
    found = {}
    for dist in sorted(root.glob("*/transformer_engine-*.dist-info")):
        found[dist.name[len("transformer_engine-") : -len(".dist-info")]] = dist.parent
    return found


RELEASES = _installed_releases()


@pytest.fixture
def releases() -> dict[str, Path]:
    """The installed TE releases by version, or skip (fail where CKPTDOCTOR_REQUIRE_TE is set)."""
    if not RELEASES:
        why = f"no transformer-engine release installed under {TE_ROOT} (scripts/test.sh installs them)"
        if os.environ.get("CKPTDOCTOR_REQUIRE_TE"):
            pytest.fail(f"CKPTDOCTOR_REQUIRE_TE is set but {why}", pytrace=False)
        pytest.skip(why)
    return RELEASES


def classify(te_dir: Path, payloads: list[bytes], corpus: bool = False) -> dict:
    """One release's own classifier on ``payloads`` (tests/te_classify.py, a child process)."""
    request = json.dumps({"payloads": [p.hex() for p in payloads], "corpus": corpus})
    env = {**os.environ, "PYTHONPATH": "", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(CLASSIFY), str(te_dir)],
        input=request,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _payload(obj: object) -> bytes | None:
    """The bytes TE's set_extra_state hands its classifier (None: it never classifies this object)."""
    if isinstance(obj, TensorRef) and obj.numel:
        return bytes(obj.storage.data()[obj.storage_offset : obj.storage_offset + obj.numel])
    return None


def _fixture_items() -> list[tuple[str, str, object]]:
    out = []
    for name in TE_FIXTURES:
        checkpoint = open_checkpoint(FIXTURES / name)
        for key in json.loads((FIXTURES / "manifests" / f"{name}.te.json").read_text())["items"]:
            out.append((name, key, checkpoint.read_bytes_item(key)))
    return out


def _te_action(obj: object, verdict: str | None, has_classifier: bool) -> str:
    """What the release's set_extra_state does: None and empty tensors return before the classifier, a BytesIO is
    refused outright by a release with the classifier; a release without one loads everything."""
    if not has_classifier:
        return "load"
    if isinstance(obj, io.BytesIO):
        return "refuse"
    return "ignore" if verdict is None else VERDICT[verdict]


def test_every_fixture_payload_gets_the_verdict_of_each_releases_own_classifier(releases):
    items = _fixture_items()
    payloads = [_payload(obj) for _, _, obj in items]
    shown = {
        (name, key): run_json("show", FIXTURES / name, key)["extra_state"][0]["state"]["te_2_18"]
        for name, key, _ in items
    }
    for version, te_dir in releases.items():
        answer = classify(te_dir, [p for p in payloads if p is not None])
        assert answer["version"] == version
        verdicts = iter(answer["verdicts"] or [])
        for (name, key, obj), payload in zip(items, payloads):
            verdict = next(verdicts) if payload is not None and answer["classifier"] else None
            action = _te_action(obj, verdict, answer["classifier"])
            predicted = shown[(name, key)] if te.refuses_pickled(te.parse_te_version(version)) else "load"
            assert predicted == action, (version, name, key)


def run_json(*args: object) -> dict:
    proc = run_ckptdoctor(*args, "--format", "json")
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def test_can_load_refuses_what_each_release_refuses(releases):
    """Per release: can-load --te-version V fails with the number of items V's classifier refuses, or loads them
    all where V has no classifier (2.17.0) or refuses none."""
    items = _fixture_items()
    for version, te_dir in releases.items():
        for name in TE_FIXTURES:
            own = [(obj, _payload(obj)) for fixture, _, obj in items if fixture == name]
            answer = classify(te_dir, [p for _, p in own if p is not None])
            verdicts = iter(answer["verdicts"] or [])
            refused = 0
            for obj, payload in own:
                verdict = next(verdicts) if payload is not None and answer["classifier"] else None
                refused += _te_action(obj, verdict, answer["classifier"]) == "refuse"
            report = run_json("can-load", FIXTURES / name, "--target", "tp=1", "--te-version", version)
            (section,) = [s for s in report["sections"] if s["section"] == "extra_state"]
            if refused:
                assert section["verdict"] == "fails", (version, name, section)
                assert re.search(rf"TE {re.escape(version)} refuses {refused} of the", section["why"]), section
            else:
                assert section["verdict"] == "loads", (version, name, section)


def _edge_payloads() -> list[bytes]:
    """Payloads no get_extra_state writes, at the edges of the classifier's rules."""
    real = _payload(open_checkpoint(FIXTURES / "core019_te_delayed").read_bytes_item(te_fixture_key()))
    assert real is not None
    return [
        b"\x80\x05garbage",  # no pickle: TE treats it as one to unpickle unsafely
        real[: len(real) // 2],  # truncated mid-stream
        pickle.dumps({"recipe": "DelayedScaling"}),  # the key, no global
        pickle.dumps({"scale_fwd": 1.0}),  # a delayed key, no global
        pickle.dumps({"recipe": None, "x": os.path.join}, protocol=2),  # a global that is no recipe
        pickle.dumps({"recipe": None, "x": os.path.join}, protocol=0),
        pickle.dumps([1, 2, 3]),
        pickle.dumps("recipe"),
    ]


def te_fixture_key() -> str:
    return "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"


def test_the_model_equals_each_releases_classifier_on_a_corpus_of_its_real_recipes(releases):
    """Every recipe class of the release (delayed, current, MXFP8, block, NVFP4, custom), with and without
    delayed-scaling keys, None and empty dicts, pickled with every protocol by the release's own classes, and the
    edge payloads above: :func:`te_refuses` gives the classifier's verdict on each."""
    edges = _edge_payloads()
    checked = 0
    for version, te_dir in releases.items():
        answer = classify(te_dir, edges, corpus=True)
        if not answer["classifier"]:
            assert not te.refuses_pickled(te.parse_te_version(version)), version
            continue
        assert te.refuses_pickled(te.parse_te_version(version)), version
        payloads = edges + [bytes.fromhex(p) for p in answer["corpus"]]
        assert len(answer["verdicts"]) == len(payloads) > 100
        for payload, verdict in zip(payloads, answer["verdicts"]):
            assert te.te_refuses(payload) == VERDICT[verdict], (version, payload[:200])
        checked += 1
    assert checked, "no installed release has the classifier"
