import mmap
from collections.abc import Iterable
from typing import Any

def filter_metadata(
    data: bytes | mmap.mmap,
    keep: Iterable[str],
    expected: dict[str, bytes] | None,
    repoint: tuple[str, str, int] | None,
    fd: int,
    /,
) -> dict[str, Any]: ...
