"""``ckptdoctor fix-args``: :mod:`.plan` (saved args that contradict the checkpoint's parallelism, and the fix)
and :mod:`.write` (the fix written, O(metadata), crash-safe)."""
