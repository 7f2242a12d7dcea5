"""``ckptdoctor verify-export CKPT HF_DIR``: :mod:`.mapping` (the Megatron <-> HF grammar, one table per family),
:mod:`.expected` (the HF tensors a checkpoint maps to), :mod:`.verify` (files, coverage, config), :mod:`.values`
(``--values``) and :mod:`.report` (what it reports)."""
