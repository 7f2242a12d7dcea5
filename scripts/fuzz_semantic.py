"""Structure-aware fuzzing of whole commands on mutated fixtures: every run must end in exit 0, 1 or 2 with no
internal error, traceback or hang.

Random bytes mostly break a pickle at once (nearly every byte mutant of a ``.metadata`` is refused as corrupt, so
the readers behind it are never reached). These mutants stay valid pickles of the allowed classes: the fixture's
``.metadata`` is read into ckptdoctor's stand-ins, a few of its values anywhere in the object graph are replaced
(ints nudged or made huge or negative, tuples cut or grown, lists shortened or given a duplicate, fields deleted,
values swapped for other types: ``None``, strings, empty shapes, ...) and it is pickled back unchecked. Targets:

* ``metadata``: metadata-only commands (check, inspect --keys, diff, can-load, show, edit/strip-frozen --dry-run);
* ``rewrite``: the writers (edit, edit --compact --rename, strip-frozen --force); where check passes the mutated
  source, it must pass what they wrote;
* ``values``: check --deep and --health, diff --values (and --stats), show --stats on the mutated ``.metadata``;
* ``args``: the saved args of ``common.pt`` set to values of the wrong type or range (check, inspect, fix-args,
  can-load --target and --suggest, diff, strip-frozen);
* ``data``: bytes of a data file or ``common.pt`` flipped, cut or inserted (check --deep and --health, diff --values
  and --stats, show);
* ``tree``: the save dir damaged as a filesystem is (a file removed, emptied, cut, replaced by a dir or a dangling
  or looping symlink, junk files and dirs added, the tracker or ``metadata.json`` garbled, a second iteration):
  check, inspect, latest-good, seal, repair and ``repair --write --in-place``.
* ``bridge``: a Megatron-Bridge save dir (``iter_*/train_state.pt``, ``latest_train_state.pt``) whose train state
  files are mutated as pickles (fields deleted, values swapped for other types, tensors of other dtypes or shapes),
  damaged as files, or disagree with the text tracker: the ``tree`` commands and ``strip-frozen -o``.

    python scripts/fuzz_semantic.py --target metadata --seed 1 --count 300 [--keep DIR]

Each failing case is printed (mutant number, fixture, command, exit, the end of stderr); with ``--keep`` its tree is
copied there. Exit 1 if any failed. Runs in-process (``ckptdoctor.cli.main``), with a 30 s alarm per command.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import re
import shutil
import signal
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
ITER = "iter_0000010"
METADATA_FIXTURES = [
    "core019_tp2",
    "core015_tp2",
    "core019_peft_full_tp1",
    "core016_tp1",
    "core019_moe_ep2",
    "core019_moe_ep2_distopt",
    "core019_mtp_pp2",
    "core019_moe_etp2_bf16_distopt",
    "core019_pp2_vpp2_distopt",
]
ARGS_FIXTURES = ["core016_tp1", "core016_tp2", "core016_peft_full_tp1", "core016_convert_tp4"]  # common.pt
SHAPE_ARGS = [
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "expert_model_parallel_size",
    "world_size",
    "num_experts",
    "ffn_hidden_size",
    "seq_length",
    "params_dtype",
    "ckpt_format",
    "tensor_parallel_num_weight_shards",
]


class _Hang(Exception):
    pass


def _alarm(*_: Any) -> None:
    raise _Hang


def _commands(target: str, save: Path, original: Path, out: Path) -> list[list[str]]:
    s, o = str(save), str(original)
    return {
        "metadata": [
            ["check", "--isolated", s],
            ["inspect", s, "--keys"],
            ["diff", s, o],
            ["can-load", s, "--target", "tp=2,pp=2"],
            ["show", s, "decoder.layers.mlp.linear_fc1.weight"],
            ["edit", s, "--drop-section", "optimizer", "--dry-run"],
            ["strip-frozen", s, "--dry-run", "--force"],
        ],
        "rewrite": [
            ["edit", s, "--remove", r"^optimizer\.", "-o", str(out / "edited")],
            ["edit", s, "--rename", "output_layer", "out_layer", "--compact", "-o", str(out / "renamed")],
            ["strip-frozen", s, "--force", "-o", str(out / "stripped")],
        ],
        "values": [
            ["check", "--isolated", "--deep", "--jobs", "1", s],
            ["check", "--isolated", "--health", "--format", "json", "--jobs", "1", s],
            ["diff", s, o, "--values", "--jobs", "1"],
            ["diff", s, o, "--values", "--stats", "--format", "json", "--jobs", "1"],
            ["show", s, "output_layer.weight", "--stats"],
        ],
        "args": [
            ["check", "--isolated", s],
            ["inspect", s],
            ["fix-args", s],
            ["fix-args", s, "--write", "--output", str(out / "fixed")],
            ["can-load", s, "--target", "tp=2,pp=1"],
            ["can-load", s, "--suggest", "--limit", "2"],
            ["diff", s, o],
            ["strip-frozen", s, "-o", str(out / "stripped")],
        ],
        "tree": [
            ["check", "--isolated", str(save.parent)],
            ["inspect", str(save.parent)],
            ["latest-good", str(save.parent)],
            ["seal", "--force", s],
            ["repair", str(save.parent)],
            ["repair", str(save.parent), "--write", "--in-place"],
        ],
        "bridge": [
            ["check", "--isolated", str(save.parent)],
            ["inspect", str(save.parent)],
            ["latest-good", str(save.parent), "--format", "json"],
            ["repair", str(save.parent)],
            ["strip-frozen", str(save.parent), "--force", "-o", str(out / "stripped")],
            ["fix-args", str(save.parent)],
            ["fix-args", str(save.parent), "--write", "--output", str(out / "fixed")],
            ["repair", str(save.parent), "--write", "--in-place"],
        ],
        "data": [
            ["check", "--isolated", "--deep", "--jobs", "1", s],
            ["check", "--isolated", "--health", "--format", "json", "--jobs", "1", s],
            ["diff", s, o, "--values", "--jobs", "1"],
            ["diff", s, o, "--values", "--stats", "--format", "json", "--jobs", "1"],
            ["show", s, "output_layer.weight", "--stats"],
            ["inspect", s],
        ],
    }[target]


# --- mutations ---------------------------------------------------------------------------------------------------


def _slots(obj: Any, depth: int, out: list, seen: set[int]) -> None:
    """Every (container, key) of the object graph down to ``depth`` levels: dict entries, list items and the fields
    of stand-ins."""
    from ckptdoctor.pickle.stand_ins import STAND_IN_TYPES

    if depth > 7 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for key in list(obj):
            out.append((obj, key))
            _slots(obj[key], depth + 1, out, seen)
    elif isinstance(obj, list):
        for index, item in enumerate(obj):
            out.append((obj, index))
            _slots(item, depth + 1, out, seen)
    elif isinstance(obj, STAND_IN_TYPES):
        fields = obj.__dict__
        for key in [k for k in fields if not k.startswith("_ckd")]:
            out.append((fields, key))
            _slots(fields[key], depth + 1, out, seen)


def _garbage(rng: random.Random, old: Any) -> Any:
    from ckptdoctor.pickle.torch_stand_ins import Size

    roll = rng.randrange(20)
    if isinstance(old, int) and not isinstance(old, bool) and roll < 8:
        return rng.choice([old + 1, old - 1, old * 2, -old, old + 2**31, 0, old // 2 or 7, 2**63])
    if isinstance(old, tuple) and roll < 8:
        items = list(old)
        if items and rng.random() < 0.5:
            items[rng.randrange(len(items))] = rng.choice([0, -1, 2**63, 1 << 40, 3])
        elif rng.random() < 0.5:
            items = items[:-1]
        else:
            items.append(rng.choice([0, 1, 5]))
        # built as a pickle would have it: Size() itself refuses what torch.Size refuses (2**63 here)
        return tuple.__new__(Size, tuple(items)) if isinstance(old, Size) else tuple(items)
    if isinstance(old, list) and old and roll < 6:
        items = list(old)
        if rng.random() < 0.5:
            items.append(rng.choice(items))
        else:
            items.pop(rng.randrange(len(items)))
        return items
    return rng.choice(
        [None, -1, 2**70, 1.5, "x", "", "decoder.layers.0.mlp.weight", [], {}, (1, 2), Size((3, 4)), {"fqn": 1},
         Size(()), Size((0,)), Size((2**62, 4)), "output_layer.weight"]
    )  # fmt: skip


def _mutate_metadata(rng: random.Random, iteration_dir: Path) -> None:
    from ckptdoctor.formats.torch_dist import load_metadata_object
    from ckptdoctor.pickle import unpickler

    path = iteration_dir / ".metadata"
    metadata = load_metadata_object(path)
    slots: list = []
    _slots(metadata, 0, slots, set())
    for _ in range(rng.choice([1, 1, 2, 3])):
        container, key = rng.choice(slots)
        with contextlib.suppress(Exception):  # a slot an earlier change removed or made immutable
            if isinstance(container, dict) and rng.random() < 0.1:
                del container[key]
            else:
                container[key] = _garbage(rng, container[key])
    path.write_bytes(unpickler._pickled(metadata, None))  # unchecked: ckptdoctor's own writer may refuse it


def _mutate_args(rng: random.Random, save: Path) -> None:
    from ckptdoctor.checkpoint import open_checkpoint
    from ckptdoctor.formats.torch_zip import dump_torch_zip

    common = dict(open_checkpoint(save).common_state())
    args = argparse.Namespace(**vars(common["args"]))
    wrong = [None, -1, 0, 2**70, -(2**70), 1.5, float("nan"), float("inf"), "x", "", "4", [], [1, 2], {}, True]
    for _ in range(rng.choice([1, 2, 3, 6])):
        name = rng.choice([*vars(args), *SHAPE_ARGS])
        if rng.random() < 0.1:
            with contextlib.suppress(AttributeError):
                delattr(args, name)
        else:
            setattr(args, name, rng.choice(wrong))
    common["args"] = args if rng.random() > 0.05 else rng.choice(wrong)
    if rng.random() < 0.1:
        common["iteration"] = rng.choice(wrong)
    (save / ITER / "common.pt").write_bytes(dump_torch_zip(common))


def _mutate_data(rng: random.Random, iteration_dir: Path) -> None:
    path = rng.choice(sorted(iteration_dir.glob("*.distcp")) + sorted(iteration_dir.glob("common.pt")))
    data = bytearray(path.read_bytes())
    for _ in range(rng.choice([1, 2, 8])):
        at = rng.randrange(len(data))
        roll = rng.random()
        if roll < 0.7:
            data[at] = rng.randrange(256)
        elif roll < 0.85:
            del data[at : at + rng.randrange(1, 64)]
        else:
            data[at:at] = rng.randbytes(rng.randrange(1, 16))
    path.write_bytes(bytes(data))


def _damage_tree(rng: random.Random, save_dir: Path, outside: Path) -> None:
    """One to three filesystem-level damages to a save dir (``save_dir``/iter_*/...). Symlinks point into the
    scratch dir only (``outside``: a file beside the save dir that no command may change)."""
    iteration_dir = save_dir / ITER
    for _ in range(rng.choice([1, 1, 2, 3])):
        with contextlib.suppress(OSError):  # an earlier damage made this one impossible
            _damage_once(rng, save_dir, iteration_dir, outside)


def _damage_once(rng: random.Random, save_dir: Path, iteration_dir: Path, outside: Path) -> None:
    files = [p for p in sorted(save_dir.rglob("*")) if p.is_file() and not p.is_symlink()]
    if not files:
        return
    path = rng.choice(files)
    roll = rng.randrange(9)
    if roll == 0:
        path.unlink()
    elif roll == 1:
        path.write_bytes(b"")
    elif roll == 2:
        size = path.stat().st_size
        os.truncate(path, rng.randrange(size) if size else 0)
    elif roll == 3:
        path.unlink()
        path.mkdir()
    elif roll == 4:
        path.unlink()
        path.symlink_to(rng.choice(["missing-target", path.name, str(outside), ".."]))
    elif roll == 5:
        junk = iteration_dir / rng.choice(["__9_0.distcp", ".metadata.tmp", "extra.bin", "sub"])
        if not junk.exists():
            junk.mkdir() if junk.name == "sub" else junk.write_bytes(rng.randbytes(rng.randrange(64)))
    elif roll == 6:
        tracker = save_dir / "latest_checkpointed_iteration.txt"
        if tracker.is_symlink() or tracker.is_dir():
            return
        tracker.write_bytes(rng.choice([b"", b"abc", b"-1", b"99999999999999999999", b"20", b"release", b"10\n\x00"]))
    elif roll == 7:
        meta = iteration_dir / "metadata.json"
        if meta.is_symlink() or meta.is_dir():
            return
        meta.write_bytes(rng.choice([b"", b"{", b"[]", b'{"sharded_backend": 1}', b'{"sharded_backend": "zarr"}']))
    else:
        other = save_dir / "iter_0000020"
        if not other.exists():
            shutil.copytree(iteration_dir, other, symlinks=True)


def _damage_bridge(rng: random.Random, save_dir: Path, outside: Path) -> None:
    """A Bridge save dir: train state files in place, then one to three mutations of them (or of the tree)."""
    from ckptdoctor.errors import CkptError

    states = FIXTURES / "bridge_train_state"
    shutil.copy(states / "train_state_step10.pt", save_dir / ITER / "train_state.pt")
    shutil.copy(states / "train_state_step10.pt", save_dir / "latest_train_state.pt")
    if rng.random() < 0.4:
        shutil.copytree(save_dir / ITER, save_dir / "iter_0000020")
        shutil.copy(states / "train_state_step20.pt", save_dir / "iter_0000020" / "train_state.pt")
        for name in rng.sample(["latest_train_state.pt", "latest_checkpointed_iteration.txt"], rng.randrange(3)):
            if name.endswith(".pt"):
                shutil.copy(states / "train_state_step20.pt", save_dir / name)
            else:
                (save_dir / name).write_text("20")
    common = save_dir / ITER / "common.pt"
    if common.is_file() and rng.random() < 0.6:  # Bridge saves no args: run_config.yaml's model section instead
        _bridge_config(rng, save_dir / ITER, common)
    for _ in range(rng.choice([1, 1, 2, 3])):
        with contextlib.suppress(OSError, CkptError):  # a damage an earlier one made impossible or our writer refuses
            roll = rng.random()
            if roll < 0.5:
                _mutate_train_state(
                    rng, rng.choice([save_dir / "latest_train_state.pt", *save_dir.glob("iter_*/train_state.pt")])
                )
            elif roll < 0.75:
                _damage_once(rng, save_dir, save_dir / ITER, outside)
            else:
                path = rng.choice([save_dir / "latest_train_state.pt", *save_dir.glob("iter_*/train_state.pt")])
                data = path.read_bytes()
                path.write_bytes(
                    rng.choice([b"", data[: rng.randrange(len(data) + 1)], rng.randbytes(64), data + b"x"])
                )


def _bridge_config(rng: random.Random, iteration_dir: Path, common: Path) -> None:
    """No args in common.pt and a run_config.yaml whose model section is mutated line by line."""
    from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip

    state = dict(load_torch_zip(common, str(common)))
    state.pop("args", None)
    common.write_bytes(dump_torch_zip(state))
    lines = [
        "model:",
        "  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider",
        f"  tensor_model_parallel_size: {rng.choice([1, 2, 4, 8])}",
        f"  pipeline_model_parallel_size: {rng.choice([1, 2])}",
        f"  tensor_parallel_num_weight_shards: {rng.choice([1, 2, 4])}",
        "  num_layers: 2",
        "  nested:",
        "    tensor_model_parallel_size: 1",
        "checkpoint:",
        "  save_rng: true",
    ]
    junk = [
        "",
        "model:",
        "  - 1",
        "  x: [1, {a: 2}",
        "\t  y: 3",
        "  tensor_model_parallel_size: 1e309",
        "  : 4",
        "  tensor_model_parallel_size: -3",
        "  tensor_model_parallel_size: '2'",
        "  z: " + "9" * 5000,
        "\udcff",
    ]
    for _ in range(rng.randrange(4)):
        lines.insert(rng.randrange(len(lines) + 1), rng.choice(junk))
    text = "\n".join(lines) + "\n"
    data = text.encode("utf-8", "surrogateescape") if rng.random() > 0.05 else rng.randbytes(200)
    (iteration_dir / "run_config.yaml").write_bytes(data)


def _mutate_train_state(rng: random.Random, path: Path) -> None:
    from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip

    loaded = load_torch_zip(path, str(path))
    if not isinstance(loaded, dict) or not loaded:  # an earlier mutation wrapped or emptied it
        return
    state = dict(loaded)
    key = rng.choice(sorted(state))
    roll = rng.random()
    if roll < 0.15:
        del state[key]
    elif roll < 0.4:
        state[key] = state[rng.choice(sorted(state))]  # another field's tensor: float, bool, another step
    elif roll < 0.6 and hasattr(state[key], "size"):
        ref = state[key]
        ref.size, ref.stride = rng.choice([((2,), (1,)), ((), ()), ((0,), (1,)), ((1, 1), (1, 1))])
        ref.storage_offset = rng.choice([ref.storage_offset, 1, -1, 2**40])
    else:
        state[key] = _garbage(rng, state[key])
    path.write_bytes(dump_torch_zip(state if rng.random() > 0.05 else [state]))


# --- running -----------------------------------------------------------------------------------------------------


def _run(command: list[str]) -> tuple[Any, str]:
    from ckptdoctor.cli import main

    err, out = io.StringIO(), io.StringIO()
    signal.alarm(30)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code: Any = main(command)
    except _Hang:
        code = "hang"
    except BaseException as exc:  # noqa: BLE001 - main() must not raise: anything it lets out is a finding
        code = f"raised {type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)
    return code, err.getvalue()


def fuzz(target: str, seed: int, count: int, keep: Path | None = None) -> tuple[Counter, list[tuple]]:
    """Run ``count`` mutants; returns the tally of (command, exit) and the failures."""
    rng = random.Random(seed)
    names = ARGS_FIXTURES if target == "args" else METADATA_FIXTURES
    tally: Counter = Counter()
    failures: list[tuple] = []
    signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory(prefix="ckptdoctor-fuzz-") as scratch:
        work = Path(scratch)
        for number in range(count):
            name = rng.choice(names)
            save = work / "src"
            shutil.rmtree(save, ignore_errors=True)
            shutil.copytree(FIXTURES / name, save)
            if target in ("tree", "bridge"):  # a save dir (the fixture's), commands on the iteration dir inside it
                root = work / "tree"
                shutil.rmtree(root, ignore_errors=True)
                shutil.copytree(FIXTURES / name, root / "save", symlinks=True)
                save = root / "save" / ITER
                outside = root / "outside.bin"
                outside.write_bytes(b"not part of any checkpoint")
                if target == "tree":
                    _damage_tree(rng, root / "save", outside)
                else:
                    _damage_bridge(rng, root / "save", outside)
            elif target == "args":
                _mutate_args(rng, save)
            elif target == "data":
                _mutate_data(rng, save / ITER)
            else:
                _mutate_metadata(rng, save / ITER)
            # a rewrite of a source check passes must pass check too (its own output, read back in full)
            source_clean = target == "rewrite" and _run(["check", "--isolated", str(save)])[0] == 0
            if target == "rewrite":
                tally[("check of the source", 0 if source_clean else "not 0")] += 1
            for command in _commands(target, save, FIXTURES / name, work / "out"):
                shutil.rmtree(work / "out", ignore_errors=True)
                code, err = _run(command)
                tally[(command[0], code if code in (0, 1, 2) else "failed")] += 1
                if source_clean and code == 0:
                    written, report = _run(["check", "--isolated", command[command.index("-o") + 1]])
                    if written != 0:
                        code, err = f"wrote a checkpoint check refuses ({written})", err + report
                if target == "bridge" and command[0] == "fix-args" and "--write" in command and code == 0:
                    _, report = _run(["check", "--isolated", "--format", "json", str(work / "out" / "fixed")])
                    left = sorted(set(re.findall(r'"code": "(CKD2[01][0-9])"', report)))
                    if left:  # fix-args said the args are consistent now: check must agree
                        code, err = f"fix-args left {', '.join(left)}", err + report[-300:]
                if target == "bridge" and command[0] == "repair" and "--write" in command and code == 0:
                    _, report = _run(["check", "--isolated", "--format", "json", str(save.parent)])
                    left = [c for c in ("CKD123", "CKD124", "CKD125") if f'"code": "{c}"' in report]
                    if left:
                        code, err = f"repair left {', '.join(left)}", err + report[-300:]
                if (
                    target in ("tree", "bridge")
                    and (work / "tree" / "outside.bin").read_bytes() != b"not part of any checkpoint"
                ):
                    code, err = "wrote outside the checkpoint", err + " (through a symlink: outside.bin changed)"
                if code not in (0, 1, 2) or "internal error" in err or "Traceback" in err:
                    failures.append((number, name, " ".join(command[:2]), code, err[-400:]))
                    if keep is not None:
                        shutil.copytree(save, keep / f"{target}-{seed}-{number}", dirs_exist_ok=True)
    return tally, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target", choices=["metadata", "rewrite", "values", "args", "data", "tree", "bridge"], default="metadata"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--keep", type=Path, help="copy each failing case's tree here")
    options = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    tally, failures = fuzz(options.target, options.seed, options.count, options.keep)
    print(f"{options.target} seed {options.seed}: {options.count} mutants, {len(failures)} failing runs")
    print("  " + ", ".join(f"{cmd} exit {code}: {n}" for (cmd, code), n in sorted(tally.items(), key=str)))
    for failure in failures[:20]:
        print(f"  mutant {failure[0]} of {failure[1]}: {failure[2]} -> {failure[3]}: {failure[4].strip()}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
