"""``ckptdoctor show``: one saved item: metadata and chunk grid (no torch), and with torch its statistics,
a slice, and an export (``.pt`` / ``.npy``); a bytes item decoded (``--decode``); and the saved args and common
state by path (``args``, ``args.lr``, ``common.optimizer.param_groups[0].lr``), decoded through the safe unpickler.

Statistics are streamed one chunk at a time (memory bounded by the largest chunk); a slice and an export
assemble the global tensor (:func:`ckptdoctor.values.read.read_tensor`).
"""

from __future__ import annotations

import ast
import difflib
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor.args import args_as_dict
from ckptdoctor.atomic import write_atomic
from ckptdoctor.checkpoint import Checkpoint, Entry
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.archive import ArchiveError
from ckptdoctor.formats.te_extra_state import ExtraState, describe_item, is_extra_state_key
from ckptdoctor.logical_items import KIND_OBJECT, Item, logical_items
from ckptdoctor.optimizer_keys import bucket_padding
from ckptdoctor.pickle.paths import PathError, lookup, type_name
from ckptdoctor.pickle.plain import OMIT_NONE
from ckptdoctor.rules.safety import stand_ins_note
from ckptdoctor.values.read import read_chunk, require_torch

SCHEMA = "ckptdoctor.show/1"
TEXT_CHUNK_LIMIT = 20


@dataclass
class ChunkRow:
    offsets: list[int]
    sizes: list[int]
    file: str | None
    offset: int | None
    length: int | None


@dataclass
class ShowReport:
    schema: str
    checkpoint: str
    key: str
    section: str
    kind: str
    dtype: str | None
    shape: list[int] | None
    numel: int
    bytes: int
    grid: list[int] | None  # chunks along each axis (distinct offsets), for tensors
    chunks: list[ChunkRow]
    # with torch: numel, min, max, mean, std (finite values), nan, posinf, neginf, padding (bucket elements left out)
    stats: dict | None = None
    slice: dict | None = None  # --slice: {spec, shape, values}
    saved: str | None = None  # --save: the file written
    notes: list[str] = field(default_factory=list)
    # --decode: the bytes item (of an object: {shard: value}) as the safe unpickler reads it
    decoded: Any = field(default=None, metadata=OMIT_NONE)
    # a Transformer Engine _extra_state item (of an object: one per shard): what TE wrote, read without TE
    extra_state: list[ExtraStateView] | None = field(default=None, metadata=OMIT_NONE)


@dataclass
class ExtraStateView:
    """One stored ``_extra_state`` item as :func:`ckptdoctor.formats.te_extra_state.describe` reads it; ``error``:
    why it could not be read (refused by the gate, damaged)."""

    item: str
    state: ExtraState | None
    error: str | None = None


ARGS = "args"  # show CKPT args[.NAME]: the saved args
COMMON = "common"  # show CKPT common[.PATH]: the common state


@dataclass
class ValueReport:
    """``show CKPT args[.NAME]`` / ``show CKPT common[.PATH]``: a value of the saved args or common state."""

    schema: str
    checkpoint: str
    key: str  # as asked
    kind: str  # ARGS | COMMON
    source: str  # where it was decoded from: common.pt or the common_state item's key
    path: str  # the value's path ("args", "args.lr", "common.optimizer.param_groups[0].lr")
    type: str  # its type: a Python type's name, or a stand-in's global (megatron.core.enums.ModelType)
    value: Any
    notes: list[str] = field(default_factory=list)


SUGGESTIONS = 5  # names suggested for an unknown key


def is_value_path(key: str) -> bool:
    """``args``, ``args.lr``, ``common``, ``common.optimizer...``: a path into the saved args or common state."""
    return any(key == root or key.startswith((root + ".", root + "[")) for root in (ARGS, COMMON))


