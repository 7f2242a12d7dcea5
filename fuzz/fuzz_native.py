"""Differential fuzzing of the native modules against the pure Python (issue #34 §6; run by scripts/sanitize.sh).

A seeded, structure-aware mutation loop over the fixtures' pickles (every ``.metadata``, and the ``data.pkl`` of
every torch zip such as ``common.pt``): byte flips, truncations, opcode splices, length-field edits, range
deletions and duplications. Each mutant goes to two worker processes, one with the native modules and one with
them blocked (``CKPTDOCTOR_NO_EXTENSIONS=1``), which each answer one line per mutant:

- the resource pre-pass (``ckptdoctor.pickle.scanner.scan``): passes, or the exception class and message;
- where it passes, the faithful read (``unpickler.loads``, memo pruning in C), as a structural dump or the error;
- for ``.metadata`` mutants, the DCP index built from the index-only read (compact records, index_size, the
  index loops in C) and from the faithful read, as the index's items or the error.

Interleaved with the mutants, a fixed share of the time (:data:`HEALTH_SHARE`) goes to ``check --health``'s
per-element loop (``ckptdoctor.values._health``), in this process (under ASan with the rest, in
scripts/sanitize.sh): seeded random slabs of float32, bfloat16 and float16 (1 to 4 dims, blocks at random origins
of a larger slice, strided and transposed views now and then, sizes either side of the histogram threshold; bit
patterns mixing normals of random scale, ±0, subnormals, NaN, ±Inf and random bits), each through
``slab_stats.add_slab`` with the C loop (float32 by either pass), as bytes straight to the C loop
(``slab_stats.add_native``, the call ``HealthScan.scan`` makes for the usual chunk) and with the C loop set aside
(``slab_stats.native = None``); the ``Moments``, or the errors, must be identical.

Any difference, or a worker that dies (a sanitizer report aborts it), fails the run with the mutant saved for
reproduction (a health slab as ``<out>-health.npz``: its bits, dtype, origin and slice shape). A sanitizer report
in the health loop aborts this process: the slabs are a sequence of their own, the same for a given ``--seed``, so
the same command replays them. ``--seconds`` bounds the run (the mutants are the same for a given ``--seed``, their
number depends on the machine's speed).

    python fuzz/fuzz_native.py --seconds 120 --seed 1
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import math
import os
import pickletools
import random
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OPCODE_BYTES = [op.code.encode("latin-1") for op in pickletools.opcodes]
MAX_SEED_BYTES = 400_000


def seeds() -> list[tuple[str, bytes]]:
    """(kind, pickle) of every fixture: "metadata" for a DCP ``.metadata``, "pickle" for a torch zip's data.pkl."""
    out: list[tuple[str, bytes]] = []
    fixtures = ROOT / "fixtures"
    for path in sorted(fixtures.rglob(".metadata")):
        data = path.read_bytes()
        if len(data) <= MAX_SEED_BYTES:
            out.append(("metadata", data))
    for path in sorted(fixtures.rglob("*.pt")):
        try:
            with zipfile.ZipFile(path) as archive:
                for name in archive.namelist():
                    if name.endswith("data.pkl") and archive.getinfo(name).file_size <= MAX_SEED_BYTES:
                        out.append(("pickle", archive.read(name)))
        except zipfile.BadZipFile:
            continue
    return out


def _ops(data: bytes) -> list[tuple[Any, Any, int]]:
    ops = []
    try:
        for op, arg, pos in pickletools.genops(data):
            ops.append((op, arg, pos))
    except Exception:  # noqa: BLE001 - a mutant of a mutant: the opcodes up to the damage
        pass
    return ops


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to three structure-aware edits of ``data``."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        if not buf:
            buf += rng.choice(OPCODE_BYTES)
            continue
        choice = rng.randrange(7)
        at = rng.randrange(len(buf))
        if choice == 0:  # byte flip
            buf[at] ^= 1 << rng.randrange(8)
        elif choice == 1:  # truncation
            del buf[at:]
        elif choice == 2:  # opcode splice: an opcode with a few argument bytes, at an opcode boundary if known
            ops = _ops(bytes(buf))
            if ops:
                at = rng.choice(ops)[2]
            argument = bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 2, 4, 8))))
            buf[at:at] = rng.choice(OPCODE_BYTES) + argument
        elif choice == 3:  # a length field or a memo index edited: the bytes after a length-prefixed opcode
            ops = [o for o in _ops(bytes(buf)) if o[0].arg is not None and o[0].arg.n != 0]
            if ops:
                op, _, pos = rng.choice(ops)
                width = min(abs(op.arg.n) if op.arg.n > 0 else 4, 8)
                value = rng.choice((0, 1, 255, 256, 65535, 1 << 31, (1 << 32) - 1, rng.randrange(1 << 16)))
                field = value.to_bytes(8, "little")[:width]
                buf[pos + 1 : pos + 1 + width] = field
        elif choice == 4:  # a range deleted
            del buf[at : at + rng.randint(1, 64)]
        elif choice == 5:  # a range duplicated (memo writes out of sequence, marks unbalanced, ...)
            piece = buf[at : at + rng.randint(1, 64)]
            buf[at:at] = piece
        else:  # an opcode replaced by another of the same argument kind
            ops = _ops(bytes(buf))
            if ops:
                op, _, pos = rng.choice(ops)
                same = [o for o in pickletools.opcodes if o.arg is op.arg]
                buf[pos] = ord(rng.choice(same).code)
    return bytes(buf)


