import mmap
from collections.abc import Callable
from typing import BinaryIO

def scan(
    data: bytes | mmap.mmap,
    max_depth: int,
    max_string: int,
    max_int: int,
    max_hashed_keys: int,
    safe_hash: Callable[[str, str], bool] | None,
    /,
) -> None | int | tuple[int, str]: ...
def prune_memo(data: bytes | bytearray | memoryview, drop_plans: bool = False, /) -> bytes | None: ...
def pruned_reader(
    data: bytes | bytearray | memoryview | mmap.mmap,
    release: bool = False,
    drop_plans: bool = False,
    /,
) -> BinaryIO | None: ...
