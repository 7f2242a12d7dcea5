"""Time and peak RSS of ckptdoctor on hostile inputs, next to a benign checkpoint of the same size, in one run.

Each case is a copy of the ``core016_tp1`` fixture whose ``common.pt`` (or ``.metadata``) is replaced by one
input of the corpus in ``tests/hostile_corpus.py``; the benign twin replaces it with a legitimate common
state padded to the same file size (a list of small ints: as many objects per byte as a real pickle). Every
command runs in its own child process; wall time and that child's peak RSS come from ``os.wait4``
(``bench/harness.py``). Each hostile / benign pair is one alternating group (``--repeats`` rounds, no warm-up
round: the inputs were just written); the table reports medians. Written to ``bench/results/hostile.json`` and
printed as Markdown.

    python bench/bench_hostile.py [--repeats 3] [--timeout 120]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(BENCH), str(REPO / "tests"), str(REPO)]

import harness  # noqa: E402
from harness import Case, alternate  # noqa: E402
from hostile_corpus import DEEP_LISTS, RESOURCE_CASES, billion_laughs, deflate_bomb, torch_zip  # noqa: E402

from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip  # noqa: E402  (small: no torch)

FIXTURE = REPO / "fixtures" / "core016_tp1"
ITER = "iter_0000010"
COMMANDS = (("inspect",), ("check",), ("check", "--deep"))


def cases(work: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (file replaced, its hostile content)."""
    state = load_torch_zip(FIXTURE / ITER / "common.pt", "common.pt")
    state["args"].hidden_size = billion_laughs()
    out: dict[str, tuple[str, bytes]] = {
        f"{name} (common.pt)": ("common.pt", torch_zip(data)) for name, data in RESOURCE_CASES.items()
    }
    out["deep tuple as dict key (.metadata)"] = (".metadata", RESOURCE_CASES["deep tuple as dict key"])
    out["a million nested lists (common.pt)"] = ("common.pt", torch_zip(DEEP_LISTS))
    out["billion laughs in args (common.pt)"] = ("common.pt", dump_torch_zip(state))
    out["deflate bomb, 200 MiB data.pkl (common.pt)"] = ("common.pt", deflate_bomb())
    return out


def benign(size: int) -> bytes:
    """A legitimate common.pt of about ``size`` bytes: the fixture's state plus a list of small ints."""
    state = load_torch_zip(FIXTURE / ITER / "common.pt", "common.pt")
    base = len(dump_torch_zip(state))
    state["padding"] = list(range(200)) * max(0, (size - base) // (2 * 200 + 2))
    return dump_torch_zip(state)


def make(work: Path, label: str, name: str, content: bytes) -> Path:
    target = work / label
    shutil.copytree(FIXTURE, target)
    (target / ITER / name).write_bytes(content)
    return target


def prepare(work: Path) -> None:
    """Write every case and its twin under ``work`` (run in a child: building a 200 MiB bomb must not inflate
    the measuring parent, whose RSS a forked child would start from)."""
    manifest = []
    for index, (case, (name, content)) in enumerate(cases(work).items()):
        hostile = make(work, f"h{index}", name, content)
        twin = make(work, f"b{index}", "common.pt", benign(len(content)))
        manifest.append(
            {"case": case, "file": name, "bytes": len(content), "hostile": str(hostile), "benign": str(twin)}
        )
    (work / "manifest.json").write_text(json.dumps(manifest))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "hostile.json")
    parser.add_argument("--render", action="store_true", help="print the table of the results file (--out)")
    parser.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)
    harness.add_common_options(parser)
    opts = parser.parse_args(argv)
    harness.use_code(opts.code)
    if opts.prepare:
        prepare(opts.prepare)
        return 0
    if opts.render:
        print(render(json.loads(opts.out.read_text())))
        return 0
    recorder = harness.Recorder("hostile", argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, __file__, "--prepare", str(work)], check=True)
        for item in json.loads((work / "manifest.json").read_text()):
            case, name, size = item["case"], item["file"], item["bytes"]
            for command in COMMANDS:
                group = alternate(
                    {
                        side: Case(harness.ckptdoctor(*command, item[side]), ok_rcs=(0, 1, 2))
                        for side in ("hostile", "benign")
                    },
                    opts.repeats,
                    opts.timeout,
                    warm_up=False,
                    verbose=False,
                )
                h = group.runs["hostile"]
                timed_out = "timed out" in group.failures.get("hostile", "")
                rows.append(
                    {
                        "case": case,
                        "file": name,
                        "input_bytes": size,
                        "command": " ".join(command),
                        "hostile_rc": sorted({r.rc for r in h}, key=str),
                        "hostile_timed_out": timed_out,
                        "hostile_wall_s": group.seconds("hostile"),
                        "hostile_peak_rss_mb": group.peak_rss_mb("hostile"),
                        "benign_wall_s": group.seconds("benign"),
                        "benign_peak_rss_mb": group.peak_rss_mb("benign"),
                        "runs": group.summary(),
                    }
                )
                r = rows[-1]
                print(
                    f"{case:48s} {' '.join(command):14s} hostile {_s(r['hostile_wall_s'])} "
                    f"{r['hostile_peak_rss_mb'] or 0:.0f}MB rc={r['hostile_rc']}  benign "
                    f"{_s(r['benign_wall_s'])} {r['benign_peak_rss_mb'] or 0:.0f}MB",
                    flush=True,
                )
    doc = json.loads(recorder.write({"repeats": opts.repeats, "rows": rows}, name=opts.out.stem).read_text())
    print("\n" + harness.header(doc) + "\n\n" + render(doc))
    bad = [
        r
        for r in rows
        if r["hostile_timed_out"] or (r["hostile_peak_rss_mb"] or 0) > (r["benign_peak_rss_mb"] or 0) + 300
    ]
    return 1 if bad else 0


def render(doc: dict) -> str:
    lines = [
        "| case | command | input | hostile: exit, time, peak RSS | benign twin: time, peak RSS |",
        "|---|---|---:|---|---|",
    ]
    for r in doc["rows"]:
        rc = ",".join(map(str, r["hostile_rc"])) + (" (TIMEOUT)" if r["hostile_timed_out"] else "")
        lines.append(
            f"| {r['case']} | `{r['command']}` | {r['input_bytes'] / 1024:.0f} KiB | {rc}, "
            f"{_s(r['hostile_wall_s'])}, {r['hostile_peak_rss_mb'] or 0:.0f} MB | "
            f"{_s(r['benign_wall_s'])}, {r['benign_peak_rss_mb'] or 0:.0f} MB |"
        )
    return "\n".join(lines)


def _s(seconds: dict | None) -> str:
    return "-" if not seconds else f"{seconds['median']:.2f} s"


if __name__ == "__main__":
    raise SystemExit(main())
