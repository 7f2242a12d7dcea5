# The optional C extension built from _dcp_index.c (see ckptdoctor.formats.dcp_index, which falls back to its
# Python loops where it was not built).
from collections.abc import Callable
from typing import Any

def setup(
    fields: Callable[[Any], Any],
    int64_dims: Callable[..., tuple],
    inside_path: Callable[[str, Any], str],
    dtype_name: Callable[[Any, Any], str | None],
    chunk_type: type,
    location_type: type,
    /,
) -> None: ...
def attach(storage_data: Any, items: dict, consume: bool, shared: dict, /) -> None: ...
def items(
    state_dict_metadata: Any,
    shared: dict,
    counted: dict,
    item_class: type,
    consume: bool,
    dtype_names: dict,
    /,
) -> dict: ...
def tiles_once(shape: tuple, chunks: list, /) -> bool: ...
