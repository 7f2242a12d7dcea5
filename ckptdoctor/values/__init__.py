"""Tensor values: decoding chunks (``read``), the one comparison engine (``diff``) and its bounded I/O (``io``).

Imported only by commands that look at values (``check --deep``, ``diff --values``, ``strip-frozen --base``);
metadata-only work never imports this package, so it never pays for torch.
"""
