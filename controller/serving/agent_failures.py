"""What a step's failed agent sessions say on the console: how many failed and why, and the first exception
with its traceback. The counts also go to the metrics (``agent/error``, ``agent/timeout``, ...), but a user
reading the console must not have to find them there, nor meet them only as a NaN in the update."""

from __future__ import annotations

from collections import Counter

__all__ = ["failure_report"]


def failure_report(outcomes) -> str | None:
    """The console lines for ``outcomes`` (``SessionOutcome``s) when any failed, else None: the count by status,
    then the first exception's traceback (or, when none raised, the first failure's reason)."""
    failed = [o for o in outcomes if o.status != "ok"]
    if not failed:
        return None
    counts = Counter(o.status for o in failed)
    by_status = ", ".join(f"{status} {count}" for status, count in sorted(counts.items()))
    raised = [o for o in failed if o.traceback]
    first = raised[0] if raised else failed[0]
    lines = [f"agent: {len(failed)} of {len(outcomes)} sessions failed ({by_status}); each trains nothing. "
             f"The first, row {first.row} (session {first.session_id}): {first.error}"]
    if first.traceback:
        lines += ["    " + line for line in first.traceback.rstrip().splitlines()]
    return "\n".join(f"[hybridflow] {line}" for line in lines)
