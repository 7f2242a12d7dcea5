"""``ckptdoctor repair``: :mod:`.plan` decides what is provably safe to fix (with :mod:`.metadata_json` for
CKD101 and :mod:`.bridge` for Megatron-Bridge's tracker), :mod:`.write` applies the plan and re-checks,
:mod:`.report` holds what both report."""
