"""The pickle pre-pass alone (``ckptdoctor.pickle.scanner.scan``), this tree against another, in one process.

Each ``.metadata`` is read once; then, round by round (one untimed warm-up round first, the order rotating
each round), the scanner of ``--code`` (default: this checkout: ``after``, its C walk where the extension is
built, and ``after_python``, its Python walk ``scan_python`` where the tree has one) and the one of ``--before
TREE`` (its ``ckptdoctor/pickle/scanner.py`` loaded as a separate module, beside the current package's limits and
allowlist) scan the same bytes with the same ``safe_hash`` callback. CPU seconds per scan
(``time.process_time``), the ratios to ``before`` per round, and ns per opcode (the opcode count from
``pickletools.genops``, once).

    git worktree add --detach /tmp/ckd_before <commit>
    python bench/bench_scan.py --before /tmp/ckd_before --metadata PATH... [--rounds 6]
"""

from __future__ import annotations

import argparse
import importlib.util
import pickletools
import sys
import time
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402


def load_scanner(tree: Path, name: str) -> ModuleType:
    harness.build_extension(tree)
    # trees before the one pickle engine (issue #34) kept the scanner at ckptdoctor/pickle_scan.py
    path = next(
        (p for p in (tree / "ckptdoctor/pickle/scanner.py", tree / "ckptdoctor/pickle_scan.py") if p.exists()), None
    )
    spec = importlib.util.spec_from_file_location(name, path) if path else None
    if spec is None or spec.loader is None:
        raise SystemExit(f"{tree}: no ckptdoctor/pickle/scanner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_options(parser)
    parser.add_argument("--before", type=Path, required=True, help="source tree of the scanner to compare with")
    parser.add_argument("--metadata", type=Path, nargs="+", required=True, help=".metadata files to scan")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--results-name", default="scan")
    args = parser.parse_args(argv)
    harness.use_code(args.code)
    recorder = harness.Recorder("scan", argv)
    sys.path.insert(0, str(harness.CODE))
    from ckptdoctor.pickle.limits import current_limits
    from ckptdoctor.pickle.policy import hash_safe_global

    after, before = load_scanner(harness.CODE, "scan_after"), load_scanner(args.before, "scan_before")
    scanners = {"after": after.scan, "before": before.scan}
    if hasattr(after, "scan_python"):
        scanners["after_python"] = lambda data, limits, safe_hash: after.scan_python(data, current_limits(), safe_hash)
    print(f"after: C walk {'built' if getattr(after, '_scan_c', None) else 'NOT built: the Python walk'}")
    names = list(scanners)
    cases = {}
    for path in args.metadata:
        data = path.read_bytes()
        opcodes = sum(1 for _ in pickletools.genops(data))
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.rounds + 1):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                started = time.process_time()
                scanners[name](data, None, hash_safe_global)
                if round_:  # round 0 warms up
                    seconds[name].append(time.process_time() - started)
        cases[str(path)] = row = {
            "bytes": len(data),
            "opcodes": opcodes,
            "cpu_s": {name: harness.spread(values) for name, values in seconds.items()},
            "ns_per_opcode": {name: 1e9 * min(values) / opcodes for name, values in seconds.items()},
            "after_over_before": harness.spread([a / b for a, b in zip(seconds["after"], seconds["before"])]),
        }
        if "after_python" in seconds:
            row["after_python_over_before"] = harness.spread(
                [a / b for a, b in zip(seconds["after_python"], seconds["before"])]
            )
        print(
            f"{path}: {len(data):,} B, {opcodes:,} opcodes; "
            + ", ".join(f"{name} {harness.fmt_spread(row['cpu_s'][name])} s" for name in names)
            + f"; after/before {harness.fmt_spread(row['after_over_before'])}"
        )
    recorder.write({"before": {"tree": str(args.before)}, "rounds": args.rounds, "cases": cases}, args.results_name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
