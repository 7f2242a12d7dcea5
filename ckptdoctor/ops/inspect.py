"""``ckptdoctor inspect``: what a checkpoint is, from metadata only."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ckptdoctor.arg_rules import check_args
from ckptdoctor.args import summarize_args
from ckptdoctor.checkpoint import SECTIONS, Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.run_config import RUN_CONFIG
from ckptdoctor.formats.te_extra_state import module_of
from ckptdoctor.formats.train_state import BRIDGE_TRACKER_NAME, has_bridge_tracker, read_train_state_step
from ckptdoctor.locate import CheckpointLocation
from ckptdoctor.logical_items import logical_key
from ckptdoctor.parallelism import infer_layout
from ckptdoctor.pickle.plain import OMIT_NONE
from ckptdoctor.rules.extra_state import census

SCHEMA = "ckptdoctor.inspect/1"


@dataclass
class KeyRow:
    key: str
    section: str
    kind: str
    dtype: str | None
    shape: list[int] | None
    chunks: int
    bytes: int


@dataclass
class InspectReport:
    schema: str
    path: str
    iteration_dir: str
    save_dir: str | None
    tracker: dict | None
    iteration: int | None
    release: bool
    format: dict
    data_files: dict
    sections: dict[str, dict]
    layout: dict
    args: dict | None
    common_state_keys: list[str]
    keys: list[KeyRow] | None = field(default=None)
    # saved args that contradict the checkpoint's parallelism (the rule table fix-args and check use)
    arg_findings: list[dict] = field(default_factory=list)
    # "run_config.yaml" where no args are saved and ``args`` shows Megatron-Bridge's model config instead
    args_source: str | None = None
    # globals of .metadata and the common state off the allowlist, read here as inert stand-ins (check's gate fails
    # on them; absent from JSON where there are none)
    stand_ins_read: list[str] | None = field(default=None, metadata=OMIT_NONE)
    # --extra-state: the census of the Transformer Engine _extra_state items
    extra_state: ExtraStateCensus | None = field(default=None, metadata=OMIT_NONE)


@dataclass
class ExtraStateRow:
    """Items of one module (layers together) that agree in generation, form, recipe, FP8 and history length."""

    module: str
    generation: str
    form: str
    recipe: str | None
    fp8: bool
    amax_history_len: int | None
    te_2_18: str
    needed: bool
    count: int


@dataclass
class ExtraStateCensus:
    items: int
    unreadable: int  # refused by the gate or damaged (check reports them)
    generations: dict[str, int]
    recipes: dict[str, int]
    fp8_on: int
    fp8_off: int
    te_2_18_refused: int  # TE 2.16.1, 2.17.1, >= 2.18 refuse these without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1
    redundant: int  # no amax_history_fwd / scale_fwd / scale_bwd: dropped by --drop-redundant-extra-state
    rows: list[ExtraStateRow]


def extra_state_census(checkpoint: Checkpoint) -> ExtraStateCensus:
    """Every ``_extra_state`` item read (a few KB each) and counted: by generation, recipe, FP8 and module."""
    items = census(checkpoint)
    read = [(i.key, i.state) for i in items if i.state is not None]
    rows: Counter[tuple[str, str, str, str | None, bool, int | None, str, bool]] = Counter()
    for key, state in read:
        history = state.recipe_fields.get("amax_history_len")
        if history is None and "amax_history_fwd" in state.tensors:
            history = state.tensors["amax_history_fwd"][0]
        if not isinstance(history, int) or isinstance(history, bool):  # a field of a stranger's pickle
            history = None
        row = (
            module_of(key),
            state.generation,
            state.form,
            state.recipe,
            state.fp8,
            history,
            state.te_2_18,
            state.needed,
        )
        rows[row] += 1
    states = [s for _, s in read]
    return ExtraStateCensus(
        items=len(items),
        unreadable=len(items) - len(read),
        generations=dict(sorted(Counter(s.generation for s in states).items())),
        recipes=dict(sorted(Counter(s.recipe for s in states if s.recipe is not None).items())),
        fp8_on=sum(s.fp8 for s in states),
        fp8_off=sum(not s.fp8 for s in states),
        te_2_18_refused=sum(s.te_2_18 == "refuse" for s in states),
        redundant=sum(not s.needed for s in states),
        rows=[ExtraStateRow(*row, n) for row, n in sorted(rows.items(), key=lambda kv: str(kv[0]))],
    )


def inspect_checkpoint(checkpoint: Checkpoint, with_keys: bool = False, key_filter: str | None = None) -> InspectReport:
    location = checkpoint.location
    sections: dict[str, dict] = {
        s: {"keys": 0, "tensors": 0, "bytes_items": 0, "entries": 0, "parameters": 0, "bytes": 0} for s in SECTIONS
    }
    objects: set[str] = set()
    for entry in checkpoint.entries.values():
        totals = sections[entry.section]
        totals["entries"] += 1
        if entry.kind == "tensor":
            totals["tensors"] += 1
        else:
            key = logical_key(entry.key, entry.kind)
            if key not in objects:  # an object's shards count once, as in diff
                objects.add(key)
                totals["bytes_items"] += 1
        totals["parameters"] += entry.numel
        totals["bytes"] += entry.nbytes
    for totals in sections.values():
        totals["keys"] = totals["tensors"] + totals["bytes_items"]

    common = checkpoint.common_state()
    args = common.get("args")
    config, where = checkpoint.saved_config()
    saved = infer_layout(checkpoint)
    layout = saved.as_dict()
    dcp = checkpoint.dcp
    report = InspectReport(
        schema=SCHEMA,
        path=str(location.input_path),
        iteration_dir=str(location.iteration_dir),
        save_dir=None if location.save_dir is None else str(location.save_dir),
        tracker=_tracker(location),
        iteration=location.iteration if location.iteration is not None else common.get("iteration"),
        release=location.release,
        format={
            "backend": location.backend,
            "era": location.era,
            "metadata_json": location.metadata_json,
            "dcp_version": None if dcp is None else dcp.version,
            "metadata_class": None if dcp is None else dcp.metadata_class,
            "common_source": checkpoint.common_source,
            "checkpoint_version": common.get("checkpoint_version"),
            "flavour": location.flavour,
        },
        data_files={
            "count": len(checkpoint.data_files),
            "bytes": sum(checkpoint.data_files.values()),
            # referenced by the index but not on disk (a half-written save: check says CKD113)
            "missing": sorted(checkpoint.referenced_files() - set(checkpoint.data_files)),
        },
        sections=sections,
        layout=layout,
        args=summarize_args(config) if where == RUN_CONFIG else summarize_args(args) if args is not None else None,
        args_source=where if where == RUN_CONFIG else None,
        common_state_keys=sorted(str(k) for k in common),
    )
    report.stand_ins_read = checkpoint.untrusted_globals_read() or None
    if where is not None:  # the saved args, or Megatron-Bridge's run_config.yaml model section in their place
        report.arg_findings = [
            {
                "code": f.code,
                "arg": f.arg,
                "saved": f.saved,
                "correct": f.correct,
                "severity": f.severity,
                "reason": f.reason,
            }
            for f in check_args(config, saved)
        ]
    if with_keys:
        pattern = re.compile(key_filter) if key_filter else None
        report.keys = [
            KeyRow(
                e.key, e.section, e.kind, e.dtype, None if e.shape is None else list(e.shape), len(e.chunks), e.nbytes
            )
            for e in sorted(checkpoint.entries.values(), key=lambda e: (SECTIONS.index(e.section), e.key))
            if pattern is None or pattern.search(e.key)
        ]
    return report


def _tracker(location: CheckpointLocation) -> dict | None:
    """The text tracker's path and value; ``bridge``: the step of Megatron-Bridge's ``latest_train_state.pt`` where
    the save dir has one (Bridge resumes from it, not from the text tracker), ``"unreadable"`` where it does not
    read."""
    if location.tracker_path is None:
        return None
    tracker: dict = {"path": str(location.tracker_path), "value": location.tracker_value}
    save_dir = location.save_dir
    if location.tracker_path.name == BRIDGE_TRACKER_NAME:  # the one followed (no text tracker): read already
        tracker["bridge"] = location.tracker_value
    elif isinstance(save_dir, Path) and has_bridge_tracker(save_dir):
        try:
            tracker["bridge"] = str(read_train_state_step(save_dir / BRIDGE_TRACKER_NAME))
        except CkptError:
            tracker["bridge"] = "unreadable"
    return tracker
