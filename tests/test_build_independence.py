"""What a command writes or prints does not depend on whether the C extensions were built (speed and memory may).

Every rewrite's ``.metadata`` and ``common.pt`` is pickled from what the one engine's faithful read built, so the
objects it shares (one ``torch.Size`` per distinct size within a load: ``faithful_size``) decide the pickle's memo
and so its bytes. Each command runs twice in a child process, with the extensions and with
``CKPTDOCTOR_NO_EXTENSIONS=1``, and every file it writes and its JSON report are compared byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor import native as ckptdoctor_native
from ckptdoctor.pickle import policy
from ckptdoctor.pickle.torch_stand_ins import FaithfulSizes, Size

try:
    from ckptdoctor.pickle._native import faithful_size as native_faithful_size
    from ckptdoctor.pickle._native import forget_index_sizes as native_forget
except ImportError:  # built without a compiler, or blocked
    native_faithful_size = None

needs_c = pytest.mark.skipif(native_faithful_size is None, reason="the C extension was not built")

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
_STAMP = re.compile(r"\d{8}T\d{6}")  # the time in a written file's name
_STAMP_BYTES = re.compile(rb"\d{8}T\d{6}")

WRITES = [
    pytest.param(["strip-frozen", "core019_peft_full_tp2"], id="strip-frozen"),
    pytest.param(["edit", "core019_tp2", "--drop-extra-state"], id="edit-drop-extra-state"),
    pytest.param(["edit", "core019_moe_ep2", "--rename", "final_layernorm", "final_norm"], id="edit-rename"),
    pytest.param(["fix-args", "core019_convert_tp4"], id="fix-args"),
]


def _run(argv: list[str], out: Path, blocked: bool) -> Any:
    env = dict(os.environ)
    env.pop("CKPTDOCTOR_NO_EXTENSIONS", None)
    if blocked:
        env["CKPTDOCTOR_NO_EXTENSIONS"] = "1"
    command, fixture, *rest = argv
    result = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", command, str(FIXTURES / fixture), *rest, "-o", str(out)]
        + ["--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode in (0, 1), result.stderr
    return _without_timings(json.loads(_STAMP.sub("<T>", result.stdout.replace(str(out), "<OUT>"))))


def _without_timings(report: Any) -> Any:
    """The report less its wall-clock fields (``seconds``, ``*_seconds``), which differ run to run."""
    if isinstance(report, dict):
        return {k: _without_timings(v) for k, v in report.items() if not k.endswith("seconds")}
    if isinstance(report, list):
        return [_without_timings(v) for v in report]
    return report


def _files(root: Path) -> dict[str, bytes]:
    """Every file written, by its path (a written file's timestamp masked in names and contents: runs differ by
    seconds; the mask keeps its length, so a pickle's frames are unchanged)."""
    return {
        _STAMP.sub("<T>", str(p.relative_to(root))): _STAMP_BYTES.sub(b"YYYYMMDDTHHMMSS", p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@needs_c
@pytest.mark.parametrize("argv", WRITES)
def test_a_rewrite_writes_the_same_bytes_with_and_without_the_extensions(tmp_path: Path, argv: list[str]) -> None:
    built = _run(argv, tmp_path / "built", blocked=False)
    blocked = _run(argv, tmp_path / "blocked", blocked=True)
    assert blocked == built
    written_built, written_blocked = _files(tmp_path / "built"), _files(tmp_path / "blocked")
    assert sorted(written_blocked) == sorted(written_built)
    rewritten = [name for name in written_built if name.endswith((".metadata", "common.pt"))]
    assert rewritten, "the command wrote no pickle"
    for name in written_built:
        assert written_blocked[name] == written_built[name], f"{name} differs between the two builds"


@needs_c
def test_python_sizes_share_exactly_what_the_c_shares() -> None:
    """The Python twin against the C as oracle: which calls return an already-made object, which fail, and how."""
    calls: list[tuple] = [
        ((4, 8),),
        ((4, 8),),
        ((8, 4),),
        ((),),
        ((),),
        ((True, 1),),  # a bool is not an exact int: never shared
        ((True, 1),),
        ((2**63 - 1,),),
        ((2**63 - 1,),),
        ((-(2**63),),),
        ((-(2**63),),),
        (tuple(range(64)),),
        (tuple(range(64)),),
        (tuple(range(65)),),  # longer than the table's keys: never shared
        (tuple(range(65)),),
        ((2**63,),),  # outside int64: torch's error
        (("a",),),
        ([4, 8],),  # not a tuple
        (),
        ((1,), (2,)),
    ]
    python = FaithfulSizes()

    def outcomes(make, forget) -> list:  # type: ignore[no-untyped-def]
        forget()
        made: list = []
        seen: list = []
        for args in calls:
            try:
                obj = make(Size, *args)
            except Exception as exc:  # noqa: BLE001 - compared as type and message
                seen.append(("error", type(exc).__name__, str(exc)))
                continue
            shared = next((i for i, earlier in enumerate(made) if earlier is obj), None)
            made.append(obj)
            seen.append(("made", type(obj).__name__, tuple(obj), shared))
        forget()
        return seen

    assert outcomes(python, python.forget) == outcomes(native_faithful_size, native_forget)


def test_the_engine_shares_sizes_in_a_faithful_read_in_either_build() -> None:
    policy.forget_index_sizes()
    try:
        first, second = policy.faithful_size((3, 5)), policy.faithful_size((3, 5))
        assert first is second and type(first) is Size
    finally:
        policy.forget_index_sizes()
    assert policy.faithful_size((3, 5)) is not first  # a new load starts a new table
    policy.forget_index_sizes()


_HEALTH = pytest.mark.skipif(not ckptdoctor_native("ckptdoctor.values._health"), reason="the C extension was not built")


def _report(argv: list[str], blocked: bool) -> Any:
    """The JSON report of a read-only command (no ``-o``), with the extensions or with them blocked."""
    env = dict(os.environ)
    env.pop("CKPTDOCTOR_NO_EXTENSIONS", None)
    if blocked:
        env["CKPTDOCTOR_NO_EXTENSIONS"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", *argv, "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode in (0, 1), result.stderr
    return _without_timings(json.loads(result.stdout))


@_HEALTH
@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["check", "--isolated", "--health", str(FIXTURES / name)], id=name)
        for name in ("core019_nan_weight_tp1", "core019_moe_dup_expert_ep2", "core019_inf_exp_avg_sq_dp2")
    ]
    + [
        pytest.param(
            [
                "diff",
                str(FIXTURES / "core019_trained_tp1"),
                str(FIXTURES / "core019_reinit_layer_trained_tp1"),
                "--values",
                "--stats",
            ],
            id="diff-stats",
        )
    ],
)
def test_health_statistics_are_the_same_with_and_without_the_c_loop(argv: list[str]) -> None:
    """``check --health``'s statistics and findings (and ``diff --values --stats``) from the C loop of
    ``values/_health.c`` equal numpy's, key by key, fingerprints included."""
    built = _report(argv, blocked=False)
    assert built == _report(argv, blocked=True)
    assert built.get("stats") or built["health"][0]["keys"]  # statistics were reported, not only compared
