"""Exit codes shared by every command (documented in the README)."""

EXIT_OK = 0  # nothing found / the operation succeeded
EXIT_FINDINGS = 1  # findings (check), differences (diff), a refusal the user can act on
EXIT_ERROR = 2  # bad input, usage error, unreadable checkpoint
