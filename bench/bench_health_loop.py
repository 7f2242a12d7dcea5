"""Time ``check --health``'s per-element C loop alone (``ckptdoctor.values._health.floats``), in ns an element.

Slabs of normal values (sigma 1, as the synthetic checkpoints hold) in float32 and bfloat16: one run of 122,368
elements (a 478 x 256 chunk of ``make_synthetic.py``'s, as ``check --health`` passes it), a 4M-element slab
(1024 x 4096 rows) and a 256-element run (where the fixed cost per slab shows). The loops: this tree's module, float32
also through its portable pass (``floats(..., portable=True)``: what runs without AVX2 or without GCC), and with
``--before TREE`` that tree's module. All in this process, alternating per round; each timing repeats a slab to
about 8M elements and keeps the best of ``--repeats`` rounds (the loop's own speed, the machine's noise left out).

With ``--reads``, instead, this tree's float32 loop over a page-cached file of ``--read-size`` bytes in chunks of 16
MiB (the synthetic checkpoints' largest records): read as ``check --deep`` and ``--health`` read, into one reused
buffer (``readinto``), against the file mapped (``mmap``: no copy); and the read alone. The difference is what the
copy from the page cache costs the loop.

    python bench/bench_health_loop.py                    # -> bench/results/health-loop.json
    python bench/bench_health_loop.py --before /tmp/base # and a baseline tree's loop (built in place if needed)
    python bench/bench_health_loop.py --reads            # the reads -> bench/results/health-reads.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (no torch)

SHAPES = {"run of 122,368": (1, 478 * 256), "1024 x 4096": (1024, 4096), "run of 256": (1, 256)}
LAYOUTS = {"float32": (8, 23), "bfloat16": (8, 7)}
TOTAL = 1 << 23  # elements per timing


def load(tree: Path) -> Any:
    """``tree``'s built ``_health`` module (building the tree's extensions first where they are stale)."""
    harness.build_extension(tree)
    built = sorted((tree / "ckptdoctor" / "values").glob("_health*.so"))
    if not built:
        raise SystemExit(f"{tree}: no ckptdoctor/values/_health*.so (no C compiler?)")
    spec = importlib.util.spec_from_file_location("_health", built[0])  # the name its PyInit__health needs
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_options(p)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--before", type=Path, default=None, help="baseline source tree: its loop joins each round")
    p.add_argument("--reads", action="store_true", help="instead, time the loop over a file read and mapped")
    p.add_argument("--read-size", type=harness.parse_size, default=harness.parse_size("1G"), help="that file's size")
    o = p.parse_args(argv)
    harness.use_code(o.code)
    import numpy as np

    recorder = harness.Recorder("health-loop", argv)
    loops: dict[str, tuple[Any, tuple]] = {}
    this = load(harness.CODE)
    if o.reads:
        case = f"float32, {o.read_size >> 20} MiB file, {READ_CHUNK >> 20} MiB chunks"
        best_reads = {case: reads(this, o.read_size, o.repeats)}
        doc = recorder.write({"ns_per_element_best": best_reads}, name="health-reads")
        print(harness.header(json.loads(doc.read_text())) + "\n")
        print(render(best_reads))
        return 0
    loops["this tree"] = (this, ())
    loops["this tree, portable pass"] = (this, (True,))
    if o.before is not None:
        loops["before"] = (load(o.before.resolve()), ())
    rng = np.random.default_rng(0)
    best: dict[str, dict[str, float]] = {}
    for layout, (exponent_bits, fraction_bits) in LAYOUTS.items():
        for shape_name, shape in SHAPES.items():
            values = rng.standard_normal(shape).astype(np.float32).view(np.uint32)
            bits = values if layout == "float32" else (values >> 16).astype(np.uint16)
            out = np.empty(shape[0], dtype=np.uint64)
            reps = max(1, TOTAL // bits.size)
            case = f"{layout}, {shape_name}"
            names = [n for n in loops if layout == "float32" or not loops[n][1]]
            results = {
                n: loops[n][0].floats(bits, shape[1], exponent_bits, fraction_bits, out, 1, *loops[n][1]) for n in names
            }
            if len({repr(r) for r in results.values()}) != 1:
                raise SystemExit(f"{case}: the loops disagree: {results}")
            best[case] = {n: float("inf") for n in names}
            for round_ in range(o.repeats):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    module, extra = loops[name]
                    started = time.perf_counter()
                    for _ in range(reps):
                        module.floats(bits, shape[1], exponent_bits, fraction_bits, out, 1, *extra)
                    seconds = (time.perf_counter() - started) / reps
                    best[case][name] = min(best[case][name], seconds / bits.size * 1e9)
    doc = recorder.write({"ns_per_element_best": best, "elements": {k: v[0] * v[1] for k, v in SHAPES.items()}})
    print(harness.header(json.loads(doc.read_text())) + "\n")
    print(render(best))
    return 0


READ_CHUNK = 16 << 20


def reads(module: Any, size: int, repeats: int) -> dict[str, float]:
    """ns per float32 element of the loop over a page-cached file of ``size`` bytes, chunk by chunk: read into a
    reused buffer, mapped, and the read alone (best of ``repeats`` alternating rounds)."""
    import mmap
    import tempfile

    import numpy as np

    size -= size % READ_CHUNK
    columns = 4096
    out = np.empty(READ_CHUNK // 4 // columns, dtype=np.uint64)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "float32.bin"
        rng = np.random.default_rng(1)
        with open(path, "wb") as f:  # written here: in the page cache
            for _ in range(size // READ_CHUNK):
                f.write(rng.standard_normal(READ_CHUNK // 4, dtype=np.float32).tobytes())

        def read_into(loop: bool) -> None:
            buffer = bytearray(READ_CHUNK)
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    if loop:
                        module.floats(buffer, columns, 8, 23, out, 1)

        def mapped() -> None:
            with open(path, "rb") as f:
                for offset in range(0, size, READ_CHUNK):
                    with mmap.mmap(f.fileno(), READ_CHUNK, offset=offset, access=mmap.ACCESS_READ) as m:
                        view = memoryview(m)
                        module.floats(view, columns, 8, 23, out, 1)
                        view.release()

        timed = {
            "read into a buffer + loop": lambda: read_into(True),
            "mapped + loop": mapped,
            "read alone": lambda: read_into(False),
        }
        best = dict.fromkeys(timed, float("inf"))
        names = list(timed)
        for round_ in range(repeats):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                started = time.perf_counter()
                timed[name]()
                best[name] = min(best[name], (time.perf_counter() - started) / (size // 4) * 1e9)
    return best


def render(best: dict[str, dict[str, float]]) -> str:
    names = list(dict.fromkeys(n for row in best.values() for n in row))
    lines = ["| slab | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for case, row in best.items():
        lines.append(f"| {case} | " + " | ".join(f"{row[n]:.2f} ns" if n in row else "" for n in names) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
