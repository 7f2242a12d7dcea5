from collections.abc import Callable

def scan(
    data: bytes,
    max_depth: int,
    max_string: int,
    max_int: int,
    max_hashed_keys: int,
    safe_hash: Callable[[str, str], bool] | None,
    /,
) -> None | int | tuple[int, str]: ...
def prune_memo(data: bytes | bytearray | memoryview, /) -> bytes | None: ...
