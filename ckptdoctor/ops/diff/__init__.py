"""``ckptdoctor diff A B``: :mod:`.compare` (keys, metadata, layout, args, common state; values through
:mod:`ckptdoctor.values.diff`) and :mod:`.report` (what it reports)."""
