# The optional C extension built from _dcp_index.c and _dcp_attach.c (see
# ckptdoctor.formats.dcp_index, which falls back to its Python loops where it was not built).
from typing import Any

def items(
    state_dict_metadata: Any, shared: dict, counted: dict, consume: bool, /
) -> tuple[dict[Any, tuple[Any, tuple | None, list]], int | None, list[tuple[Any, Any]]]: ...
def attach(storage_data: dict, rows: dict, consume: bool, shared: dict, /) -> tuple[int, Any] | None: ...
