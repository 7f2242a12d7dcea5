"""How each rule of ``ckptdoctor check`` is made to fire: one example per code, for the rules reference.

Each example is a copy of a real fixture (or a real fixture as it is) and the ``ckptdoctor check`` command that
reports the finding. The damage is made by shell steps a reader can rerun (``cp``, ``rm``, ``truncate``,
``ckptdoctor seal``...), shown in the page and run by tests/test_docs_examples.py; where a shell step cannot
make it (an edited ``.metadata``, a rewritten pickle) by a function here that
``scripts/gen_rules_doc.py`` calls, which the page describes in a sentence. Either way the output shown is
what the command prints: the generator runs every example (``/tmp/`` stands for a fresh temporary dir).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.formats.archive import parse_archive
from ckptdoctor.formats.torch_dist import (
    StorageLocation,
    dump_metadata_object,
    index_fqn,
    load_metadata_object,
    record_attr,
    set_storage,
    storage_items,
)
from ckptdoctor.formats.torch_zip import dump_torch_zip, load_torch_zip
from ckptdoctor.ops.fix_args.plan import ArgChange, checked_config
from ckptdoctor.ops.fix_args.write import write_in_place

ITER = "iter_0000010"
QKV = "decoder.layers.self_attention.linear_qkv"


@dataclass(frozen=True)
class Example:
    """``steps``: shell lines run in order from the repository root (the last is the ``ckptdoctor check``
    whose output the page shows); ``damage``: a function run on ``/tmp/run`` (the path, under the temporary
    dir) after the steps before the last, described by ``damage_text`` in the page."""

    steps: tuple[str, ...]
    damage: Callable[[Path], None] | None = None
    damage_text: str = ""


def _copy(fixture: str, *more: str, check: str = "ckptdoctor check /tmp/run") -> tuple[str, ...]:
    return (f"cp -r fixtures/{fixture} /tmp/run", *more, check)


IT = f"/tmp/run/{ITER}"
STATES = "fixtures/bridge_train_state"
MD5_MANIFEST = '{"algorithm": "md5", "files": {}}'


# --- damage the shell cannot do: rewritten .metadata, pickles and tensor bytes -----------------------------


def _edit_metadata(iteration_dir: Path, edit: Callable[[object], None]) -> None:
    path = iteration_dir / ".metadata"
    metadata = load_metadata_object(path)
    edit(metadata)
    path.write_bytes(dump_metadata_object(metadata))


def _drop_storage_entry(save: Path) -> None:
    def edit(metadata: object) -> None:
        data = storage_items(metadata)
        del data[next(i for i in data if index_fqn(i) == f"{QKV}.weight")]

    _edit_metadata(save / ITER, edit)


def _drop_model_tensors(save: Path) -> None:
    def edit(metadata: object) -> None:
        state_dict = record_attr(metadata, "state_dict_metadata")
        for key in [k for k in state_dict if not k.startswith(("optimizer.", "rng_state"))]:
            del state_dict[key]
        storage = storage_items(metadata)
        for index in [i for i in storage if index_fqn(i) not in state_dict]:
            del storage[index]

    _edit_metadata(save / ITER, edit)


def _drop_a_chunk(save: Path) -> None:
    _edit_metadata(
        save / ITER, lambda metadata: record_attr(metadata, "state_dict_metadata")[f"{QKV}.weight"].chunks.pop()
    )


def _drop_qkv_weights(save: Path) -> None:
    def edit(metadata: object) -> None:
        state_dict = record_attr(metadata, "state_dict_metadata")
        for key in [k for k in state_dict if k.startswith(f"{QKV}.") and "_extra_state" not in k]:
            del state_dict[key]

    _edit_metadata(save / ITER, edit)


def _item_bytes(iteration_dir: Path, key: str) -> bytes:
    location = _location(iteration_dir, key)
    with open(iteration_dir / location.relative_path, "rb") as f:
        f.seek(location.offset)
        return f.read(location.length)


def _fp8_expert_state(save: Path) -> None:
    """Expert 0's state in layer 0 of the grouped linear_fc1 becomes the delayed-scaling state of a real TE 2.x item
    (core019_te_delayed's), appended to its data file; the other experts keep their empty state."""
    renamed = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "edit", str(save), "--rename", r"experts\.experts\.", "experts."]
        + ["--in-place", "--no-backup"],
        capture_output=True,
        text=True,
    )
    if renamed.returncode != 0:
        raise SystemExit(renamed.stderr)
    key = "decoder.layers.mlp.experts.linear_fc1._extra_state/shard_0.0_2.4"
    blob = _item_bytes(
        Path("fixtures/core019_te_delayed") / ITER, "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"
    )
    iteration_dir = save / ITER
    location = _location(iteration_dir, key)
    data_file = iteration_dir / location.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)

    def edit(metadata: object) -> None:
        for index, info in storage_items(metadata).items():
            if index_fqn(index) == key:
                set_storage(info, StorageLocation(info.relative_path, offset, len(blob)))

    _edit_metadata(iteration_dir, edit)


