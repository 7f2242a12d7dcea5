from collections.abc import Iterable
from typing import Any

def filter_metadata(
    src_fd: int,
    keep: Iterable[str],
    expected: dict[str, bytes] | None,
    repoint: tuple[str, str, int] | None,
    out_fd: int,
    /,
) -> dict[str, Any]: ...
