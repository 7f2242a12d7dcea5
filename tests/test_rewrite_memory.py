"""The rewrite commands let the source's ``.metadata`` stand-ins go once the new pickle exists (issue #16 §1):
the read-back check of the new pickle runs without them, and the bytes are those ``dumps`` writes."""

from __future__ import annotations

import re
import weakref

import pytest
from conftest import FIXTURES

from ckptdoctor.checkpoint import HeldMetadata
from ckptdoctor.cli import main
from ckptdoctor.formats import torch_dist
from ckptdoctor.pickle import unpickler

SOURCE = FIXTURES / "core019_peft_full_tp1"
METADATA = SOURCE / "iter_0000010" / ".metadata"


def test_dumps_taken_writes_what_dumps_writes_and_lets_the_object_go():
    expected = unpickler.dumps(torch_dist.load_metadata_object(METADATA))
    held = [torch_dist.load_metadata_object(METADATA)]
    gone = weakref.ref(held[0])
    assert unpickler.dumps_taken(held) == expected
    assert held == []
    assert gone() is None  # freed by its reference count alone (the CLI pauses the cyclic GC)


def test_dumps_taken_needs_one_object():
    with pytest.raises(ValueError):
        unpickler.dumps_taken([])


def test_held_metadata_is_taken_once():
    held = HeldMetadata({"state_dict_metadata": {}})
    assert held.take() == {"state_dict_metadata": {}}
    with pytest.raises(ValueError):
        held.take()


@pytest.mark.parametrize("between", [b"", b"x" * 5, b"c" + b"\n" * 3])
def test_dealiased_is_the_substitution(between):
    alias, target = next(iter(unpickler.ALIAS_TARGETS.items()))
    aliased = b"c" + unpickler.ALIAS_MODULE.encode() + b"\n" + alias + b"\n"
    raw = b"\x80\x02" + aliased + between + aliased + b"q\x00" + between + b"."
    expected = re.sub(re.escape(aliased), b"c" + target, raw)
    assert unpickler._dealiased(raw) == expected
    assert unpickler._dealiased(b"\x80\x02N.") == b"\x80\x02N."


@pytest.mark.parametrize(
    "command",
    [
        ["strip-frozen", "--force"],
        ["edit", "--remove", r"^optimizer\."],
        ["edit", "--compact", "--drop-extra-state"],
        ["edit", "--rename", r"^decoder\.final_layernorm\.", "decoder.final_norm."],
    ],
)
def test_read_back_runs_without_the_source_object(monkeypatch, tmp_path, capsys, command):
    """The source's objects (read with the index, in one pass) are gone when the new pickle is read back."""
    taken: list[weakref.ref] = []
    alive_at_check: list[bool] = []  # at each read-back of a .metadata pickle (not of the common state's)
    checking: list[bool] = []
    take, load, dumps_taken, verify = (
        HeldMetadata.take,
        torch_dist.load_metadata_object,
        unpickler.dumps_taken,
        unpickler._verify_written,
    )

    def recording_take(self):
        metadata = take(self)
        taken.append(weakref.ref(metadata))
        return metadata

    def recording_load(path):
        metadata = load(path)
        taken.append(weakref.ref(metadata))
        return metadata

    def recording_dumps_taken(held):
        checking.append(True)
        try:
            return dumps_taken(held)
        finally:
            checking.pop()

    def recording_verify(data):
        if checking:
            alive_at_check.extend(ref() is not None for ref in taken)
        return verify(data)

    monkeypatch.setattr(HeldMetadata, "take", recording_take)
    monkeypatch.setattr(torch_dist, "load_metadata_object", recording_load)
    monkeypatch.setattr(unpickler, "dumps_taken", recording_dumps_taken)
    monkeypatch.setattr(unpickler, "_verify_written", recording_verify)
    rc = main([command[0], str(SOURCE), *command[1:], "--output", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    assert len(taken) == 1
    assert alive_at_check and not any(alive_at_check)