def _set_args(**values: object) -> Callable[[Path], None]:
    def damage(save: Path) -> None:
        path = save / ITER / "common.pt"
        common = load_torch_zip(path, str(path))
        for name, value in values.items():
            setattr(common["args"], name, value)
        path.write_bytes(dump_torch_zip(common))

    return damage


def _set_args_in_place(**values: object) -> Callable[[Path], None]:
    """The saved args changed by fix-args' writer (core >= 0.19 keeps them in the common_state item, not common.pt)."""

    def damage(save: Path) -> None:
        checkpoint = open_checkpoint(save)
        args, _ = checked_config(checkpoint)
        write_in_place(checkpoint, [ArgChange(name, args.get(name), value, "set") for name, value in values.items()])

    return damage


def _location(iteration_dir: Path, key: str) -> StorageLocation:
    return next(
        StorageLocation(info.relative_path, info.offset, info.length)
        for index, info in storage_items(load_metadata_object(iteration_dir / ".metadata")).items()
        if index_fqn(index) == key
    )


def _overwrite(key: str) -> Callable[[Path], None]:
    """The item's bytes overwritten with a zip header and zeros: same length, so only --deep sees it."""

    def damage(save: Path) -> None:
        location = _location(save / ITER, key)
        path = save / ITER / location.relative_path
        data = bytearray(path.read_bytes())
        data[location.offset : location.offset + location.length] = b"PK\x03\x04" + bytes(location.length - 4)
        path.write_bytes(bytes(data))

    return damage


def _flip_bit(key: str, byte: int, bit: int) -> Callable[[Path], None]:
    """One bit of the key's first chunk's storage record flipped in place (its CRC-32 left as saved)."""

    def damage(save: Path) -> None:
        location = _location(save / ITER, key)
        path = save / ITER / location.relative_path
        data = bytearray(path.read_bytes())
        blob = bytes(data[location.offset : location.offset + location.length])
        record = next(m for name, m in parse_archive(blob, key).members.items() if "/data/" in name)
        data[location.offset + record.start + byte] ^= 1 << bit
        path.write_bytes(bytes(data))

    return damage