# --- the worker ------------------------------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    from ckptdoctor.pickle.stand_ins import ALIAS_MODULE  # random per process

    return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}".replace(ALIAS_MODULE, "<alias>")


def _dump(obj: Any, limit: int = 20000) -> str:
    """Types and values, depth first, without object identity (which the native modules may share more); a cycle
    is written as one; at most ``limit`` nodes."""
    out: list[str] = []
    todo: list[tuple[Any, frozenset]] = [(obj, frozenset())]
    while todo and len(out) < limit:
        x, path = todo.pop()
        if isinstance(x, (int, float, complex, bytes, bytearray, str, bool, type(None))):
            out.append(f"{type(x).__qualname__}:{x!r}")
            continue
        if id(x) in path:
            out.append("cycle")
            continue
        path = path | {id(x)}
        if isinstance(x, functools.partial):  # torch.Size as an object: the function inside differs
            out.append("partial")
            continue
        out.append(f"{type(x).__module__}.{type(x).__qualname__}")
        children: list[Any] = []
        if isinstance(x, dict):
            children = [c for kv in x.items() for c in kv]
        elif isinstance(x, (list, tuple)):
            children = list(x)
        elif isinstance(x, (set, frozenset)):
            out.append(str(len(x)))
        state = getattr(x, "__dict__", None)
        if isinstance(state, dict):
            children += [c for kv in state.items() for c in kv]
        out.append(str(len(children)))
        todo.extend((c, path) for c in reversed(children))
    from ckptdoctor.pickle.stand_ins import ALIAS_MODULE  # random per process

    return hashlib.sha256("\n".join(out).replace(ALIAS_MODULE, "<alias>").encode()).hexdigest()[:16]


def outcome(kind: str, data: bytes) -> str:
    from ckptdoctor.formats.dcp_index import DcpItem
    from ckptdoctor.formats.torch_dist import _index_from_object
    from ckptdoctor.pickle import scanner, unpickler
    from ckptdoctor.pickle.stand_ins import ALIAS_MODULE
    from ckptdoctor.pickle.torch_stand_ins import StorageRef

    parts = []
    try:
        scanner.scan(data)
        parts.append("scan ok")
    except Exception as exc:  # noqa: BLE001
        return "scan " + _error(exc)
    faithful: Any = None
    try:
        faithful = unpickler.loads(data, lambda pid: StorageRef(repr(pid)[:40], None, "cpu", 0))
        parts.append("faithful " + _dump(faithful))
    except Exception as exc:  # noqa: BLE001
        parts.append("faithful " + _error(exc))
    if kind == "metadata":
        # the index of both reads (the C loops read index-only records and a faithful read's Records)
        for name, index_only in (("index", True), ("faithful index", False)):
            try:
                if index_only:
                    obj = unpickler.loads(data, lambda pid: StorageRef(repr(pid)[:40], None, "cpu", 0), index_only=True)
                else:
                    obj, faithful = faithful, None
                    if obj is None:
                        continue
                index = _index_from_object(obj, Path("m"), DcpItem, [], consume=index_only)
                del obj
                rows = [(k, i.kind, i.dtype, i.shape, [tuple(c) for c in i.chunks]) for k, i in index.items.items()]
                # a mutant can put a stand-in class where a string belongs: the index holds its text, whose module
                # name is random per process (as in _dump)
                text = repr(rows).replace(ALIAS_MODULE, "<alias>")
                parts.append(f"{name} " + hashlib.sha256(text.encode()).hexdigest()[:16])
            except Exception as exc:  # noqa: BLE001
                parts.append(f"{name} " + _error(exc))
    return " | ".join(parts)


def worker() -> None:
    sys.setrecursionlimit(10000)
    for line in sys.stdin:
        kind, _, encoded = line.rstrip("\n").partition(" ")
        answer = outcome(kind, base64.b64decode(encoded))
        sys.stdout.write(answer.replace("\n", "\\n") + "\n")
        sys.stdout.flush()


