"""Write the output of every read-only command on every fixture to OUTDIR (one file per run: stdout, stderr, rc).

Used to show that a refactoring changes no output: run it on two commits and compare the folders
(`diff -r A B`). Paths are relative to the repository root, so both runs print the same strings.

    python scripts/snapshot_outputs.py OUTDIR [--ckptdoctor "python -m ckptdoctor"] [--repo DIR]
        [--synthetic A B]   # also every read-only command, JSON and text, on two large synthetic checkpoints
                            # (bench/make_synthetic.py; the same layout of keys at two TP sizes) and diff A B
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

# Wall-clock figures and the peak of bytes in flight (it depends on thread timing) differ from run to run:
# masked, so that only real output changes show.
TIMINGS = [
    (re.compile(r"\bin \d+(\.\d+)? s\b"), "in <t> s"),
    (re.compile(r'"seconds": [0-9.e-]+'), '"seconds": <t>'),
    (re.compile(r'"peak_in_flight": \d+'), '"peak_in_flight": <n>'),
]
# inspect and strip-frozen called their text output "table" before one --format vocabulary; both accept it.
TEXT_NAME = {"inspect": "table", "strip-frozen": "table"}


def mask_timings(text: str) -> str:
    for pattern, replacement in TIMINGS:
        text = pattern.sub(replacement, text)
    return text


FIXTURE_PAIRS = [
    ("core019_tp1", "core019_tp2"),
    ("core019_tp2", "core019_tp2_dp2"),
    ("core019_convert_src_tp1", "core019_convert_tp4"),
    ("core016_tp1", "core019_tp1"),
    ("core019_peft_full_tp1", "core019_peft_trainable_tp1"),
    ("core014_zarr_tp2", "core015_tp2"),
]


def runs(fixtures: list[str]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for name in fixtures:
        path = f"fixtures/{name}"
        for fmt in ("text", "json"):
            out += [
                (f"inspect-{name}-{fmt}", ["inspect", path, "--format", fmt]),
                (f"inspect-keys-{name}-{fmt}", ["inspect", path, "--keys", "--format", fmt]),
                (f"check-{name}-{fmt}", ["check", path, "--format", fmt]),
                (f"check-deep-{name}-{fmt}", ["check", "--deep", path, "--format", fmt]),
                (f"fix-args-{name}-{fmt}", ["fix-args", path, "--format", fmt]),
                (f"strip-dry-{name}-{fmt}", ["strip-frozen", path, "--dry-run", "--format", fmt]),
                (f"repair-{name}-{fmt}", ["repair", path, "--format", fmt]),
                (f"latest-good-{name}-{fmt}", ["latest-good", path, "--format", fmt]),
            ]
    for a, b in FIXTURE_PAIRS:
        for fmt in ("text", "json"):
            out += [
                (f"diff-{a}-{b}-{fmt}", ["diff", f"fixtures/{a}", f"fixtures/{b}", "--format", fmt]),
                (f"diff-values-{a}-{b}-{fmt}", ["diff", "--values", f"fixtures/{a}", f"fixtures/{b}", "--format", fmt]),
            ]
    out += [("rules-text", ["rules"]), ("rules-json", ["rules", "--format", "json"])]
    return out


def synthetic_runs(a: str, b: str) -> list[tuple[str, list[str]]]:
    """Every read-only command on a large synthetic checkpoint (``a``) and across a pair of layouts (``a``, ``b``)."""
    out: list[tuple[str, list[str]]] = []
    for fmt in ("text", "json"):
        out += [
            (f"synthetic-inspect-{fmt}", ["inspect", a, "--format", fmt]),
            (f"synthetic-inspect-keys-{fmt}", ["inspect", a, "--keys", "--format", fmt]),
            (f"synthetic-check-{fmt}", ["check", a, "--format", fmt]),
            (f"synthetic-check-deep-{fmt}", ["check", "--deep", a, "--format", fmt]),
            (f"synthetic-fix-args-{fmt}", ["fix-args", a, "--format", fmt]),
            (f"synthetic-strip-dry-{fmt}", ["strip-frozen", a, "--dry-run", "--format", fmt]),
            (f"synthetic-edit-dry-{fmt}", ["edit", a, "--remove", "^optimizer", "--dry-run", "--format", fmt]),
            (f"synthetic-can-load-{fmt}", ["can-load", a, "--target", "tp=4", "--format", fmt]),
            (f"synthetic-diff-{fmt}", ["diff", a, b, "--format", fmt]),
            (f"synthetic-diff-values-{fmt}", ["diff", "--values", a, b, "--format", fmt]),
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--ckptdoctor", default=f"{sys.executable} -m ckptdoctor")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--only", default="", help="Substring of run names to keep.")
    parser.add_argument("--synthetic", nargs=2, metavar=("A", "B"), help="Two synthetic checkpoints (absolute paths).")
    args = parser.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    fixtures = sorted(p.name for p in (args.repo / "fixtures").iterdir() if p.is_dir() and p.name.startswith("core"))
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1", "PYTHONPATH": str(args.repo)}
    planned = runs(fixtures) + (synthetic_runs(*args.synthetic) if args.synthetic else [])
    for name, cli_args in planned:
        if args.only not in name:
            continue
        if cli_args[-2:] == ["--format", "text"] and cli_args[0] in TEXT_NAME:
            cli_args = [*cli_args[:-1], TEXT_NAME[cli_args[0]]]
        proc = subprocess.run(
            [*shlex.split(args.ckptdoctor), *cli_args], cwd=args.repo, env=env, capture_output=True, text=True
        )
        text = f"rc={proc.returncode}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}"
        (args.outdir / f"{name}.out").write_text(mask_timings(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
