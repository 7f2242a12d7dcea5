"""``ckptdoctor strip-frozen``: :mod:`.plan` (which keys a trainable-params-only checkpoint keeps, and why) and
:mod:`.write` (the staged write of the kept keys through :mod:`ckptdoctor.ops.rewrite`)."""