def find_entry(checkpoint: Checkpoint, key: str) -> Entry | Item:
    """The saved item ``key`` names: a DCP entry by its own key, or a ShardedObject by the logical key ``diff`` and
    ``inspect`` print (``rng_state`` for its ``rng_state/shard_*`` entries). Unknown: the keys it is the end of
    (``linear_qkv.weight``), then the closest names, are suggested."""
    entry = checkpoint.entries.get(key)
    if entry is not None:
        entry.require_chunk_ranks(checkpoint.iteration_dir)
        return entry
    items = logical_items(checkpoint)
    item = items.get(key)
    if item is not None and item.kind == KIND_OBJECT:
        return item
    names = list(dict.fromkeys([*checkpoint.entries, *items, ARGS, COMMON]))
    dotted = key.strip(".")
    ends = sorted((n for n in names if dotted and n.endswith("." + dotted)), key=lambda n: (n.count("."), n))
    close = ends[:SUGGESTIONS] or difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    more = f" (and {len(ends) - SUGGESTIONS} more ending so)" if len(ends) > SUGGESTIONS else ""
    hint = f"; did you mean {', '.join(repr(c) for c in close)}{more}?" if close else ""
    raise CkptError(
        f"{checkpoint.iteration_dir}: no saved item '{key}'{hint} (`ckptdoctor inspect --keys` lists them; "
        f"`{ARGS}` and `{COMMON}` show the saved args and common state)"
    )


def _close(wanted: str, names: list[str]) -> list[str]:
    """Names that contain ``wanted``, then the closest ones: the suggestions for a name that is not there."""
    within = [n for n in names if wanted and wanted.lower() in n.lower()]
    close = difflib.get_close_matches(wanted, names, n=SUGGESTIONS, cutoff=0.6)
    return list(dict.fromkeys([*close, *sorted(within, key=len)]))[:SUGGESTIONS]


def _common_source(checkpoint: Checkpoint) -> str:
    source = checkpoint.common_source
    if source is None:
        raise CkptError(f"{checkpoint.iteration_dir}: no common state (neither common.pt nor a common_state item)")
    return source


def show_value(checkpoint: Checkpoint, key: str) -> ValueReport:
    """The saved args (``args``), one of them (``args.lr``, ``args.cuda_graph_modules[0]``), or a path into the
    common state (``common``, ``common.opt_param_scheduler``); unknown names are errors that suggest the close
    ones."""
    root, rest = (ARGS, key[len(ARGS) :]) if key.startswith(ARGS) else (COMMON, key[len(COMMON) :])
    source = _common_source(checkpoint)
    where = f"{checkpoint.iteration_dir}: {source}"
    if root == ARGS:
        if checkpoint.args is None:
            raise CkptError(
                f"{where}: the common state holds no saved args (a Megatron-Bridge checkpoint keeps its config in "
                "run_config.yaml); `ckptdoctor show CKPT common` lists what it holds"
            )
        base: Any = args_as_dict(checkpoint.args)
    else:
        base = checkpoint.common_state()
    try:
        value, path = lookup(base, rest.removeprefix("."), root) if rest else (base, root)
    except ValueError as exc:
        raise CkptError(f"{key}: {exc}") from None
    except PathError as exc:
        what = "saved arg" if root == ARGS and exc.at == ARGS else "field"
        close = _close(exc.step, exc.choices)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        listing = f"`ckptdoctor show CKPT {exc.at}` lists them" if exc.choices else f"{exc.at} has no fields"
        raise CkptError(f"{where}: no {what} '{exc.step}' in {exc.at}{hint} ({listing})") from None
    kind = type_name(checkpoint.args if path == ARGS else value)  # the args are a Namespace, read as a dict
    report = ValueReport(SCHEMA, str(checkpoint.iteration_dir), key, root, source, path, kind, value)
    if root == ARGS and path == ARGS:
        report.notes.append(f"{len(base)} saved args")
    return report


def stand_ins_notes(checkpoint: Checkpoint) -> list[str]:
    """The note ``inspect`` gives too, where the pickles read so far name globals off the allowlist."""
    names = checkpoint.untrusted_globals_read()
    return [stand_ins_note(names)] if names else []


def decode_item(checkpoint: Checkpoint, entry: Entry | Item) -> Any:
    """A bytes item as the safe unpickler reads it; a sharded object's shards as ``{shard: value}`` (one shard:
    its value)."""
    if isinstance(entry, Entry):
        return checkpoint.read_bytes_item(entry.key)
    shards = {suffix: checkpoint.read_bytes_item(e.key) for suffix, e in sorted(entry.entries.items())}
    return next(iter(shards.values())) if len(shards) == 1 else shards


