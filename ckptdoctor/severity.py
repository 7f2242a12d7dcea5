"""Finding severities, shared by check rules and the fix-args rule table."""

ERROR = "error"  # megatron-core refuses to load / validate it, or data is lost
WARNING = "warning"  # loads, but something is silently changed, wasted or misleading
OVERRIDDEN = "overridden"  # a safety finding about a global the user trusts (--trust-global): listed, not counted
# loads with the release the run names, but a newer one will not (check --te-version below 2.18: CKD230): reported,
# not counted as a problem (exit 0)
INFO = "info"
