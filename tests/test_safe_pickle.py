"""The safe unpickler: refuses code execution, keeps unknown classes as inert, round-trippable stand-ins."""

from __future__ import annotations

import argparse
import io
import pickle
import subprocess
import sys

import pytest

from ckptdoctor.errors import UnsafePickleError
from ckptdoctor.pickle import unpickler
from ckptdoctor.pickle.limits import current_limits
from ckptdoctor.pickle.stand_ins import StandIn
from ckptdoctor.pickle.torch_stand_ins import DtypeRef, Size


class _Reduce:
    """An object whose pickle calls ``func(*args)`` on load: the classic pickle exploit."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _malicious_payloads(marker):
    import builtins
    import os

    touch = f"open({str(marker)!r}, 'w').write('pwned')"
    return {
        "os.system": pickle.dumps(_Reduce(os.system, (f"touch {marker}",))),
        "builtins.eval": pickle.dumps(_Reduce(builtins.eval, (touch,))),
        "builtins.exec": pickle.dumps(_Reduce(builtins.exec, (touch,))),
        "subprocess.Popen": pickle.dumps(_Reduce(subprocess.Popen, (["touch", str(marker)],))),
        "builtins.getattr": b"cbuiltins\ngetattr\n(cbuiltins\nstr\nS'join'\ntR.",
        "builtins.__import__": pickle.dumps(_Reduce(builtins.__import__, ("os",))),
        "posix.system (protocol 0)": f"cposix\nsystem\n(S'touch {marker}'\ntR.".encode(),
        "__builtin__.eval (py2 name)": f'c__builtin__\neval\n(S"{touch}"\ntR.'.encode(),
    }


@pytest.mark.parametrize("name", list(_malicious_payloads("/x")))
def test_malicious_pickle_is_refused_and_never_executed(tmp_path, name):
    marker = tmp_path / "marker"
    data = _malicious_payloads(marker)[name]
    with pytest.raises(UnsafePickleError) as info:
        unpickler.loads(data)
    assert "not on the allowlist" in str(info.value)
    assert not marker.exists()


def test_codecs_encode_only_allows_text_codecs():
    # protocol-2 bytes: _codecs.encode(text, "latin1") is allowed; other codecs are refused
    assert unpickler.loads(pickle.dumps(b"\x00\xffab", protocol=2)) == b"\x00\xffab"
    with pytest.raises(UnsafePickleError):
        unpickler.loads(b"c_codecs\nencode\n(S'abc'\nS'zlib_codec'\ntR.")


def test_plain_data_resolves_to_real_objects():
    obj = {"ns": argparse.Namespace(a=1, b=[1, 2]), "t": (1.5, None), "s": {1, 2}}
    assert unpickler.loads(pickle.dumps(obj)) == obj


def test_unknown_third_party_class_becomes_inert_stand_in():
    data = b"cmegatron.core.enums\nModelType\n(I1\ntR."
    value = unpickler.loads(data)
    assert isinstance(value, StandIn)
    assert type(value).qualified_name() == "megatron.core.enums.ModelType"
    assert value.stand_in_args == (1,)
    # pickles back to the same global reference and arguments
    again = unpickler.loads(unpickler.dumps(value))
    assert again == value
    assert b"megatron.core.enums\nModelType" in unpickler.dumps(value)


def test_stand_in_calls_record_arguments_only(tmp_path):
    # An unlisted name of a tolerated namespace is read as an inert stand-in (and reported), never called.
    marker = tmp_path / "marker"
    data = f'cmegatron.training.utils\nrunstring\n(S\'open("{marker}","w")\'\n(dtR.'.encode()
    unlisted: list[str] = []
    value = unpickler.loads(data, unlisted=unlisted)
    assert isinstance(value, StandIn) and not marker.exists()
    assert [(u.name, u.calls, u.trusted) for u in unlisted] == [("megatron.training.utils.runstring", 1, False)]


def test_unlisted_numpy_callable_is_refused(tmp_path):
    marker = tmp_path / "marker"
    data = f'cnumpy.testing._private.utils\nrunstring\n(S\'open("{marker}","w")\'\n(dtR.'.encode()
    with pytest.raises(UnsafePickleError, match="numpy.testing._private.utils.runstring"):
        unpickler.loads(data)
    assert not marker.exists()


def test_torch_names_map_to_light_stand_ins():
    assert unpickler.loads(b"ctorch\nbfloat16\n.") is DtypeRef.get("bfloat16")
    size = unpickler.loads(b"ctorch\nSize\n((I2\nI3\nttR.")
    assert isinstance(size, Size) and size == (2, 3)
    assert b"torch\nSize" in unpickler.dumps(size)


def test_reading_never_imports_torch_or_megatron():
    code = (
        "import sys, pickle\n"
        "from ckptdoctor.pickle import unpickler\n"
        "unpickler.loads(b'cmegatron.core.enums\\nModelType\\n(I1\\ntR.')\n"
        "unpickler.loads(b'ctorch\\nfloat32\\n.')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.mcore
def test_mcore_metadata_pickles_read_without_megatron(tmp_path):
    """.metadata of core 0.11-0.15 pickles MCoreSavePlan / MCoreMetadata; build one and read it."""
    torch = pytest.importorskip("torch")
    script = tmp_path / "make.py"
    script.write_text(
        "import sys, types, pickle, torch\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint.metadata import Metadata\n"
        "from torch.distributed.checkpoint.planner import SavePlan\n"
        "name = 'megatron.core.dist_checkpointing.strategies.torch'\n"
        "for part in ('megatron', 'megatron.core', 'megatron.core.dist_checkpointing',\n"
        "             'megatron.core.dist_checkpointing.strategies', name):\n"
        "    sys.modules[part] = types.ModuleType(part)\n"
        "mod = sys.modules[name]\n"
        "class MCoreMetadata(Metadata):\n"
        "    pass\n"
        "class MCoreSavePlan(SavePlan):\n"
        "    pass\n"
        "for cls in (MCoreMetadata, MCoreSavePlan):\n"
        "    cls.__module__ = name; setattr(mod, cls.__name__, cls)\n"
        "dcp.save({'w': torch.ones(4, 2)}, checkpoint_id=sys.argv[1], no_dist=True)\n"
        "with open(sys.argv[1] + '/.metadata', 'rb') as f:\n"
        "    md = pickle.load(f)\n"
        "new = MCoreMetadata(state_dict_metadata=md.state_dict_metadata, planner_data=md.planner_data,\n"
        "                    storage_data=md.storage_data, storage_meta=md.storage_meta)\n"
        "new.all_local_plans = [MCoreSavePlan(items=[])]\n"
        "new.mcore_data = {'w': {'nd_reformulated_orig_global_shape': None}}\n"
        "with open(sys.argv[1] + '/.metadata', 'wb') as f:\n"
        "    pickle.dump(new, f)\n"
    )
    out_dir = tmp_path / "ckpt"
    subprocess.run([sys.executable, str(script), str(out_dir)], check=True, capture_output=True)
    from ckptdoctor.formats.torch_dist import read_metadata

    data = (out_dir / ".metadata").read_bytes()
    assert b"MCoreMetadata" in data and b"MCoreSavePlan" in data
    index = read_metadata(out_dir / ".metadata")
    assert index.metadata_class.endswith("strategies.torch.MCoreMetadata")
    assert index.items["w"].shape == (4, 2) and index.items["w"].dtype == "torch.float32"
    assert index.items["w"].chunks[0].storage is not None
    assert "all_local_plans" in index.extra and "mcore_data" in index.extra
    del torch


def test_garbage_pickle_gives_clean_error(tmp_path):
    from ckptdoctor.errors import CkptError
    from ckptdoctor.formats.torch_dist import read_metadata

    bad = tmp_path / ".metadata"
    bad.write_bytes(b"\x80\x04garbage that is not a pickle")
    with pytest.raises(CkptError, match=r"\.metadata: corrupt DCP metadata"):
        read_metadata(bad)
    bad.write_bytes(pickle.dumps({"a": 1})[:-3])
    with pytest.raises(CkptError, match="corrupt DCP metadata"):
        read_metadata(bad)
    bad.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CkptError, match="not a PyTorch DCP Metadata"):
        read_metadata(bad)


def test_bytesio_round_trip():
    value = unpickler.loads(pickle.dumps(io.BytesIO(b"abc"), protocol=2))
    assert isinstance(value, io.BytesIO) and value.getvalue() == b"abc"


# --- hash flooding and key counts (scanner with policy.hash_safe_global) --------------------------


def _short_str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _dict_pickle(n: int, key: bytes) -> bytes:
    """A protocol-4 dict of ``n`` int values under keys made by the opcodes ``key`` (``%d`` -> the index);
    memo 0/1 hold the DCP MetadataIndex class and torch.Size."""
    import struct

    out = bytearray(b"\x80\x04")
    out += _short_str("torch.distributed.checkpoint.metadata") + _short_str("MetadataIndex") + b"\x93\x94"
    out += _short_str("torch") + _short_str("Size") + b"\x93\x94"
    out += b"}("
    for i in range(n):
        out += key.replace(b"%d", struct.pack("<i", i)) + b"J" + struct.pack("<i", i)
    out += b"u."
    return bytes(out)


_METADATA_INDEX_KEY = b"h\x00)\x81}" + _short_str("fqn") + _short_str("layer") + b"sb"  # MetadataIndex(fqn=...)
_SIZE_KEY = b"h\x01J%d\x85\x85R"  # torch.Size((i,))


def test_a_checkpoint_with_more_chunks_than_the_flood_limit_reads():
    # DCP's storage_data has one MetadataIndex key per chunk: a 200k-chunk checkpoint is legitimate (stand-ins
    # hash by identity, so they cannot be made to collide); it was refused as "hash flooding".
    limit = current_limits().max_hashed_keys
    loaded = unpickler.loads(_dict_pickle(limit + 10_000, _METADATA_INDEX_KEY))
    assert len(loaded) == limit + 10_000 and type(next(iter(loaded))).__name__ == "MetadataIndex"


def test_torch_size_keys_count_as_tuples_for_the_flood_limit():
    from ckptdoctor.errors import PickleLimitError

    limit = current_limits().max_hashed_keys
    assert len(unpickler.loads(_dict_pickle(1000, _SIZE_KEY))) == 1000
    with pytest.raises(PickleLimitError, match="hash flooding"):
        unpickler.loads(_dict_pickle(limit + 1, _SIZE_KEY))


def test_torch_size_nested_through_newobj_ex_is_bounded():
    # NEWOBJ_EX(torch.Size, (inner,), {}) nested 1M deep, then used as a dict key: hashing it recurses in C
    # (a crash). The scanner used to forget the depth of what NEWOBJ_EX builds; a child keeps a crash out of
    # pytest. Stack: a dict, 1M Size classes, the innermost int; each level: TUPLE1 twice (Size((inner,))),
    # {}, NEWOBJ_EX.
    levels = 1_000_000  # 100k deep still fits the C stack; 1M crashed (SIGSEGV) before the fix
    ops = b"\x80\x04" + _short_str("torch") + _short_str("Size") + b"\x93\x94" + b"}"
    ops += b"h\x00" * levels + b"K\x01" + b"\x85\x85}\x92" * levels + b"Ns."
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from ckptdoctor.pickle import unpickler; unpickler.loads(sys.stdin.buffer.read())",
        ],
        input=ops,
        capture_output=True,
    )
    assert proc.returncode == 1 and b"PickleLimitError: tuples nest deeper than" in proc.stderr, proc.stderr[-300:]


# --- torch.Size and the index-only reading --------------------------------------------------------------


def _nested_sizes(depth: int) -> bytes:
    """``torch.Size([torch.Size([... torch.Size(()) ...])])``: tuples built from lists hide their nesting."""
    return b"\x80\x02ctorch\nSize\nq\x00" + b"h\x00]" * depth + b"h\x00)\x85R" + b"a\x85R" * depth + b"."


@pytest.mark.parametrize("index_only", [False, True])
def test_size_of_a_list_is_refused_not_a_crash(index_only):
    """A ``Size`` of a list holding a ``Size`` of a list ... (1.2 MB) crashed the interpreter when hashed."""
    code = (
        "import sys\nfrom ckptdoctor.pickle import unpickler\n"
        f"data = sys.stdin.buffer.read()\n"
        "try:\n"
        f"    hash(unpickler.loads(data, index_only={index_only}))\n"
        "except TypeError as exc:\n"
        "    print('refused', exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], input=_nested_sizes(300_000), capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith(b"refused"), (proc.returncode, proc.stderr[-500:])


def test_size_of_a_tuple_reads_in_both_readings():
    data = unpickler.dumps(Size((2, 3)))
    assert unpickler.loads(data) == (2, 3) and type(unpickler.loads(data)) is Size
    assert type(unpickler.loads(data, index_only=True)) is tuple
    assert unpickler.loads(data, index_only=True) == (2, 3)


def test_index_only_reading_keeps_the_allowlist_and_limits(tmp_path):
    """The index-only reading changes what DCP records and ``torch.Size`` build, nothing of what is refused."""
    from ckptdoctor.pickle.index_records import IndexRecord, index_record_fields

    marker = tmp_path / "pwned"
    for name, payload in _malicious_payloads(marker).items():
        with pytest.raises(UnsafePickleError):
            unpickler.loads(payload, index_only=True)
        assert not marker.exists(), name
    record = (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadataIndex\nq\x00)\x81q\x01}q\x02"
        b"(X\x03\x00\x00\x00fqnq\x03X\x01\x00\x00\x00wq\x04ub."
    )
    faithful, lean = unpickler.loads(record), unpickler.loads(record, index_only=True)
    assert faithful.__dict__ == {"fqn": "w"}
    assert isinstance(lean, IndexRecord) and index_record_fields(lean) == {"fqn": "w"}
    assert hash(lean) == object.__hash__(lean) and lean != unpickler.loads(record, index_only=True)