def extra_state_views(checkpoint: Checkpoint, entry: Entry | Item) -> list[ExtraStateView] | None:
    """A TE ``_extra_state`` item (each shard of an object) described; None for any other key."""
    if not is_extra_state_key(entry.key):
        return None
    entries = [entry] if isinstance(entry, Entry) else [e for _, e in sorted(entry.entries.items())]
    out = []
    for item in entries:
        try:
            data, where = checkpoint.bytes_item_data(item.key)
            out.append(ExtraStateView(item.key, describe_item(data, where)))
        except (CkptError, ArchiveError) as exc:  # the gate's refusal or damage: said, not raised
            out.append(ExtraStateView(item.key, None, str(exc)))
    return out


def describe_object(checkpoint: Checkpoint, item: Item) -> ShowReport:
    """A ShardedObject by its logical key: one row per shard (its offsets in the shard grid, where it is stored)."""
    rows = []
    for suffix, entry in sorted(item.entries.items()):
        offsets = [int(x) for x in suffix.split("_")[1].split(".")]
        storage = [c.storage for c in entry.chunks if c.storage is not None]
        first = storage[0] if storage else None
        rows.append(
            ChunkRow(
                offsets,
                [1] * len(offsets),
                None if first is None else first.relative_path,
                None if first is None else first.offset,
                None if first is None else first.length,
            )
        )
    report = ShowReport(
        SCHEMA,
        str(checkpoint.iteration_dir),
        item.key,
        item.section,
        item.kind,
        None,
        None if item.shape is None else list(item.shape),
        0,
        item.nbytes,
        None,
        rows,
    )
    names = ", ".join(f"{item.key}/{suffix}" for suffix in sorted(item.entries))
    report.notes.append(f"a sharded object saved as {len(rows)} shard(s): {names}")
    return report


def describe(checkpoint: Checkpoint, entry: Entry) -> ShowReport:
    chunks = [
        ChunkRow(
            list(c.offsets),
            list(c.sizes),
            None if c.storage is None else c.storage.relative_path,
            None if c.storage is None else c.storage.offset,
            None if c.storage is None else c.storage.length,
        )
        for c in entry.chunks
    ]
    grid = None
    if entry.kind == "tensor" and entry.shape is not None:
        grid = [len({c.offsets[axis] for c in entry.chunks}) for axis in range(len(entry.shape))]
    return ShowReport(
        SCHEMA,
        str(checkpoint.iteration_dir),
        entry.key,
        entry.section,
        entry.kind,
        entry.dtype,
        None if entry.shape is None else list(entry.shape),
        entry.numel,
        entry.nbytes,
        grid,
        chunks,
    )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def statistics(checkpoint: Checkpoint, entry: Entry) -> dict:
    """min/max/mean/std over the finite values and NaN/Inf counts, streamed one chunk at a time."""
    torch = require_torch("tensor statistics")
    n = nan = posinf = neginf = padding = 0
    total = total_sq = 0.0
    lo, hi = math.inf, -math.inf
    for index, chunk in enumerate(entry.chunks):
        if bucket_padding(entry.key, chunk.offsets, chunk.sizes):  # never written: what memory held (check --deep too)
            padding += math.prod(chunk.sizes)
            continue
        value = read_chunk(checkpoint, entry.key, index)
        flat = value.reshape(-1)
        if flat.dtype == torch.bool or not (flat.is_floating_point() or flat.is_complex()):
            flat = flat.to(torch.float64)
        if flat.is_complex():
            raise CkptError(f"{checkpoint.iteration_dir}: {entry.key}: statistics of complex tensors are not supported")
        flat = flat.to(torch.float64)
        nan += int(torch.isnan(flat).sum())
        posinf += int(torch.isposinf(flat).sum())
        neginf += int(torch.isneginf(flat).sum())
        finite = flat[torch.isfinite(flat)]
        if finite.numel():
            n += finite.numel()
            total += float(finite.sum())
            total_sq += float((finite * finite).sum())
            lo = min(lo, float(finite.min()))
            hi = max(hi, float(finite.max()))
    mean = total / n if n else None
    std = math.sqrt(max(total_sq / n - mean * mean, 0.0)) if n and mean is not None else None
    return {
        "numel": entry.numel,
        "finite": n,
        "min": _finite(lo),
        "max": _finite(hi),
        "mean": mean,
        "std": std,
        "nan": nan,
        "posinf": posinf,
        "neginf": neginf,
        "padding": padding,
    }


