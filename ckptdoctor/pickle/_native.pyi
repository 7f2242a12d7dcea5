import mmap
from collections.abc import Callable
from typing import Any, BinaryIO

def scan(
    data: bytes | mmap.mmap,
    max_depth: int,
    max_string: int,
    max_int: int,
    max_hashed_keys: int,
    safe_hash: Callable[[str, str], bool] | None,
    /,
) -> None | int | tuple[int, str]: ...
def pruned_reader(
    data: bytes | bytearray | memoryview | mmap.mmap,
    release: bool = False,
    drop_plans: bool = False,
    /,
) -> BinaryIO | None: ...
def records_setup(keys_type: type, index_record_type: type, tuple_state_type: type, record_type: type, /) -> object: ...
def index_size(*args: Any) -> tuple: ...
def faithful_size(cls: type, /, *args: Any) -> Any: ...
def forget_index_sizes() -> None: ...

records_api: object  # a capsule: what the DCP index's C reads of the records (_records.h)
