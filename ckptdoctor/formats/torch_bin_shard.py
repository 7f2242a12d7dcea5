"""One ``pytorch_model*.bin`` shard of a Hugging Face export, read without torch: names, dtypes and shapes.

Such a shard is ``torch.save`` of a state dict (a zip: ``data.pkl`` and one storage record per tensor storage).
It is read through the one archive decoder (:func:`ckptdoctor.formats.archive.parse_archive`: its zip checks)
and the one safe unpickler (allowlist and limits): a pickle naming any other global, such as ``os.system``, is
refused before anything runs, and so is an archive torch would read differently. The state dict's tensors come
back as :class:`~ckptdoctor.pickle.torch_stand_ins.TensorRef` stand-ins whose storage bytes are read only when a
value is asked for (``--values``), one storage record at a time.

The file is memory-mapped read-only, so that reading the names touches only the zip directory and ``data.pkl``,
however large the shard (a file truncated by another process while it is read ends the process with SIGBUS, as
``torch.load(mmap=True)`` would). A shard on object storage is not read (a zip's directory, pickle and records
are many small ranged reads): it is refused in one line.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

from ckptdoctor.errors import CkptError
from ckptdoctor.formats.archive import is_torch_zip, load_archive
from ckptdoctor.formats.safetensors_header import DTYPES, TensorInfo
from ckptdoctor.pickle.torch_stand_ins import TensorRef
from ckptdoctor.storage.dispatch import as_path
from ckptdoctor.storage.files import open_regular
from ckptdoctor.storage.remote import RemotePath

BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
_SAFETENSORS_NAMES = {torch_name: name for name, (torch_name, _) in DTYPES.items()}


@dataclass
class TorchBinShard:
    """A ``.bin`` shard's tensors, as a safetensors header states them (``begin``/``end``: the tensor's bytes in
    its storage record), with their stand-ins for reading values."""

    path: str
    file_bytes: int
    tensors: dict[str, TensorInfo]
    refs: dict[str, TensorRef] = field(repr=False)

    @property
    def data_bytes(self) -> int:
        return sum(t.end - t.begin for t in self.tensors.values())

    @property
    def buffer_bytes(self) -> int:
        """Every view was checked against its storage record when the shard was read: nothing is cut."""
        return max((t.end for t in self.tensors.values()), default=0)

    def cut_tensors(self) -> list[str]:
        return []


def is_bin_shard(name: str) -> bool:
    return name.startswith("pytorch_model") and name.endswith(".bin")


def read_bin_shard(path: str | os.PathLike) -> TorchBinShard:
    """The state dict of one ``pytorch_model*.bin`` (names, dtypes, shapes); :class:`CkptError` (one line) for a
    file that is not a ``torch.save`` zip, a pickle the safe unpickler refuses, or anything but tensors by name."""
    where = str(path)
    local = as_path(path)
    if isinstance(local, RemotePath):
        raise CkptError(
            f"{where}: a pytorch_model*.bin shard on object storage is not read (copy the export locally, or "
            "convert it to safetensors)"
        )
    with open_regular(local) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 4 or not is_torch_zip(f.read(4)):
            raise CkptError(f"{where}: not a torch.save zip archive (a legacy or damaged .bin file); not read")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    state = load_archive(memoryview(mapped), where)  # the safe unpickler: allowlist and limits; storages read on demand
    if not isinstance(state, dict):
        raise CkptError(f"{where}: holds a {type(state).__name__}, not a state dict of tensors")
    tensors: dict[str, TensorInfo] = {}
    refs: dict[str, TensorRef] = {}
    for name, ref in state.items():
        if not isinstance(name, str) or not isinstance(ref, TensorRef):
            raise CkptError(f"{where}: entry {name!r} is a {type(ref).__name__}, not a tensor")
        tensors[name] = _info(name, ref, where)
        refs[name] = ref
    return TorchBinShard(where, size, tensors, refs)


def _info(name: str, ref: TensorRef, where: str) -> TensorInfo:
    dtype = ref.dtype
    itemsize = dtype.itemsize if dtype is not None else None
    st_name = _SAFETENSORS_NAMES.get(dtype.name) if dtype is not None else None
    if dtype is None or itemsize is None or st_name is None:
        raise CkptError(f"{where}: tensor {name!r}: dtype {dtype} is not one an export holds")
    size, stride = ref.size, ref.stride
    if len(size) != len(stride) or any(n < 0 for n in size) or any(s < 0 for s in stride):
        raise CkptError(f"{where}: tensor {name!r}: size {list(size)} and stride {list(stride)} do not match")
    # the last element the view reaches must lie in its storage (torch would refuse the view too)
    reach = ref.storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
    if ref.storage_offset < 0 or reach > ref.storage.numel:
        raise CkptError(
            f"{where}: tensor {name!r}: its view reaches element {reach} of a storage of {ref.storage.numel}"
        )
    begin = ref.storage_offset * itemsize
    return TensorInfo(name, st_name, tuple(size), begin, begin + ref.numel * itemsize)
