"""Time the CRC-32 that ``check --deep`` runs over every record (``ckptdoctor.formats.crc``), in ns a byte.

zlib.crc32 (what runs without the C extension) against the C module's folds (``_crc32.crc32(data, 0, widest)``:
1, 128-bit registers with PCLMULQDQ; 2, 512-bit ones with VPCLMULQDQ, where the processor has them) and its byte
table (0), over random bytes: a 16 MiB buffer (a large chunk just read: in the caches) and a 256 MiB one (from
memory). All in this process, alternating per round; each timing repeats the buffer to about 1 GiB and keeps the
best of ``--repeats`` rounds (the code's own speed, the machine's noise left out).

    python bench/bench_crc.py        # -> bench/results/crc.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (no torch)

BUFFERS = {"16 MiB (cached)": 16 << 20, "256 MiB (memory)": 256 << 20}
TOTAL = 1 << 30  # bytes per timing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_options(p)
    p.add_argument("--repeats", type=int, default=7)
    o = p.parse_args(argv)
    harness.use_code(o.code)
    harness.build_extension(harness.CODE)
    sys.path.insert(0, str(harness.CODE))
    from ckptdoctor.formats import crc

    if crc.native_crc32 is None:
        raise SystemExit("ckptdoctor.formats._crc32 was not built (no C compiler?)")
    native = crc.native_crc32
    ways = {"zlib.crc32": lambda data: zlib.crc32(data)}
    for widest, name in ((0, "C byte table"), (1, "C 128-bit fold"), (2, "C 512-bit fold")):
        if widest <= crc.FOLDS:
            ways[name] = lambda data, widest=widest: native(data, 0, widest)
    recorder = harness.Recorder("crc", argv)
    best: dict[str, dict[str, float]] = {b: {w: float("inf") for w in ways} for b in BUFFERS}
    for label, size in BUFFERS.items():
        data = os.urandom(size)
        expected = zlib.crc32(data)
        for way in ways.values():
            assert way(data) == expected
        reps = max(1, TOTAL // size)
        for _ in range(o.repeats):
            for name, way in ways.items():
                start = time.perf_counter()
                for _ in range(reps):
                    way(data)
                best[label][name] = min(best[label][name], (time.perf_counter() - start) / (reps * size) * 1e9)
    payload = {"ns_per_byte": best, "in_use": crc.implementation(), "cache": "buffers in this process's memory"}
    doc = recorder.write(payload)
    print(harness.header(json.loads(doc.read_text())) + "\n")
    print("| bytes | " + " | ".join(ways) + " |")
    print("|---|" + "---|" * len(ways))
    for label in BUFFERS:
        print(f"| {label} | " + " | ".join(f"{best[label][w]:.3f} ns" for w in ways) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
