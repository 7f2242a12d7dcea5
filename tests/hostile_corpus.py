"""A corpus of hostile pickles and torch.save archives, shared by tests/test_hostile_inputs.py and
bench/bench_hostile.py. Each is a few bytes to a few MB; none needs torch to build."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile


def su(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else b"X" + struct.pack("<I", len(raw)) + raw


def stack_global(module: str, name: str) -> bytes:
    return su(module) + su(name) + b"\x93"


def call(module: str, name: str, *text_args: str) -> bytes:
    """Protocol 4: ``module.name(*text_args)``."""
    return b"\x80\x04" + stack_global(module, name) + b"(" + b"".join(su(a) for a in text_args) + b"tR."


def torch_zip(
    pickled: bytes,
    extra: tuple[tuple[str, bytes], ...] = (),
    prefix: str = "archive",
    compress: int = zipfile.ZIP_STORED,
) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr(f"{prefix}/data.pkl", pickled, compress_type=compress)
        for name, data in extra:
            archive.writestr(name, data)
        archive.writestr(f"{prefix}/version", b"3\n")
    return buf.getvalue()


def billion_laughs(levels: int = 40) -> list:
    value: list = ["x" * 10]
    for _ in range(levels):
        value = [value] * 10  # 10**40 leaves, a few hundred bytes pickled
    return value


RESOURCE_CASES = {
    "deep tuple as dict key": b"\x80\x02}" + b")" + b"\x85" * 1_000_000 + b"Ns.",
    "deque(range(10**15))": b"\x80\x02ccollections\ndeque\ncbuiltins\nrange\nJ\x00\x00\x00\x00\x8a\x07\x00\x80\xc6"
    b"\xa4~\x8d\x03\x86R\x85R.",
    "bytearray(1.5e9)": b"\x80\x02cbuiltins\nbytearray\nJ\x00\x2f\x68\x59\x85R.",
    "bytes(10**12)": b"\x80\x02cbuiltins\nbytes\n\x8a\x06\x00\x10\xa5\xd4\xe8\x00\x85R.",
    "memo index 2**31": b"\x80\x02Nr\x00\x00\x00\x80.",
    "BUILD on a shared torch function": b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n}X\x04\x00\x00\x00implcbuiltins"
    b"\nlist\nsb.",
    "BUILD on argparse.Namespace": b"\x80\x02cargparse\nNamespace\nN}X\x08\x00\x00\x00__init__cbuiltins\nlist\ns\x86b.",
    "copyreg extension": b"\x80\x02\x82\x01.",
    "_reconstructor of bytes": b"\x80\x02ccopyreg\n_reconstructor\ncargparse\nNamespace\ncbuiltins\nbytes\n"
    b"\x8a\x06\x00\x10\xa5\xd4\xe8\x00\x87R.",
}

DEEP_LISTS = b"\x80\x02" + b"]" * 1_000_000 + b"a" * 999_999 + b"."  # [[[...]]] a million deep


def deflate_bomb(inflated: int = 200 << 20) -> bytes:
    """A torch.save-shaped archive whose data.pkl (a str of ``inflated`` bytes) deflates to well under 1 MB."""
    pickled = b"\x80\x02X" + struct.pack("<I", inflated) + b"a" * inflated + b"."
    return torch_zip(pickled, compress=zipfile.ZIP_DEFLATED)


_COLLIDING = (1 << 61) - 1  # hash(i * _COLLIDING) == 0 for every int i: every key lands in one bucket


def _long1(i: int) -> bytes:
    data = i.to_bytes((i.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def hash_flood_dict(n: int = 100_000) -> bytes:
    """A dict of ``n`` int keys that all hash alike (~1.2 MB): inserting them is quadratic (~40 s here).

    Written opcode by opcode, byte-identical to ``pickle.dumps({...}, protocol=2)`` for n > 1 (SETITEMS batches
    of 1000, an empty last batch when n is a multiple of 1000): building the dict itself would take those ~40 s,
    at every test collection."""
    items = [_long1(i * _COLLIDING) + b"K\x00" for i in range(1, n + 1)]
    batches = b"".join(b"(" + b"".join(items[j : j + 1000]) + b"u" for j in range(0, n + 1, 1000))
    return b"\x80\x02}q\x00" + batches + b"."


def hash_flood_set(n: int = 100_000) -> bytes:
    """``set([...])`` of ``n`` colliding ints through REDUCE: the keys arrive in a list, not by SETITEMS."""
    import pickle

    return (
        b"\x80\x02cbuiltins\nset\n"
        + pickle.dumps([i * _COLLIDING for i in range(1, n + 1)], protocol=2)[2:-1]
        + b"\x85R."
    )


RESOURCE_CASES["hash flood: 100k colliding int dict keys"] = hash_flood_dict()
RESOURCE_CASES["hash flood: set() of 100k colliding ints"] = hash_flood_set()
# Python prints no int of more than 4,300 digits (ValueError): a few KB that would stop every report showing it.
RESOURCE_CASES["int of 10**5000 (LONG4)"] = pickle.dumps(10**5000, protocol=2)
RESOURCE_CASES["int of 5000 digits (protocol 0 LONG)"] = b"L" + b"7" * 5000 + b"L\n."


def colliding_pairs(n: int, small_second: bool = False) -> list[tuple[int, int]]:
    """``n`` distinct pairs of int64 ints >= 0 whose tuple hashes are all equal (CPython 3.11's 64-bit tuple hash,
    solved for one item): chunk offsets that flood any dict keyed by the tuples themselves. ``small_second``: the
    second items are 1, 2, 3... (an interval (offset, size) of a chunk on one axis), else the first."""
    mask, p1, p2, p5 = (1 << 64) - 1, 11400714785074694791, 14029467366897019727, 2870177450012600261

    def rotl(x: int) -> int:
        return ((x << 31) | (x >> 33)) & mask

    def rotr(x: int) -> int:
        return ((x >> 31) | (x << 33)) & mask

    p1_inverse, p2_inverse = pow(p1, -1, 1 << 64), pow(p2, -1, 1 << 64)
    before_last = rotr(((hash((0, 0)) & mask) - (2 ^ (p5 ^ 3527539))) * p1_inverse & mask)
    pairs, free = [], 1
    while len(pairs) < n:
        if small_second:  # solve the first lane
            lane = ((rotr(((before_last - free * p2) & mask) * p1_inverse & mask) - p5) * p2_inverse) & mask
            pair = (lane, free)
        else:  # solve the second lane
            lane = ((before_last - rotl((p5 + free * p2) & mask) * p1) * p2_inverse) & mask
            pair = (free, lane)
        if lane < (1 << 61) - 1:  # hash(lane) == lane
            pairs.append(pair)
        free += 1
    return pairs
