"""A section's verdict in a ``can-load`` prediction: what :mod:`.predict`, :mod:`.keys` and :mod:`.optim` return for
each section of the checkpoint (safety, format, args, common, model, optimizer, rng, rerun)."""

from __future__ import annotations

from dataclasses import dataclass

LOADS, RESHARDS, SKIPPED, FAILS = "loads", "reshards", "skipped", "fails"
# The load completes without an error but puts the section's saved state on other parameters: as bad as a failure
# for the run (it trains on from a different state), and nothing says so.
CORRUPTS = "corrupts"


@dataclass
class SectionVerdict:
    section: str
    verdict: str  # loads / reshards / skipped / fails / corrupts
    why: str
    error: str | None = None  # megatron's wording of the failure
    fix: str | None = None
    requested: int = 0  # keys the run requests from this section
    present: int = 0  # keys of this section in the checkpoint
