"""strip-frozen gates what its output carries, as edit does (issue #35 item 13): an unsafe pickle in an item it
drops anyway (a model ``_extra_state``) does not stop it; one in an item it keeps does."""

from __future__ import annotations

import json
import shutil

from conftest import FIXTURES, file_digests
from gadget_corpus import _te_extra_state, call, glob, replace_item, s

from ckptdoctor.cli import main

ITER = "iter_0000010"


def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_an_unsafe_item_it_drops_does_not_stop_it(capsys, tmp_path):
    save = tmp_path / "src"
    shutil.copytree(FIXTURES / "core019_peft_full_tp1", save)
    opener = call(glob("builtins", "open"), s(str(tmp_path / "marker")), s("w"))
    extra = "decoder.layers.self_attention.linear_proj._extra_state/shard_0_2"
    replace_item(save / ITER, extra, _te_extra_state(opener))
    rc, out, _ = _run(capsys, "check", "--isolated", save, "--format", "json")
    assert rc == 1 and not json.loads(out)["safe_for_loaders"]  # the gate sees it in the source
    before = file_digests(save)
    rc, out, err = _run(capsys, "strip-frozen", save, "-o", tmp_path / "out", "--format", "json")
    assert rc == 0, err
    assert extra in {d["key"] for d in json.loads(out)["plan"]["dropped"]}
    rc, out, err = _run(capsys, "check", "--isolated", tmp_path / "out", "--format", "json")
    assert json.loads(out)["safe_for_loaders"], out  # the output carries nothing unsafe
    assert file_digests(save) == before and not (tmp_path / "marker").exists()


def test_an_unsafe_item_it_keeps_is_refused(capsys, tmp_path):
    save = tmp_path / "src"
    shutil.copytree(FIXTURES / "core019_peft_full_tp1", save)
    opener = call(glob("builtins", "open"), s(str(tmp_path / "marker")), s("w"))
    rng = next(k for k in _keys(capsys, save) if k.startswith("rng_state"))
    replace_item(save / ITER, rng, _te_extra_state(opener))
    rc, _, err = _run(capsys, "strip-frozen", save, "-o", tmp_path / "out")
    assert rc == 1 and "builtins.open" in err and not (tmp_path / "out").exists()
    rc, _, err = _run(capsys, "strip-frozen", save, "--dry-run")
    assert rc == 1 and "builtins.open" in err
    assert not (tmp_path / "marker").exists()


def _keys(capsys, save) -> list[str]:
    main(["inspect", str(save), "--keys", "--format", "json"])
    return [k["key"] for k in json.loads(capsys.readouterr().out)["keys"]]
