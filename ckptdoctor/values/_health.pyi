# The optional C extension built from _health.c (see ckptdoctor.values.health, which runs the same loops in numpy
# where it was not built).
from typing import Any

def rows16(data: Any, columns: int, counts: Any, hashes: Any, out: Any, /) -> None: ...
def rows32(
    data: Any, columns: int, buckets: Any, out: Any, /
) -> tuple[int, int, int, float | None, float | None]: ...