def parse_slice(spec: str, ndim: int) -> tuple:
    """``"0,:4,:4"`` -> (0, slice(None, 4), slice(None, 4)); numpy-style ints, ``a:b[:c]`` and ``...``."""
    parts = [p.strip() for p in spec.split(",")] if spec.strip() else []
    index: list[Any] = []
    for part in parts:
        if part in ("...", "Ellipsis"):
            index.append(Ellipsis)
        elif ":" in part:
            fields = part.split(":")
            if len(fields) > 3:
                raise CkptError(f"--slice {spec!r}: bad slice {part!r}")
            try:
                values = [int(f) if f.strip() else None for f in fields]
            except ValueError:
                raise CkptError(f"--slice {spec!r}: bad slice {part!r} (integers only)") from None
            index.append(slice(*values))
        else:
            try:
                index.append(int(ast.literal_eval(part)))
            except (ValueError, SyntaxError, TypeError):
                raise CkptError(f"--slice {spec!r}: bad index {part!r} (integers, a:b[:c] or ...)") from None
    if sum(1 for i in index if i is not Ellipsis) > ndim:
        raise CkptError(f"--slice {spec!r}: {len(index)} indices for a {ndim}-d tensor")
    return tuple(index)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def take_slice(tensor: Any, spec: str) -> Any:
    index = parse_slice(spec, tensor.dim())
    try:
        return tensor[index]
    except (IndexError, ValueError, RuntimeError) as exc:
        raise CkptError(f"--slice {spec!r}: {exc}") from None


def slice_values(part: Any) -> list | float | int | bool:
    import torch

    if part.dtype in (torch.bfloat16, torch.float16):
        part = part.to(torch.float32)
    return _plain(part.tolist())


_NPY_DESCR = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "|i1",
    "uint8": "|u1",
    "bool": "|b1",
}


def npy_bytes(tensor: Any) -> tuple[bytes, str | None]:
    """The ``.npy`` (format 1.0) bytes of a CPU tensor, without numpy; bfloat16 (no numpy dtype) is widened
    to float32 (the second value says so)."""
    import ctypes

    import torch

    note = None
    if tensor.dtype == torch.bfloat16:
        tensor, note = tensor.to(torch.float32), "bfloat16 has no numpy dtype: saved as float32 (exact)"
    name = str(tensor.dtype).removeprefix("torch.")
    descr = _NPY_DESCR.get(name)
    if descr is None:
        raise CkptError(f"--save: dtype {name} has no .npy equivalent; save as .pt")
    tensor = tensor.contiguous()
    shape = tuple(tensor.shape)
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"  # total header size a multiple of 64
    head = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin1")
    data = ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()) if tensor.numel() else b""
    return head + data, note


def save_tensor(tensor: Any, path: Path, force: bool) -> str | None:
    """Write ``tensor`` to ``path`` (.pt: torch.save; .npy: numpy format); returns a note or None."""
    suffix = path.suffix.lower()
    if suffix not in (".pt", ".npy"):
        raise CkptError(f"--save {path}: give a .pt or .npy file name")
    if path.exists() and not force:
        raise CkptError(f"{path}: exists (use --force to replace it)")
    note = None
    if suffix == ".pt":
        import torch

        buf = io.BytesIO()
        torch.save(tensor.clone(), buf)
        data = buf.getvalue()
    else:
        data, note = npy_bytes(tensor)
    try:
        write_atomic(path, data)
    except OSError as exc:
        raise CkptError(f"{exc.filename or path}: cannot write ({exc.strerror})") from None
    return note
