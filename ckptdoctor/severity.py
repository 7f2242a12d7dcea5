"""Finding severities, shared by check rules and the fix-args rule table."""

ERROR = "error"  # megatron-core refuses to load / validate it, or data is lost
WARNING = "warning"  # loads, but something is silently changed, wasted or misleading
OVERRIDDEN = "overridden"  # a safety finding about a global the user trusts (--trust-global): listed, not counted
# worth knowing, no problem: never counted as one, never fails a command (check: what a TE newer than
# --te-version will refuse, CKD230; verify-export's notes)
INFO = "info"
