"""Transformer Engine 2.x extra state: ``pickle.dumps(state)`` in a uint8 tensor, which TE's ``set_extra_state``
reads back with ``pickle.loads``. A real FP8 state holds tensors, which plain pickle writes as
``torch.storage._load_from_bytes(<a legacy torch save>)``: the payload and every nested save are what a real load
of the model runs, so ``check --deep`` and the write gate read them all. The payloads here are made by real
torch (``pickle.dumps`` of real tensors, ``torch.save`` of the uint8 tensor), as TE makes them."""

from __future__ import annotations

import io
import pickle

import pytest
from conftest import run_ckptdoctor
from test_hostile_inputs import check_json, codes, run_limited
from test_hostile_round2 import _point_item_at

from ckptdoctor.checkpoint import decode_object_bytes
from ckptdoctor.errors import UnsafePickleError
from ckptdoctor.formats.archive import ArchiveError
from ckptdoctor.formats.legacy_torch import LEGACY_MAGIC

torch = pytest.importorskip("torch")
KEY = "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"  # an _extra_state item of core019_tp1


class _Reduce:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


LOADERS = [("torch.storage", "_load_from_bytes"), ("megatron.core.safe_globals", "safe_load_from_bytes")]


@pytest.fixture(params=LOADERS, ids=["torch", "megatron"])
def storage_loader(request, monkeypatch):
    """The function plain pickle names for a torch storage: torch's ``_load_from_bytes``, or megatron-core's
    ``safe_load_from_bytes``, which megatron-core's ``__init__`` puts in its place (so a payload made in a
    training process names that one). Set explicitly: whether this process imported megatron must not matter."""
    import sys
    import types

    module_name, name = request.param

    def loader(data):  # never called: the tests only pickle
        raise AssertionError("loaded")

    loader.__module__, loader.__qualname__, loader.__name__ = module_name, name, name
    # pickle names a function by the module and name it finds it under: there (torch.storage is imported)
    monkeypatch.setitem(sys.modules, module_name, sys.modules.get(module_name) or types.ModuleType(module_name))
    monkeypatch.setattr(sys.modules[module_name], name, loader, raising=False)
    monkeypatch.setattr(torch.storage, "_load_from_bytes", loader)  # what TypedStorage.__reduce__ returns
    return loader


def _item(state) -> bytes:
    """The bytes item Megatron saves for TE 2.x extra state: torch.save of the uint8 tensor of pickle.dumps."""
    payload = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def _fp8_state() -> dict:
    """What TE 2.x pickles for a module trained in FP8 (delayed scaling), with CPU tensors."""
    return {
        "scale_fwd": torch.ones(3),
        "amax_history_fwd": torch.zeros(16, 3),
        "scale_bwd": torch.ones(2),
        "amax_history_bwd": torch.zeros(16, 2),
        "extra_fp8_variables": {"num_gemms": 1, "global_fp8_buffer_pos_fwd": 0},
    }


def _legacy_save_running(command: list[str]) -> bytes:
    """A legacy-format torch save (five pickles) whose object pickle runs ``command``."""
    import subprocess

    parts = [LEGACY_MAGIC, 1001, {"protocol_version": 1001, "little_endian": True}]
    return b"".join(pickle.dumps(p, protocol=2) for p in parts) + (
        pickle.dumps(_Reduce(subprocess.call, (command,)), protocol=2) + pickle.dumps([], protocol=2)
    )


def test_a_real_fp8_state_passes_and_its_nested_saves_are_read(storage_loader):
    unlisted: list[str] = []
    item = _item(_fp8_state())
    assert storage_loader.__qualname__.encode() in item  # the payload names the loader under test
    obj = decode_object_bytes(item, "item", unlisted)
    assert obj.dtype.name == "uint8" and obj.numel > 0 and unlisted == []