# --- check --health's loop, in process ----------------------------------------------------------------------

HEALTH_SHARE = 0.25  # of the run's time, for the health slabs
HEALTH_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")


def health_slab(rng: Any) -> tuple[str, Any, tuple[int, ...], tuple[int, ...]]:
    """(dtype, bits, origin, slice shape) of one random slab; ``rng`` a numpy Generator. The bits may be a
    non-contiguous view."""
    import numpy as np

    from ckptdoctor.values.moments import KINDS

    dtype = HEALTH_DTYPES[int(rng.integers(len(HEALTH_DTYPES)))]
    kind = KINDS[dtype]
    width, fb, top = 8 * kind.itemsize, kind.fraction_bits, (1 << kind.exponent_bits) - 1
    unsigned = np.dtype(f"<u{kind.itemsize}")
    ndim = int(rng.choice([0, 1, 2, 2, 3, 4]))
    budget = int(rng.choice([16, 600, 5000, 20000, 200000], p=[0.25, 0.3, 0.3, 0.13, 0.02]))
    block: list[int] = []
    for d in range(ndim):
        room = max(1, budget // max(1, math.prod(block)))
        block.append(
            int(rng.integers(1, min(room, 9000) + 1)) if d == ndim - 1 else int(rng.integers(1, min(room, 40) + 1))
        )
    block_shape = tuple(block)
    n = math.prod(block_shape)
    # one bit pattern source per element: normals of a random scale, ±0, subnormals, NaN and ±Inf, random bits
    sign = rng.integers(0, 2, size=n, dtype=np.uint64) << np.uint64(width - 1)
    scaled = rng.normal(size=n) * 10.0 ** rng.uniform(-40, 40)
    with np.errstate(over="ignore"):  # beyond the dtype's range: ±Inf
        if kind.itemsize == 2 and kind.exponent_bits == 5:
            normals = scaled.astype(np.float16).view(np.uint16).astype(np.uint64)
        else:
            normals = scaled.astype(np.float32).view(np.uint32).astype(np.uint64)
            if kind.itemsize == 2:  # bfloat16: the upper half
                normals >>= np.uint64(16)
    fraction = rng.integers(0, 1 << fb, size=n, dtype=np.uint64)
    sources = [
        normals,
        sign,
        sign | (fraction >> np.uint64(rng.integers(0, fb))),  # subnormals (and zeros), small ones in the zero bins
        sign | np.uint64(top << fb) | (fraction * rng.integers(0, 2, size=n, dtype=np.uint64)),  # NaN and ±Inf
        rng.integers(0, 1 << width, size=n, dtype=np.uint64),
    ]
    weights = rng.dirichlet(np.full(len(sources), 0.4))
    pick = rng.choice(len(sources), size=n, p=weights)
    flat = np.choose(pick, sources).astype(unsigned)
    view = rng.random()
    if ndim >= 2 and view < 0.15:  # a transposed view of the last two axes
        bits = np.swapaxes(flat.reshape(block_shape[:-2] + block_shape[::-1][:2]), -1, -2)
    elif ndim >= 1 and view < 0.3:  # every other element of a larger array
        bits = np.repeat(flat, 2).reshape(block_shape[:-1] + (2 * block_shape[-1],))[..., ::2]
    else:
        bits = flat.reshape(block_shape)
    shape = tuple(b + int(rng.integers(0, 5)) for b in bits.shape)
    origin = tuple(int(rng.integers(0, s - b + 1)) for s, b in zip(shape, bits.shape))
    return dtype, bits, origin, shape


# C: float32 by its vectorised pass where it runs; portable: by the other; direct: a slab HealthScan.scan hands to the
# C loop as bytes (a run of the slice's elements, or rows of a 2-d slice) through slab_stats.add_native, else as C
HEALTH_PATHS = ("C", "C portable", "C direct", "numpy")


def health_outcome(dtype: str, bits: Any, origin: tuple[int, ...], shape: tuple[int, ...], path: str) -> str:
    """One slab through ``slab_stats.add_slab`` by one of :data:`HEALTH_PATHS`: the Moments (floats by repr), or the
    error."""
    import types

    import numpy as np

    from ckptdoctor.values import slab_stats
    from ckptdoctor.values.moments import KINDS, Moments

    saved = slab_stats.native
    if path == "numpy":
        slab_stats.native = None
    elif path == "C portable" and saved is not None:
        slab_stats.native = types.SimpleNamespace(floats=lambda *args: saved.floats(*args, True))
    try:
        m = Moments()
        kind = KINDS[dtype]
        consecutive = bits.shape[1:] == tuple(shape[1:])
        if path == "C direct" and saved is not None and bits.size and bits.ndim and (consecutive or len(shape) == 2):
            m.count += bits.size
            columns = bits.size if consecutive else bits.shape[-1]
            slab_stats.add_native(kind, m, np.ascontiguousarray(bits).tobytes(), bits.size, columns, origin, shape)
        else:
            slab_stats.add_slab(np, kind, m, bits, origin, shape)
        fields = (m.count, m.finite, m.zeros, m.nan, m.inf, m.total, m.total_sq, m.low, m.high, m.fingerprint)
        return repr(fields)
    except Exception as exc:  # noqa: BLE001 - an error is an outcome to compare
        return f"{type(exc).__name__}: {exc}"
    finally:
        slab_stats.native = saved


def health_round(rng: Any, count: int, out: Path) -> bool:
    """One random slab through both paths; False (the slab saved to ``out``) where they differ."""
    import numpy as np

    dtype, bits, origin, shape = health_slab(rng)
    answers = [health_outcome(dtype, bits, origin, shape, path) for path in HEALTH_PATHS]
    if len(set(answers)) == 1:
        return True
    np.savez(
        out, bits=bits, dtype=dtype, origin=np.array(origin, dtype=np.int64), shape=np.array(shape, dtype=np.int64)
    )
    print(
        f"fuzz_native: the health paths differ on slab {count} ({dtype}, {bits.shape} at {origin} of {shape},"
        f" saved to {out}):"
    )
    for path, answer in zip(HEALTH_PATHS, answers):
        print(f"  {path}: {answer[:400]}")
    return False


# --- the parent ------------------------------------------------------------------------------------------


def _start(native: bool) -> subprocess.Popen:
    env = dict(os.environ)
    if native:
        env.pop("CKPTDOCTOR_NO_EXTENSIONS", None)
    else:
        env["CKPTDOCTOR_NO_EXTENSIONS"] = "1"
    return subprocess.Popen(
        [sys.executable, __file__, "--worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="stop after this long (default 120)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("fuzz-failure.bin"), help="where a failing mutant is saved")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    o = p.parse_args(argv)
    if o.worker:
        worker()
        return 0
    corpus = seeds()
    if not corpus:
        print("fuzz_native: no seeds under fixtures/", file=sys.stderr)
        return 2
    rng = random.Random(o.seed)
    native, python = _start(True), _start(False)
    check = subprocess.run(
        [sys.executable, "-c", "import ckptdoctor.pickle._native, ckptdoctor.formats.dcp_index as d; print(1)"],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        print(f"fuzz_native: the native modules do not import:\n{check.stderr}", file=sys.stderr)
        return 2
    import numpy as np

    from ckptdoctor.values import slab_stats

    if slab_stats.native is None:
        print(
            "fuzz_native: ckptdoctor.values._health does not import (built? CKPTDOCTOR_NO_EXTENSIONS?)", file=sys.stderr
        )
        return 2
    health_rng = np.random.default_rng(o.seed)
    health_out = o.out.with_name(o.out.stem + "-health.npz")
    health_seconds = 0.0
    slabs = 0
    started = time.monotonic()
    deadline = time.monotonic() + o.seconds
    count = differences = 0
    try:
        while time.monotonic() < deadline:
            kind, seed = rng.choice(corpus)
            mutant = mutate(seed, rng) if count % 8 else seed  # the seeds themselves now and then
            line = f"{kind} {base64.b64encode(mutant).decode()}\n"
            answers = []
            for proc in (native, python):
                assert proc.stdin is not None
                proc.stdin.write(line)
                proc.stdin.flush()
            for name, proc in (("native", native), ("python", python)):
                assert proc.stdout is not None
                answer = proc.stdout.readline()
                if not answer:
                    o.out.write_bytes(mutant)
                    died = f"the {name} worker died (exit {proc.wait()})"
                    print(f"fuzz_native: {died} on mutant {count}, saved to {o.out}")
                    return 1
                answers.append(answer.rstrip("\n"))
            if answers[0] != answers[1]:
                differences += 1
                o.out.write_bytes(mutant)
                print(f"fuzz_native: C and Python differ on mutant {count} ({kind}, saved to {o.out}):")
                print(f"  native: {answers[0][:400]}\n  python: {answers[1][:400]}")
                return 1
            count += 1
            while health_seconds < HEALTH_SHARE * (time.monotonic() - started):  # the health loop's share
                at = time.monotonic()
                if not health_round(health_rng, slabs, health_out):
                    return 1
                slabs += 1
                health_seconds += time.monotonic() - at
    finally:
        for proc in (native, python):
            if proc.poll() is None:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait()
    print(
        f"fuzz_native: {count} mutants of {len(corpus)} seeds and {slabs} health slabs, C and Python alike "
        f"({o.seconds:.0f} s, seed {o.seed})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
