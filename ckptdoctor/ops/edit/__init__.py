"""``ckptdoctor edit``: :mod:`.plan` (which keys are removed or renamed, checked before writing; :mod:`.presets`
the layer-spec renames) and :mod:`.write` (the plan applied through :mod:`ckptdoctor.ops.rewrite`)."""
