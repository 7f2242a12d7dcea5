# The optional C extension built from _health.c (see ckptdoctor.values.slab_stats, which computes the same numbers in
# numpy where it was not built).
from typing import Any

def floats(
    data: Any, columns: int, exponent_bits: int, fraction_bits: int, out: Any, row_step: int, portable: bool = False, /
) -> tuple[int, int, int, int, int, bytes, bytes, bytes, int]: ...