def _rewrite_tensor(key: str, change: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    """The tensor chunk re-saved with ``change`` applied to its storage bytes, appended to its data file."""

    def damage(save: Path) -> None:
        iteration_dir = save / ITER
        location = _location(iteration_dir, key)
        path = iteration_dir / location.relative_path
        blob = path.read_bytes()[location.offset : location.offset + location.length]
        ref = load_torch_zip(blob, key)
        ref.storage.set_data(change(ref.storage.data()))
        new = dump_torch_zip(ref)
        offset = path.stat().st_size
        with open(path, "ab") as f:
            f.write(new)

        def edit(metadata: object) -> None:
            for index, info in storage_items(metadata).items():
                if index_fqn(index) == key:
                    set_storage(info, StorageLocation(location.relative_path, offset, len(new)))
                    return

        _edit_metadata(iteration_dir, edit)

    return damage


def _rewrite_every(
    select: Callable[[str, tuple[int, ...]], bool], change: Callable[[bytes], bytes]
) -> Callable[[Path], None]:
    """Every chunk ``select`` picks (by key and offsets) re-saved with ``change`` applied to its storage bytes."""

    def damage(save: Path) -> None:
        iteration_dir = save / ITER
        moved = {}
        for index, info in storage_items(load_metadata_object(iteration_dir / ".metadata")).items():
            key = index_fqn(index)
            if not select(key, tuple(record_attr(index, "offset") or ())):
                continue
            path = iteration_dir / info.relative_path
            ref = load_torch_zip(path.read_bytes()[info.offset : info.offset + info.length], key)
            ref.storage.set_data(change(ref.storage.data()))
            new = dump_torch_zip(ref)
            offset = path.stat().st_size
            with open(path, "ab") as f:
                f.write(new)
            moved[(key, tuple(record_attr(index, "offset") or ()))] = StorageLocation(
                info.relative_path, offset, len(new)
            )

        def edit(metadata: object) -> None:
            for index, info in storage_items(metadata).items():
                where = (index_fqn(index), tuple(record_attr(index, "offset") or ()))
                if where in moved:
                    set_storage(info, moved[where])

        _edit_metadata(iteration_dir, edit)

    return damage


def _experts_copied(save: Path, layers: tuple[int, ...] = (0, 1)) -> None:
    """Every expert chunk of ``layers`` re-saved with the bytes of that layer's expert 0 (experts.experts.*)."""
    iteration_dir = save / ITER
    items = storage_items(load_metadata_object(iteration_dir / ".metadata"))
    source: dict[tuple, bytes] = {}
    chunks = []
    for index, info in items.items():
        key, offset = index_fqn(index), tuple(record_attr(index, "offset") or ())
        if "experts.experts." not in key or not key.endswith("weight"):
            continue
        if offset[0] not in layers:
            continue
        if offset[1] == 0:
            blob = (iteration_dir / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
            source[(key, offset[0], *offset[2:])] = blob
        else:
            chunks.append((key, offset, info.relative_path))
    moved = {}
    for key, offset, relative in chunks:
        path = iteration_dir / relative
        new = dump_torch_zip(load_torch_zip(source[(key, offset[0], *offset[2:])], key))
        start = path.stat().st_size
        with open(path, "ab") as f:
            f.write(new)
        moved[(key, offset)] = StorageLocation(relative, start, len(new))

    def edit(metadata: object) -> None:
        for index, info in storage_items(metadata).items():
            where = (index_fqn(index), tuple(record_attr(index, "offset") or ()))
            if where in moved:
                set_storage(info, moved[where])

    _edit_metadata(iteration_dir, edit)


def _experts_copied_in_layer_0(save: Path) -> None:
    _experts_copied(save, layers=(0,))


def _drop_key(key: str) -> Callable[[Path], None]:
    def damage(save: Path) -> None:
        def edit(metadata: object) -> None:
            del record_attr(metadata, "state_dict_metadata")[key]
            storage = storage_items(metadata)
            for index in [i for i in storage if index_fqn(i) == key]:
                del storage[index]

        _edit_metadata(save / ITER, edit)

    return damage


def _unlisted_megatron_global(save: Path) -> None:
    """``megatron.core.brand_new.FutureConfig("x")`` called at the start of .metadata's pickle."""

    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value)]) + value.encode()

    gadget = text("megatron.core.brand_new") + text("FutureConfig") + b"\x93" + text("x") + b"\x85R0"
    path = save / ITER / ".metadata"
    original = path.read_bytes()
    path.write_bytes(original[:2] + gadget + original[2:])


def _second_prefix(save: Path) -> None:
    with zipfile.ZipFile(save / ITER / "common.pt", "a") as archive:
        archive.writestr("other/data/0", bytes(4))


