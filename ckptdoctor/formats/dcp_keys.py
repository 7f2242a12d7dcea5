"""Rename and drop keys inside a ``.metadata`` object (safe-pickle stand-ins) without touching any data file.

A DCP key appears in several places of one ``.metadata``: ``state_dict_metadata`` (key -> tensor or bytes
metadata), ``storage_data`` (``MetadataIndex(fqn, offset)`` -> ``_StorageInfo``), ``planner_data`` (None for
Megatron), and Megatron's extras: ``mcore_data`` (key -> dict, core 0.14-0.15, on the object and on each
plan) and ``all_local_plans`` (each rank's ``SavePlan``, whose ``WriteItem.index`` names the key). Every
place is edited, so no reader finds a key the others do not list. The chunk grid travels with the key:
a renamed key keeps its ``TensorStorageMetadata`` object and every storage entry, only the name changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckptdoctor.formats import torch_dist
from ckptdoctor.formats.dcp_writer import restrict_metadata


def _renamed_dict(mapping: dict, renames: dict[str, str]) -> None:
    """Rename keys of ``mapping`` in place, keeping their order."""
    if not any(k in renames for k in mapping):
        return
    items = [(renames.get(k, k), v) for k, v in mapping.items()]
    mapping.clear()
    mapping.update(items)


def _renamed_paths(planner_data: Any, renames: dict[str, str]) -> None:
    """A plain DCP save's flattening map (key -> its path in the nested state dict, which ``dcp_to_torch_save``
    and ``_load_state_dict_from_keys`` unflatten by): a renamed key gets the path of its new name, under the same
    top-level entry where the new name still starts with it (``model.a.w`` -> ``model.b.w``: ``('model', 'b.w')``),
    else as a top-level entry of its own."""
    if not isinstance(planner_data, dict):
        return
    for new in renames.values():
        path = planner_data.get(new)
        if not isinstance(path, tuple) or ".".join(map(str, path)) == new:
            continue
        head = path[0] if path and isinstance(path[0], str) else None
        planner_data[new] = (head, new[len(head) + 1 :]) if head and new.startswith(f"{head}.") else (new,)


def _rename_index(index: Any, renames: dict[str, str], seen: set[int]) -> None:
    """Rename one ``MetadataIndex`` record (shared records, once); records hash by identity, so a dict
    keyed by them stays valid."""
    if id(index) in seen or not hasattr(index, "__dict__"):
        return
    seen.add(id(index))
    fqn = index.__dict__.get("fqn")
    if isinstance(fqn, str) and fqn in renames:
        index.__dict__["fqn"] = renames[fqn]


def _plans(metadata: Any) -> list[Any]:
    plans = torch_dist.record_attr(metadata, "all_local_plans")
    return plans if isinstance(plans, list) else []


def rename_metadata(metadata: Any, renames: dict[str, str]) -> None:
    """Rename every occurrence of each ``renames`` key (old -> new) in a ``.metadata`` object, in place."""
    if not renames:
        return
    _renamed_dict(torch_dist.record_attr(metadata, "state_dict_metadata"), renames)
    seen: set[int] = set()
    for index in torch_dist.storage_items(metadata):
        _rename_index(index, renames, seen)
    for holder in [metadata, *_plans(metadata)]:
        for name in ("planner_data", "mcore_data"):
            value = torch_dist.record_attr(holder, name)
            if isinstance(value, dict):
                _renamed_dict(value, renames)
    _renamed_paths(torch_dist.record_attr(metadata, "planner_data"), renames)
    for plan in _plans(metadata):
        items = torch_dist.record_attr(plan, "items")
        for item in items if isinstance(items, list) else []:
            _rename_index(torch_dist.record_attr(item, "index"), renames, seen)


def edit_metadata(metadata: Any, keep: Iterable[str], renames: dict[str, str]) -> None:
    """Keep only the ``keep`` keys (also in ``mcore_data``), then apply ``renames`` (old -> new)."""
    keep = set(keep)
    restrict_metadata(metadata, keep)
    for holder in [metadata, *_plans(metadata)]:
        mcore_data = torch_dist.record_attr(holder, "mcore_data")
        if isinstance(mcore_data, dict):
            for key in [k for k in mcore_data if k not in keep]:
                del mcore_data[key]
    rename_metadata(metadata, renames)