def test_an_empty_extra_state_is_not_read_as_a_pickle():
    buf = io.BytesIO()
    torch.save(torch.empty(0, dtype=torch.uint8), buf)  # TE without FP8
    assert decode_object_bytes(buf.getvalue(), "item").numel == 0


def test_a_payload_naming_code_is_refused(tmp_path):
    with pytest.raises(UnsafePickleError, match="posix.system|os.system"):
        decode_object_bytes(_item(_Reduce(__import__("os").system, (f"touch {tmp_path / 'x'}",))), "item")


def test_a_nested_save_naming_code_is_refused(tmp_path, storage_loader):
    marker = tmp_path / "marker"
    nested = _Reduce(storage_loader, (_legacy_save_running(["touch", str(marker)]),))
    with pytest.raises(UnsafePickleError, match="subprocess.call"):
        decode_object_bytes(_item({"scale_fwd": nested}), "item")
    assert not marker.exists()


@pytest.mark.parametrize(
    "nested", [b"\x80\x02K\x01.", pickle.dumps(123, protocol=2) + b"garbage", b""], ids=["magic", "cut", "empty"]
)
def test_a_nested_save_that_is_none_is_an_archive_anomaly(nested, storage_loader):
    with pytest.raises(ArchiveError):
        decode_object_bytes(_item({"s": _Reduce(storage_loader, (nested,))}), "item")


def test_a_payload_that_is_no_pickle_is_an_archive_anomaly():
    buf = io.BytesIO()
    torch.save(torch.frombuffer(bytearray(b"\x00\x01garbage"), dtype=torch.uint8), buf)
    with pytest.raises(ArchiveError, match="no pickle"):
        decode_object_bytes(buf.getvalue(), "item")


def test_check_deep_and_the_write_gate_read_the_extra_state_pickle(copy_fixture, tmp_path, storage_loader):
    """check --deep passed an _extra_state item whose uint8 payload names code (TE unpickles it on load), and
    write commands carried it; a real FP8 state passes both."""
    marker = tmp_path / "marker"
    save = copy_fixture("core019_tp1")
    _point_item_at(save, KEY, _item(_fp8_state()))
    assert "CKD401" not in codes(check_json(save, deep=True)[1])
    assert run_ckptdoctor("edit", str(save), "--rename", "final", "FINAL", "-o", str(tmp_path / "ok")).returncode == 0
    _point_item_at(save, KEY, _item({"scale_fwd": _Reduce(__import__("os").system, (f"touch {marker}",))}))
    assert "CKD401" in codes(check_json(save, deep=True)[1])
    proc = run_limited("edit", save, "--rename", "final", "FINAL", "-o", tmp_path / "out")
    assert proc.returncode != 0 and KEY in proc.stderr
    assert not (tmp_path / "out").exists() and not marker.exists()


@pytest.mark.parametrize("storage_loader", [LOADERS[0]], indirect=True, ids=["torch"])
def test_load_from_bytes_stays_refused_outside_an_extra_state_payload(storage_loader):
    """Torch's own loader runs torch.load(weights_only=False): refused anywhere else. (megatron-core's
    replacement loads with weights_only=True; outside a payload it is read as a tolerated megatron name.)"""
    from ckptdoctor.pickle import unpickler

    with pytest.raises(UnsafePickleError, match="load_from_bytes"):
        unpickler.loads(pickle.dumps({"t": torch.ones(2)}))


def test_a_payload_of_many_megabytes_is_refused_before_it_is_unpickled():
    """A real FP8 state is tens of KB; unpickling one-byte opcodes costs ~60 bytes each (EMPTY_LIST: a list)."""
    from ckptdoctor.errors import PickleLimitError
    from ckptdoctor.formats.legacy_torch import MAX_PAYLOAD

    payload = torch.full((MAX_PAYLOAD + 1,), ord("]"), dtype=torch.uint8)
    buf = io.BytesIO()
    torch.save(payload, buf)
    with pytest.raises(PickleLimitError, match="exceeds the limit"):
        decode_object_bytes(buf.getvalue(), "item")