# --- one example per code ---------------------------------------------------------------------------------


EXAMPLES: dict[str, Example] = {
    "CKD100": Example(("mkdir /tmp/notes", "echo hi > /tmp/notes/notes.txt", "ckptdoctor check /tmp/notes")),
    "CKD101": Example(_copy("core019_tp2", f"rm {IT}/metadata.json")),
    "CKD102": Example(_copy("core019_tp2", f'echo \'{{"sharded_backend": "torch_di\' > {IT}/metadata.json')),
    "CKD103": Example(
        (
            "mkdir -p /tmp/legacy/iter_0000010/mp_rank_00",
            "echo x > /tmp/legacy/iter_0000010/mp_rank_00/model_optim_rng.pt",
            "ckptdoctor check /tmp/legacy/iter_0000010",
        )
    ),
    "CKD222": Example(("ckptdoctor check fixtures/dcp/core019_mlm_torch_dcp_tp2_local",)),
    "CKD110": Example(_copy("core019_tp2", f"rm {IT}/.metadata")),
    "CKD111": Example(_copy("core019_tp2", f"truncate -s 100 {IT}/.metadata")),
    "CKD112": Example(
        _copy("core019_tp2"),
        _drop_storage_entry,
        f"deletes the storage entry of `{QKV}.weight` from `.metadata`",
    ),
    "CKD113": Example(_copy("core019_tp2", f"rm {IT}/__1_0.distcp")),
    "CKD114": Example(_copy("core019_tp2", f"truncate -s -4096 {IT}/__0_0.distcp")),
    "CKD115": Example(_copy("core019_tp2", f"cp {IT}/__0_0.distcp {IT}/__7_0.distcp")),
    "CKD116": Example(
        _copy("core016_tp1"),
        _drop_model_tensors,
        "deletes every key but the optimizer's and the RNG state from `.metadata`",
    ),
    "CKD120": Example(_copy("core019_tp2", "echo ten > /tmp/run/latest_checkpointed_iteration.txt")),
    "CKD121": Example(_copy("core019_tp2", "echo 20 > /tmp/run/latest_checkpointed_iteration.txt")),
    "CKD122": Example(_copy("core019_tp2", "rm /tmp/run/latest_checkpointed_iteration.txt")),
    "CKD123": Example(
        _copy("core019_tp2", f"head -c 900 {STATES}/train_state_step10.pt > /tmp/run/latest_train_state.pt")
    ),
    "CKD124": Example(_copy("core019_tp2", f"cp {STATES}/train_state_step20.pt /tmp/run/latest_train_state.pt")),
    "CKD125": Example(
        _copy(
            "core019_tp2",
            f"cp -r {IT} /tmp/run/iter_0000020",
            f"cp {STATES}/train_state_step20.pt /tmp/run/iter_0000020/train_state.pt",
            "cp /tmp/run/iter_0000020/train_state.pt /tmp/run/latest_train_state.pt",
            check="ckptdoctor check --select CKD125 /tmp/run",
        )
    ),
    "CKD130": Example(_copy("core016_tp1", f"rm {IT}/common.pt")),
    "CKD131": Example(_copy("core016_tp1", f"truncate -s 100 {IT}/common.pt")),
    "CKD132": Example(
        _copy("core019_tp2", f"mv {IT} /tmp/run/iter_0000020", "echo 20 > /tmp/run/latest_checkpointed_iteration.txt")
    ),
    "CKD133": Example(_copy("core019_tp2", f"cp {STATES}/train_state_step20.pt {IT}/train_state.pt")),
    "CKD150": Example(_copy("core019_tp2", f"mv {IT} /tmp/run/.{ITER}.ckptdoctor-old-20261206T000000-abcd")),
    "CKD151": Example(_copy("core019_tp2", f"mkdir /tmp/run/.{ITER}.ckptdoctor-tmp-20261206T000000-abcd")),
    "CKD160": Example(
        _copy(
            "core019_tp2",
            "git -C /tmp/run init -q && git -C /tmp/run add -A",
            f"git -C /tmp/run rm -q --cached {ITER}/__1_0.distcp",
            check="cd /tmp/run && ckptdoctor check --staged",
        )
    ),
    "CKD201": Example(
        _copy("core016_tp2", check="ckptdoctor check --select CKD201 /tmp/run"),
        _set_args(tensor_model_parallel_size=1),
        "sets `tensor_model_parallel_size` to 1 in the args saved in `common.pt`",
    ),
    "CKD202": Example(
        _copy("core016_tp2"),
        _set_args(pipeline_model_parallel_size=2),
        "sets `pipeline_model_parallel_size` to 2 in the args saved in `common.pt`",
    ),
    "CKD203": Example(("ckptdoctor check --select CKD203 fixtures/core019_convert_moe_ep2",)),
    "CKD204": Example(
        _copy("core016_tp2"),
        _set_args(world_size=3),
        "sets `world_size` to 3 in the args saved in `common.pt`",
    ),
    "CKD205": Example(
        _copy("core019_moe_ep2", check="ckptdoctor check --select CKD205 /tmp/run"),
        _set_args_in_place(expert_model_parallel_size=1),
        "sets `expert_model_parallel_size` to 1 in the saved args with `fix-args`' writer",
    ),
    "CKD210": Example(("ckptdoctor check --select CKD210 fixtures/core019_convert_tp4",)),
    "CKD211": Example(
        _copy("core016_tp2"),
        _set_args(gtp_weight_remat_size=0),
        "sets `gtp_weight_remat_size` to 0 in the saved args",
    ),
    "CKD212": Example(("ckptdoctor check --select CKD212 fixtures/core019_convert_moe_ep2",)),
    "CKD213": Example(
        _copy("core016_tp2"),
        _set_args(expert_gtp_weight_remat_size=-1),
        "sets `expert_gtp_weight_remat_size` to -1 in the saved args",
    ),
    "CKD220": Example(
        _copy("core019_tp2"),
        _drop_a_chunk,
        f"deletes the last chunk of `{QKV}.weight` from `.metadata`",
    ),
    "CKD221": Example(
        _copy("core019_tp1"),
        _drop_qkv_weights,
        f"deletes `{QKV}`'s weights from `.metadata` and keeps its `_extra_state`",
    ),
    "CKD230": Example(("ckptdoctor check fixtures/core019_te_delayed",)),
    "CKD231": Example(("ckptdoctor check fixtures/core019_te_mixed",)),
    "CKD232": Example(("ckptdoctor check fixtures/core019_te_mixed",)),
    "CKD233": Example(
        _copy("core019_moe_ep2"),
        _fp8_expert_state,
        "names the sequential experts' keys as TEGroupedLinear's (`experts.experts.` to `experts.`, with "
        "`ckptdoctor edit --rename --in-place`) and gives expert 0 of layer 0 the delayed-scaling state of a real "
        "TE 2.x item (from `core019_te_delayed`)",
    ),
    "CKD301": Example(
        _copy(
            "core019_tp2",
            f"ckptdoctor seal --jobs 1 {IT}",
            f"printf 'x' | dd of={IT}/__1_0.distcp bs=1 seek=1000 conv=notrunc status=none",
        )
    ),
    "CKD302": Example(_copy("core019_tp2", f"ckptdoctor seal --jobs 1 {IT}", f"rm {IT}/__1_0.distcp")),
    "CKD303": Example(_copy("core019_tp2", f"echo '{MD5_MANIFEST}' > {IT}/integrity.json")),
    "CKD304": Example(_copy("core019_tp2", f"ckptdoctor seal --jobs 1 {IT}", f"echo added later > {IT}/notes.txt")),
    "CKD310": Example(
        _copy("core019_tp2", check="ckptdoctor check --deep /tmp/run"),
        _overwrite(f"{QKV}.weight"),
        f"overwrites the bytes of a `{QKV}.weight` chunk with a zip header and zeros, keeping their length",
    ),
    "CKD311": Example(
        _copy("core019_tp2", check="ckptdoctor check --deep /tmp/run"),
        _rewrite_tensor("decoder.final_layernorm.weight", lambda data: data[:-4]),
        "re-saves `decoder.final_layernorm.weight` with its storage 4 bytes short",
    ),
    "CKD312": Example(
        _copy("core019_tp2", check="ckptdoctor check --deep /tmp/run"),
        _overwrite(f"{QKV}._extra_state/shard_0_2"),
        f"overwrites the bytes of the item `{QKV}._extra_state/shard_0_2` with a zip header and zeros",
    ),
    "CKD313": Example(
        _copy("core019_tp2", check="ckptdoctor check --deep /tmp/run"),
        _rewrite_tensor("decoder.final_layernorm.weight", lambda data: b"\xff" * 4 + data[4:]),
        "re-saves `decoder.final_layernorm.weight` with its first 4 bytes set to `0xff`: a NaN",
    ),
    "CKD314": Example(
        _copy("core019_tp2", check="ckptdoctor check --deep /tmp/run"),
        _flip_bit(f"{QKV}.weight", 4, 0),
        f"flips the lowest bit of the second float32 value of a `{QKV}.weight` chunk in its data file: a value one "
        "unit in the last place off, which torch.load loads",
    ),
    "CKD501": Example(("ckptdoctor check --health fixtures/core019_moe_zero_expert_ep2",)),
    "CKD502": Example(("ckptdoctor check --health fixtures/core019_moe_dup_expert_ep2",)),
    "CKD503": Example(
        _copy("core019_moe_ep2", check="ckptdoctor check --health /tmp/run"),
        _experts_copied,
        "re-saves every expert of both layers as a copy of that layer's expert 0",
    ),
    "CKD504": Example(
        _copy("core019_moe_ep2", check="ckptdoctor check --health /tmp/run"),
        _experts_copied_in_layer_0,
        "re-saves every expert of layer 0 as a copy of its expert 0; layer 1's experts are left as saved",
    ),
    "CKD505": Example(("ckptdoctor check --health fixtures/core019_reinit_layer_trained_tp1",)),
    "CKD510": Example(("ckptdoctor check --health fixtures/core019_zero_moments_trained_tp1",)),
    "CKD511": Example(
        _copy("core019_tp1", check="ckptdoctor check --health /tmp/run"),
        _rewrite_every(
            lambda key, _: key == "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight",
            lambda data: b"\x00\x00\x80\xbf" + data[4:],
        ),
        "re-saves `optimizer.state.exp_avg_sq.decoder.final_layernorm.weight` with its first value -1.0",
    ),
    "CKD512": Example(
        _copy("core019_tp1", check="ckptdoctor check --health /tmp/run"),
        _drop_key("optimizer.state.exp_avg_sq.output_layer.weight"),
        "removes `optimizer.state.exp_avg_sq.output_layer.weight` from `.metadata`",
    ),
    "CKD401": Example(_copy("core019_tp2", f"printf 'cos\\nsystem\\n(S\"echo pwned\"\\ntR.' > {IT}/.metadata")),
    "CKD402": Example(
        _copy("core019_tp2"),
        _unlisted_megatron_global,
        'puts a call of `megatron.core.brand_new.FutureConfig("x")` at the start of `.metadata`\'s pickle',
    ),
    "CKD403": Example(
        _copy("core016_tp1"),
        _set_args(seq_length=10**5000),
        "sets `seq_length` in the args saved in `common.pt` to an integer of 5,001 digits",
    ),
    "CKD404": Example(
        _copy("core016_tp1"),
        _second_prefix,
        "adds a member `other/data/0` to the `common.pt` archive, a second prefix beside its own",
    ),
    "CKD405": Example(_copy("core019_tp2", f"printf 'model:\\n  _target_: os.system\\n' > {IT}/run_config.yaml")),
}
