"""DCP's per-tensor enum and layout values as C-speed value classes: ``int`` and ``str`` subclasses the unpickler
builds without a Python call per tensor, each pickling back to the torch call that made it.

Split from :mod:`ckptdoctor.pickle.torch_stand_ins` (the object stand-ins); :mod:`ckptdoctor.pickle.policy` resolves the
torch names of :data:`TORCH_VALUE_CLASSES` to them.
"""

from __future__ import annotations

from typing import Any

from ckptdoctor.pickle.stand_ins import ALIAS_MODULE, register_alias


class LayoutName(str):
    """``torch.serialization._get_layout("torch.strided")`` as pickled once per tensor in DCP metadata.

    A ``str`` subclass, so the unpickler builds it at C speed; it pickles back to the same call.
    """

    def __reduce__(self) -> tuple:
        return (LayoutName, (str(self),))


class EnumValue(int):
    """A torch enum's member as DCP pickles it (a REDUCE of the enum class with its value); pickles back to the
    same call. Only the enum's ``VALUES`` are built (compared as torch's lookup compares them): torch's loader raises
    ValueError for any other, so a read refuses it too (``check``: corrupt DCP metadata)."""

    ENUM = ""
    VALUES: tuple[int, ...] = ()

    def __new__(cls, value: Any = None) -> EnumValue:
        if not isinstance(value, (int, float)) or value not in cls.VALUES:
            raise ValueError(f"{ascii(value)[:40]} is not a valid {cls.ENUM}")
        return int.__new__(cls, value)

    def __reduce__(self) -> tuple:
        return (type(self), (int(self),))


class MemoryFormatCode(EnumValue):
    """DCP's ``_MEM_FORMAT_ENCODING(n)`` (a TensorProperties state's fourth value)."""

    ENUM, VALUES = "_MEM_FORMAT_ENCODING", (0, 1, 2)


class WriteItemTypeCode(EnumValue):
    """A save plan's ``WriteItemType(n)`` (megatron-core's plans: once per file, then memo reads; the C recognizer
    of plan parts leaves a part out unread only where its value is one of these)."""

    ENUM, VALUES = "WriteItemType", (1, 2, 3)


for _cls, _module, _name in (
    (LayoutName, "torch.serialization", "_get_layout"),
    (MemoryFormatCode, "torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    (WriteItemTypeCode, "torch.distributed.checkpoint.planner", "WriteItemType"),
):
    _cls.__qualname__ = register_alias(_cls, _module, _name)
    _cls.__module__ = ALIAS_MODULE
# torch names that resolve to the C-speed value classes above
TORCH_VALUE_CLASSES: dict[tuple[str, str], type] = {
    ("torch.serialization", "_get_layout"): LayoutName,
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): MemoryFormatCode,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): WriteItemTypeCode,
}
