"""A Hugging Face model dir as files: ``config.json``, the weight index and every shard's safetensors header.

Reads no tensor data and needs neither torch nor transformers. The weights are ``model.safetensors.index.json``
(its ``weight_map``: tensor name -> shard file) with its shards, or one ``model.safetensors``. A shard whose header
cannot be read is kept as its error, so that one bad shard does not hide the state of the others. A
``pytorch_model*.bin`` export (``pytorch_model.bin.index.json`` with its shards, or one ``pytorch_model.bin``) is
read through the safe unpickler (:mod:`ckptdoctor.formats.torch_bin_shard`); a shard it refuses (a pickle naming
a global outside the allowlist, a file that is not a ``torch.save`` zip) stops the run with that one line:
nothing of it is ever executed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.safetensors_header import SafetensorsHeader, read_header
from ckptdoctor.formats.torch_bin_shard import BIN_INDEX, BIN_SINGLE, TorchBinShard, is_bin_shard, read_bin_shard
from ckptdoctor.storage.dispatch import as_path
from ckptdoctor.storage.files import list_names, read_json

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 256 << 20  # an index of a million tensors is ~100 MB
MAX_CONFIG_BYTES = 16 << 20


@dataclass
class HfExport:
    path: str
    config: dict[str, Any]
    index: dict[str, str] | None  # weight_map; None for a single model.safetensors (or pytorch_model.bin)
    shards: dict[str, SafetensorsHeader | TorchBinShard]  # shard file -> its tensors, of the shards that were read
    missing_shards: list[str] = field(default_factory=list)  # named by the index, not in the dir
    unreadable: dict[str, str] = field(default_factory=dict)  # shard file -> why its header was refused
    unindexed_files: list[str] = field(default_factory=list)  # weight files in the dir the index never names
    weights: str = "safetensors"  # or "bin": pytorch_model*.bin shards

    def holder(self) -> dict[str, str]:
        """Tensor name -> the shard that holds it (the first, where two do)."""
        held: dict[str, str] = {}
        for shard, header in sorted(self.shards.items()):
            for name in header.tensors:
                held.setdefault(name, shard)
        return held


def _json(path: Path, limit: int, what: str) -> Any:
    try:
        return read_json(path, limit)
    except OSError as exc:
        raise CkptError(f"{path}: cannot read {what} ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise CkptError(f"{path}: {what} is not JSON ({exc.msg})") from None


def read_export(directory: str | Path) -> HfExport:
    """The HF model dir's config, index and shard headers (a local dir or an object-storage URL, read through
    :mod:`ckptdoctor.storage`); :class:`CkptError` for a dir that is not one."""
    root = as_path(directory)  # a local dir, or an s3:// / msc:// URL's prefix
    if not root.is_dir():
        raise CkptError(f"{root}: not a directory (expected a Hugging Face model dir)")
    names = set(list_names(root))
    if CONFIG not in names:
        bins = sorted(n for n in names if is_bin_shard(n))
        what = f"; it holds {bins[0]}" if bins else ""
        raise CkptError(f"{root}: not a Hugging Face model dir (no {CONFIG}{what})")
    config = _json(root / CONFIG, MAX_CONFIG_BYTES, CONFIG)
    if not isinstance(config, dict):
        raise CkptError(f"{root / CONFIG}: not a JSON object")
    bins = sorted(n for n in names if is_bin_shard(n))
    index_name = INDEX if INDEX in names else BIN_INDEX if SINGLE not in names and BIN_INDEX in names else None
    index: dict[str, str] | None = None
    if index_name is not None:
        doc = _json(root / index_name, MAX_INDEX_BYTES, "the weight index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CkptError(f"{root / index_name}: no weight_map of tensor names to shard files")
        index = weight_map
        wanted = sorted(set(weight_map.values()))
    elif SINGLE in names:
        wanted = [SINGLE]
    elif BIN_SINGLE in names:
        wanted = [BIN_SINGLE]
    else:
        what = f" (only {bins[0]}, without {BIN_INDEX})" if bins else ""
        raise CkptError(f"{root}: no weights ({INDEX}, {SINGLE}, {BIN_INDEX} or {BIN_SINGLE}){what}")
    weights = "bin" if index_name == BIN_INDEX or wanted == [BIN_SINGLE] else "safetensors"
    export = HfExport(str(root), config, index, {}, weights=weights)
    for shard in wanted:
        if "/" in shard or shard in ("", ".", ".."):
            export.unreadable[shard] = "the index names a path outside the dir"
        elif shard not in names:
            export.missing_shards.append(shard)
        elif weights == "bin":
            export.shards[shard] = read_bin_shard(root / shard)  # a refusal of the safe unpickler stops the run
        else:
            try:
                export.shards[shard] = read_header(root / shard)
            except CkptError as exc:
                export.unreadable[shard] = str(exc)
    if index is not None:
        own = is_bin_shard if weights == "bin" else (lambda n: n.endswith(".safetensors"))
        export.unindexed_files = sorted(n for n in names if own(n) and n not in set(wanted))
    return export
