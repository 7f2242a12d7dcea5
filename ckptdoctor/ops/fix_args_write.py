"""Writing fixed args: O(metadata) work, no tensor byte rewritten, every step crash-safe.

* core <= 0.18: the common state is ``common.pt``; it is replaced atomically.
* core >= 0.19: the common state is the DCP bytes item ``common_state/shard_0_1`` inside a ``.distcp``
  file shared with tensors. Rewriting that file would touch tensor bytes, so the new common state goes to
  a new small data file and ``.metadata`` is atomically repointed to it; the old bytes stay, unreferenced.
* Megatron-Bridge's ``run_config.yaml`` and Megatron's ``integrity.json`` (sha256 manifest) are kept
  consistent with the files that changed.

``--output`` builds a new checkpoint dir: unchanged files are hard-linked (or copied), never modified;
``metadata.json`` and the tracker come last, as Megatron marks a save complete. ``--in-place`` keeps every
replaced file as ``<name>.bak-<timestamp>`` (hard link) before swapping in the new one.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor.atomic import (
    backup_file,
    fault_point,
    link_or_copy,
    prepare_output_dir,
    timestamp,
    write_atomic,
)
from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats import torch_dist
from ckptdoctor.formats.torch_dist import StorageLocation
from ckptdoctor.formats.torch_zip import dump_torch_zip
from ckptdoctor.layout import TRACKER_NAME
from ckptdoctor.ops.fix_args import ArgChange, fixed_common_state

RUN_CONFIG = "run_config.yaml"
INTEGRITY = "integrity.json"


@dataclass
class WriteResult:
    mode: str  # "output" or "in-place"
    iteration_dir: str
    written: list[str] = field(default_factory=list)
    backups: list[str] = field(default_factory=list)
    linked: int = 0
    copied: int = 0
    run_config_args: list[str] = field(default_factory=list)
    integrity_updated: bool = False


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def updated_run_config(text: str, changes: list[ArgChange]) -> tuple[str, list[str]]:
    """``run_config.yaml`` with each changed arg's ``name: old`` lines set to the new value.

    Line-based on purpose: no YAML dependency, and comments, order and formatting survive. Only lines
    whose current value equals the saved arg are touched.
    """
    updated: list[str] = []
    lines = text.splitlines(keepends=True)
    for change in changes:
        pattern = re.compile(rf"^(\s*{re.escape(change.arg)}:\s*)([^#\n]*?)(\s*(#.*)?)(\r?\n)?$")
        old_values = {_yaml_scalar(change.old)} | ({"~", ""} if change.old is None else set())
        for i, line in enumerate(lines):
            match = pattern.match(line)
            if match and match.group(2).strip().strip("'\"") in old_values:
                lines[i] = (match.group(1) + _yaml_scalar(change.new) + (match.group(3) or "")
                            + (match.group(5) or ""))
                if change.arg not in updated:
                    updated.append(change.arg)
    return "".join(lines), updated


def _new_files(checkpoint: Checkpoint, changes: list[ArgChange], stamp: str) -> tuple[dict[str, bytes], str]:
    """Relative path -> new content for every file the fix replaces or adds; and the new data file (if any)."""
    common = fixed_common_state(checkpoint, changes)
    files: dict[str, bytes] = {}
    new_data_file = ""
    source = checkpoint.common_source
    if source == "common.pt":
        files["common.pt"] = dump_torch_zip(common)
    elif source is not None:
        # Megatron writes ShardedObjects as torch.save([obj]).
        new_data_file = f"common_state.fixargs-{stamp}.distcp"
        payload = dump_torch_zip([common])
        metadata = torch_dist.load_metadata_object(checkpoint.iteration_dir / ".metadata")
        repointed = 0
        for index, info in torch_dist.storage_items(metadata).items():
            if torch_dist.index_fqn(index) == source:
                torch_dist.set_storage(info, StorageLocation(new_data_file, 0, len(payload)))
                repointed += 1
        if repointed != 1:
            raise CkptError(f"{checkpoint.iteration_dir / '.metadata'}: expected one storage entry for {source}, "
                            f"found {repointed}")
        files[new_data_file] = payload
        files[".metadata"] = torch_dist.dump_metadata_object(metadata)
    else:
        raise CkptError(f"{checkpoint.iteration_dir}: no common state to rewrite")
    return files, new_data_file


def _side_files(iteration_dir: Path, changes: list[ArgChange], files: dict[str, bytes],
                result: WriteResult) -> None:
    """run_config.yaml and integrity.json updates, computed from the new file contents."""
    run_config = iteration_dir / RUN_CONFIG
    if run_config.is_file():
        text = run_config.read_text(encoding="utf-8")
        new_text, updated = updated_run_config(text, changes)
        if updated:
            files[RUN_CONFIG] = new_text.encode("utf-8")
            result.run_config_args = updated
    integrity = iteration_dir / INTEGRITY
    if integrity.is_file():
        try:
            manifest = json.loads(integrity.read_text(encoding="utf-8"))
            listed = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CkptError(f"{integrity}: unreadable integrity manifest ({exc})") from None
        for name, data in files.items():
            listed[name] = hashlib.sha256(data).hexdigest()
        files[INTEGRITY] = (json.dumps(manifest, indent=2)).encode("utf-8")
        result.integrity_updated = True


# Order matters for crash safety: data first, then the index that points to it, side files last.
_WRITE_ORDER = ("common_state", "common.pt", ".metadata", RUN_CONFIG, INTEGRITY)


def _step(name: str) -> str:
    """A stable name for a write step (the new data file's name carries a timestamp)."""
    return "common_state" if name.startswith("common_state.") else name


def _ordered(files: dict[str, bytes]) -> list[str]:
    def rank(name: str) -> int:
        return next((i for i, prefix in enumerate(_WRITE_ORDER) if name.startswith(prefix)), len(_WRITE_ORDER))

    return sorted(files, key=rank)


def write_in_place(checkpoint: Checkpoint, changes: list[ArgChange]) -> WriteResult:
    iteration_dir = checkpoint.iteration_dir
    stamp = timestamp()
    result = WriteResult("in-place", str(iteration_dir))
    files, _ = _new_files(checkpoint, changes, stamp)
    _side_files(iteration_dir, changes, files, result)
    for name in _ordered(files):
        target = iteration_dir / name
        if target.exists():
            result.backups.append(str(backup_file(target, stamp)))
            fault_point(f"backup:{_step(name)}")
        write_atomic(target, files[name])
        result.written.append(str(target))
        fault_point(f"write:{_step(name)}")
    return result


def write_output(checkpoint: Checkpoint, changes: list[ArgChange], output: Path, force: bool = False) -> WriteResult:
    location = checkpoint.location
    prepare_output_dir(output, force=force)
    if location.save_dir is not None:
        iteration_dir = output / location.iteration_dir.name
        iteration_dir.mkdir(exist_ok=True)
    else:
        iteration_dir = output
    result = WriteResult("output", str(iteration_dir))
    files, _ = _new_files(checkpoint, changes, timestamp())
    _side_files(location.iteration_dir, changes, files, result)

    # Unchanged files first, then the new ones, then metadata.json and the tracker: Megatron's own
    # completeness markers come last, so an interrupted write never looks like a complete checkpoint.
    completeness_marker = location.iteration_dir / "metadata.json"
    for path in sorted(p for p in location.iteration_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(location.iteration_dir)
        if str(relative) in files or path == completeness_marker:
            continue
        dest = iteration_dir / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        how = link_or_copy(path, dest)
        result.linked += how == "linked"
        result.copied += how == "copied"
    fault_point("links")
    for name in _ordered(files):
        write_atomic(iteration_dir / name, files[name])
        result.written.append(str(iteration_dir / name))
        fault_point(f"write:{_step(name)}")
    link_or_copy(completeness_marker, iteration_dir / "metadata.json")
    if location.save_dir is not None:
        value = "release" if location.release else str(location.iteration)
        write_atomic(output / TRACKER_NAME, value.encode())
        result.written.append(str(output / TRACKER_NAME))
    return result
