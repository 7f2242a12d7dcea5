"""``ckptdoctor edit``, planning half: which keys a checkpoint loses or is renamed to, checked before writing.

Operations, applied to every key of the source ``.metadata``:

* removals: ``--remove REGEX`` (``re.search`` on the key), ``--drop-section optimizer|rng|rerun``,
  ``--drop-extra-state`` (every ``_extra_state`` item), ``--drop-redundant-extra-state`` (the ``_extra_state``
  items without delayed-scaling state, Megatron-LM #5552's rule: read, a few KB each);
* renames: ``--rename REGEX REPLACEMENT`` (``re.sub``, applied in the order given, each to the result of the
  one before, like ``sed -e ... -e ...``) and the presets below; removed keys are not renamed.

Renames are simultaneous: ``A -> B`` is allowed when ``B`` is itself renamed or removed. Refused before anything
is written: an invalid regex, two keys renamed to one, a rename onto a key that stays, a bytes item whose
``/shard_<offsets>_<shape>`` suffix would change (Megatron derives it from the object's place in the grid),
a rename out of its section (a model key cannot become an optimizer key), removing the common state, an edit
that removes every model key, and an edit that changes nothing.

Dropping a whole section also edits the common state the way a Megatron save without that section looks
(``--no-save-optim`` / ``--no-save-rng``), and :func:`load_flags` says which Megatron-LM load flags the
result needs (read from ``megatron/training/checkpointing.py`` of Megatron-LM core_v0.19 and verified with
real loads in ``tests/test_edit_mcore.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptdoctor.checkpoint import Checkpoint, section_of
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import BACKEND_DCP
from ckptdoctor.formats.plain_dcp import is_megatron
from ckptdoctor.logical_items import logical_key
from ckptdoctor.ops.edit.presets import PRESET_NAMES, preset_renames
from ckptdoctor.ops.rewrite.request import CommonChange, dir_bytes
from ckptdoctor.rules.extra_state import census

SCHEMA = "ckptdoctor.edit/1"
SECTIONS = ("optimizer", "rng", "rerun")

_SHARD_SUFFIX_RE = re.compile(r"/shard_[0-9.]+_[0-9.]+$")


@dataclass
class EditRequest:
    removes: list[str] = field(default_factory=list)
    renames: list[tuple[str, str]] = field(default_factory=list)
    drop_sections: list[str] = field(default_factory=list)
    drop_extra_state: bool = False
    drop_redundant_extra_state: bool = False
    preset: str | None = None


@dataclass(slots=True)  # one per removed or renamed key (hundreds of thousands), reasons shared
class KeyChange:
    key: str
    action: str  # "remove" | "rename"
    section: str
    kind: str
    bytes: int
    new_key: str | None = None
    reason: str = ""


@dataclass
class EditPlan:
    schema: str
    source: str
    iteration_dir: str
    removed: list[KeyChange]
    renamed: list[KeyChange]
    kept_keys: int  # logical keys (a ShardedObject's shards are one key)
    kept_entries: int  # DCP entries (each shard of an object its own)
    common_changes: list[CommonChange]
    load_flags: list[str]  # Megatron-LM flags the result needs (empty and no notes: a plain load works)
    load_notes: list[str]
    bytes_before: int
    bytes_kept: int  # data bytes of the kept items (what --compact copies)
    dropped_sections: list[str] = field(default_factory=list)

    def keep_keys(self, checkpoint: Checkpoint) -> set[str]:
        removed = {c.key for c in self.removed}
        return {k for k in checkpoint.entries if k not in removed}

    @property
    def rename_map(self) -> dict[str, str]:
        return {c.key: c.new_key for c in self.renamed if c.new_key is not None}


def _compile(pattern: str, option: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise CkptError(f"{option}: invalid regex {pattern!r}: {exc}") from None


def _rename_rules(request: EditRequest) -> list[tuple[re.Pattern[str], str, str]]:
    rules = [(_compile(p, "--rename"), r, f"--rename {p} {r}") for p, r in request.renames]
    for pattern, replacement, option in rules:
        try:
            pattern.sub(replacement, "")  # a bad group reference in the replacement fails here, not mid-plan
        except (re.error, IndexError) as exc:
            raise CkptError(f"{option}: invalid replacement ({exc})") from None
    return rules


_REDUNDANT = "--drop-redundant-extra-state"


def redundant_extra_state(checkpoint: Checkpoint) -> tuple[set[str], list[str]]:
    """The ``_extra_state`` items Megatron-LM's ``--ckpt-drop-redundant-extra-state`` would not save: none of
    ``amax_history_fwd``, ``scale_fwd``, ``scale_bwd`` in them (no FP8, stateless recipes, Megatron's local spec);
    and the logical keys kept whole because some of their shards are needed. A ShardedObject is dropped whole or
    not at all: megatron-core 0.19.2 drops an unexpected key from the load request only when none of its shards
    is saved (a key with shard_0_2 saved and shard_1_2 dropped fails "Missing key in checkpoint state_dict"
    under every strictness; verified in tests/test_edit_mcore.py). An item that cannot be read counts as needed
    (the write gate refuses a hostile one)."""
    shards: dict[str, list[tuple[str, bool]]] = {}
    for item in census(checkpoint):
        redundant = item.state is not None and not item.state.needed
        shards.setdefault(item.key.split("/", 1)[0], []).append((item.key, redundant))
    drop: set[str] = set()
    partial: list[str] = []
    for key, items in sorted(shards.items()):
        if all(redundant for _, redundant in items):
            drop.update(k for k, _ in items)
        elif any(redundant for _, redundant in items):
            partial.append(key)
    return drop, partial


_DROP_REASONS = {section: f"--drop-section {section}" for section in SECTIONS}


def _removal_reason(
    key: str,
    section: str,
    is_extra: bool,
    request: EditRequest,
    removes: list[tuple[re.Pattern[str], str]],
    redundant: set[str] = frozenset(),  # type: ignore[assignment]
) -> str | None:
    """Why ``key`` is removed (None: it is not); one string per reason, shared by every key it removes."""
    if section in request.drop_sections:
        return _DROP_REASONS[section]
    if request.drop_extra_state and is_extra:
        return "--drop-extra-state"
    if key in redundant:
        return _REDUNDANT
    for pattern, reason in removes:
        if pattern.search(key):
            return reason
    return None


def _new_name(key: str, rules: list[tuple[re.Pattern[str], str, str]]) -> tuple[str, list[str]]:
    name, used = key, []
    for pattern, replacement, option in rules:
        try:
            renamed = pattern.sub(replacement, name)
        except (re.error, IndexError) as exc:
            raise CkptError(f"{option}: cannot rename {name!r} ({exc})") from None
        if renamed != name:
            name = renamed
            used.append(option)
    return name, used


def _check_rename(key: str, new: str, kind: str) -> None:
    if section_of(key) == "common":
        raise CkptError(f"rename of {key!r}: the common state keeps its key (Megatron reads it by name)")
    if not new:
        raise CkptError(f"rename of {key!r} gives an empty key; nothing written")
    if section_of(new) != section_of(key):
        raise CkptError(
            f"rename {key!r} -> {new!r} moves the key from the {section_of(key)} section to the "
            f"{section_of(new)} section; nothing written"
        )
    if kind != "tensor":
        old_suffix, new_suffix = _SHARD_SUFFIX_RE.search(key), _SHARD_SUFFIX_RE.search(new)
        if old_suffix is not None and (new_suffix is None or new_suffix.group(0) != old_suffix.group(0)):
            raise CkptError(
                f"rename {key!r} -> {new!r} changes the bytes item's shard suffix "
                f"{old_suffix.group(0)!r} (its place in the object grid); rename only the part before it"
            )


def _check_collisions(renamed: list[KeyChange], kept: set[str]) -> None:
    targets: dict[str, str] = {}
    for change in renamed:
        assert change.new_key is not None
        other = targets.setdefault(change.new_key, change.key)
        if other != change.key:
            raise CkptError(
                f"renames map two keys to {change.new_key!r}: {other!r} and {change.key!r}; nothing written"
            )
    staying = kept - {c.key for c in renamed}
    for change in renamed:
        if change.new_key in staying:
            raise CkptError(
                f"rename {change.key!r} -> {change.new_key!r} collides with an existing key that stays; "
                "remove or rename that key too"
            )


def plan_edit(checkpoint: Checkpoint, request: EditRequest) -> EditPlan:
    """Every key change and common-state change of ``request``; refuses (CkptError) a bad or empty edit."""
    bad = [s for s in request.drop_sections if s not in SECTIONS]
    if bad:
        raise CkptError(
            f"--drop-section {bad[0]}: not a section that can be dropped (choose from {', '.join(SECTIONS)})"
        )
    if request.preset is not None and request.preset not in PRESET_NAMES:
        raise CkptError(f"--preset {request.preset}: unknown preset (choose from {', '.join(PRESET_NAMES)})")
    removes = [(_compile(p, "--remove"), f"--remove {p}") for p in request.removes]
    rules = _rename_rules(request)
    redundant, partial = redundant_extra_state(checkpoint) if request.drop_redundant_extra_state else (set(), [])
    removed: list[KeyChange] = []
    renamed: list[KeyChange] = []
    kept: set[str] = set()
    new_names: dict[str, tuple[str, list[str]]] = {}  # kept key -> its name after the --rename rules, and theirs
    scheduler_goes = "optimizer" in request.drop_sections and _megatron_plain_dcp(checkpoint)
    for key in sorted(checkpoint.entries):
        entry = checkpoint.entries[key]
        why = _removal_reason(key, entry.section, entry.is_extra_state, request, removes, redundant)
        if why is None and scheduler_goes and key.split(".", 1)[0] == _SCHEDULER:
            why = _DROP_REASONS["optimizer"]  # a --no-save-optim save has neither: generate_state_dict
        if why is not None:
            if entry.section == "common":
                raise CkptError(f"{why} would remove the common state {key!r} (args, iteration); nothing written")
            removed.append(KeyChange(key, "remove", entry.section, entry.kind, entry.nbytes, reason=why))
            continue
        kept.add(key)
        new_names[key] = _new_name(key, rules) if rules else (key, [])
    # the preset, after the --rename rules, sees the kept keys' names as they then are (its renames depend on
    # which other keys a layer has: edit_presets)
    presets = preset_renames(request.preset, (n for n, _ in new_names.values())) if request.preset else {}
    for key, (new, used) in new_names.items():
        if new in presets:
            new, used = presets[new], [*used, f"--preset {request.preset}"]
        if new != key:
            entry = checkpoint.entries[key]
            _check_rename(key, new, entry.kind)
            renamed.append(KeyChange(key, "rename", entry.section, entry.kind, entry.nbytes, new, ", ".join(used)))
    _check_collisions(renamed, kept)
    where = checkpoint.iteration_dir
    if not removed and not renamed:
        raise CkptError(f"{where}: the edit matches no key; nothing to change, nothing written")
    had_model = any(e.section == "model" for e in checkpoint.entries.values())
    if had_model and not any(checkpoint.entries[k].section == "model" for k in kept):
        raise CkptError(f"{where}: the edit removes every model key; nothing written")
    dropped = _whole_sections(checkpoint, removed)
    flags, notes = load_flags(checkpoint, removed, dropped, renamed)
    if partial:
        notes.append(
            f"--drop-redundant-extra-state kept {len(partial)} _extra_state key(s) whole whose other shards hold "
            f"delayed-scaling state ({', '.join(partial[:3])}{' ...' if len(partial) > 3 else ''}): a key with some "
            "shards dropped does not load"
        )
    return EditPlan(
        schema=SCHEMA,
        source=str(checkpoint.location.input_path),
        iteration_dir=str(where),
        removed=removed,
        renamed=renamed,
        kept_keys=len({logical_key(k, checkpoint.entries[k].kind) for k in kept}),
        kept_entries=len(kept),
        common_changes=common_changes(checkpoint, dropped),
        load_flags=flags,
        load_notes=notes,
        bytes_before=dir_bytes(where),
        bytes_kept=sum(checkpoint.entries[k].nbytes for k in kept),
        dropped_sections=dropped,
    )


_SCHEDULER = "opt_param_scheduler"
_PLAIN_DCP_ARGS = "as a --no-save-{} run saves it, in the state dict's args item, which a torch_dcp load reads first"


def _megatron_plain_dcp(checkpoint: Checkpoint) -> bool:
    """Megatron-LM's torch_dcp / fsdp_dtensor save: args and the scheduler are top-level items of the DCP state
    dict (no common state beside it)."""
    return checkpoint.location.backend == BACKEND_DCP and is_megatron(checkpoint.flavour)


def _whole_sections(checkpoint: Checkpoint, removed: list[KeyChange]) -> list[str]:
    """Sections (optimizer, rng, rerun) the edit removes entirely."""
    gone = {c.key for c in removed}
    out = []
    for section in SECTIONS:
        keys = [k for k, e in checkpoint.entries.items() if e.section == section]
        if keys and all(k in gone for k in keys):
            out.append(section)
    return out


# --- the common state and the load flags ----------------------------------------------------------------


def _common(checkpoint: Checkpoint) -> dict:
    try:
        return checkpoint.common_state()
    except CkptError:
        return {}


def common_changes(checkpoint: Checkpoint, dropped: list[str]) -> list[CommonChange]:
    """The common state as Megatron-LM saves it without the dropped sections (``generate_state_dict``:
    no ``optimizer`` / ``opt_param_scheduler`` under ``--no-save-optim``, no ``rng_state`` under
    ``--no-save-rng``, no ``rerun_state_machine`` without rerun state), args recording it. In a Megatron-LM
    plain DCP save (torch_dcp, fsdp_dtensor) only the args change: they are the state dict's ``args`` item, and
    the scheduler's items go with the optimizer's (:func:`plan_edit`)."""
    if checkpoint.location.backend == BACKEND_DCP and not is_megatron(checkpoint.flavour):
        return []  # FSDP2 / TorchTitan, generic: no saved args, the state dict is all there is
    common = _common(checkpoint)
    args = common.get("args")
    changes: list[CommonChange] = []

    def set_arg(name: str, reason: str) -> None:
        if args is not None and hasattr(args, "__dict__") and getattr(args, name, None) is not True:
            changes.append(CommonChange("set-arg", name, getattr(args, name, None), True, reason))

    if "optimizer" in dropped:
        for name in ("optimizer", "opt_param_scheduler"):
            if name in common:
                changes.append(CommonChange("drop", name, reason="optimizer leftovers; no optimizer state is saved"))
        content = common.get("content_metadata")
        if isinstance(content, dict) and "distrib_optim_sharding_type" in content:
            changes.append(
                CommonChange(
                    "drop-content-metadata",
                    "distrib_optim_sharding_type",
                    content["distrib_optim_sharding_type"],
                    None,
                    "describes optimizer state that is no longer there",
                )
            )
        why = "as a --no-save-optim run saves it; load_checkpoint then builds no optimizer request"
        set_arg("no_save_optim", _PLAIN_DCP_ARGS.format("optim") if _megatron_plain_dcp(checkpoint) else why)
    if "rng" in dropped:
        why = "as a --no-save-rng run saves it; a load then neither requests nor restores rng state"
        set_arg("no_save_rng", _PLAIN_DCP_ARGS.format("rng") if _megatron_plain_dcp(checkpoint) else why)
    if "rerun" in dropped and "rerun_state_machine" in common:
        why = "a load requests rerun state only when the common state has it"
        changes.append(CommonChange("drop", "rerun_state_machine", reason=why))
    return changes


def load_flags(
    checkpoint: Checkpoint, removed: list[KeyChange], dropped: list[str], renamed: Sequence[KeyChange] = ()
) -> tuple[list[str], list[str]]:
    """The Megatron-LM load flags the edited checkpoint needs, and why (megatron/training/checkpointing.py)."""
    flags: list[str] = []
    notes: list[str] = []
    if checkpoint.location.backend == BACKEND_DCP and not is_megatron(checkpoint.flavour):
        return flags, notes  # FSDP2 / TorchTitan: the loader asks only for what its state dict holds
    sections = {c.section for c in removed}
    if checkpoint.location.release and sections & {"optimizer", "rng"}:
        # load_checkpoint requests neither the optimizer nor the rng state of a release checkpoint
        notes.append("a release checkpoint: load_checkpoint restores neither its optimizer nor its rng state")
        sections -= {"optimizer", "rng"}
    if "optimizer" in sections:
        flags.append("--no-load-optim")
        notes.append(
            "--no-load-optim (or --finetune, which also resets the iteration and LR schedule): load_checkpoint "
            "restores the optimizer unless told not to, even when the saved args say no_save_optim"
        )
    if "rng" in sections and "rng" not in dropped:
        flags.append("--no-load-rng")
        notes.append("--no-load-rng (or --finetune): part of the rng state was removed")
    elif "rng" in dropped:
        notes.append("rng state dropped: the saved args say no_save_rng, so a load neither requests nor restores it")
    if "rerun" in sections and "rerun" not in dropped:
        notes.append("part of the rerun state was removed: load at another world size or with --finetune")
    if any(c.reason == _REDUNDANT for c in removed):
        notes.append(
            "redundant _extra_state items dropped (no delayed-scaling FP8 state in them: a module loads the same "
            "without them, under the run's own recipe): megatron-core 0.19.2 still requests every _extra_state "
            "at load, so load with --dist-ckpt-strictness log_unexpected (or a Megatron-LM whose load accepts "
            "the missing non-persistent extra state of --ckpt-drop-redundant-extra-state)"
        )
    if _megatron_plain_dcp(checkpoint) and sections & {"optimizer", "rng"}:
        notes.append(
            "Megatron-LM core_v0.19's torch_dcp load asks DCP for optimizer, opt_param_scheduler and rng_state "
            "whatever the flags say (load_checkpoint's torch_dcp request), and DCP refuses a missing key: "
            "load this save with a state dict that does not request them (torch.distributed.checkpoint.load)"
        )
    if "model" in sections:
        notes.append(
            "model keys removed: a model whose load requests them fails under the default strictness; load "
            "with a model that does not have them, or --dist-ckpt-strictness log_unexpected if they may stay fresh"
        )
    if any(c.section == "model" for c in renamed):
        notes.append(
            "model keys renamed: the model that saved this checkpoint requests the old names, and its load fails "
            "under the default strictness; load with a model whose modules have the new names"
        )
    return flags, notes
