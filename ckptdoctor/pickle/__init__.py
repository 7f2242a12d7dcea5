"""The one pickle engine: everything ckptdoctor unpickles, pickles or walks opcode by opcode goes through here.

Public interface (what the layers above use):

- :func:`loads` / :func:`loads_prefix`: read a pickle from a checkpoint for reading (inspect, show, diff): only
  allowlisted globals are resolved, Megatron/TE/NeMo names become inert stand-ins (:mod:`.stand_ins`), limits
  (:mod:`.limits`) bound what a few MB can build.
- :func:`refuse_unlisted` and :class:`~.policy.UnlistedGlobal` records: the same read for the gate (``check``
  and every write), which fails on a name a real loader would import.
- :func:`dumps` / :func:`dumps_taken`: the one writer; what it returns was read back through the gate.
- :func:`scan`: the opcode pre-pass (:mod:`.scanner`, C in ``_native`` where it was built, the same
  verdicts in Python).

Inside: :mod:`.policy` (the allowlist and the read's per-call state), :mod:`.opcodes` (the one opcode table,
from :mod:`pickletools`), :mod:`.plain` (bounded views of what was read: JSON-able form, short text, equality),
:mod:`.paths` (paths into what was read: lookup, leaves, the field-level diff of ``show`` and ``diff``),
:mod:`.index_records` (the compact records an index-only read of ``.metadata`` builds), :mod:`.torch_stand_ins`
and :mod:`.torch_values` (torch's classes without torch).
"""
