"""The staged key rewrite shared by ``strip-frozen`` and ``edit``: :mod:`.write` (``write_keys``: staging dir,
swap), :mod:`.request` (what a rewrite is asked to do and what it wrote), :mod:`.metadata` (the new
``.metadata`` and data files) and :mod:`.common_state` (the common state, changed as one step)."""
