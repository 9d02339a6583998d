"""How much of the full drift comparison one drift check does (pure).

Comparing every schedule with the index in one go lands a burst of work on Redis,
PostgreSQL and the sweeper, at whatever moment it falls: in the middle of a herd, say. So
the full comparison is a rolling pass instead: each drift check compares the next slice of
rows (in key order) and of index entries (by shard and HSCAN cursor), sized so that the
whole pass takes about ``CRONBUS_DRIFT_FULL_INTERVAL_S``.
"""

from __future__ import annotations

import math

#: Least rows (and index entries) one drift check compares: small indexes are compared
#: whole at every check, as the full scan used to.
SLICE_MIN = 2000


def slice_size(
    entries: int, check_interval_s: float, full_interval_s: float, least: int = SLICE_MIN
) -> int:
    """Rows per drift check for a pass over ``entries`` to end within the full interval."""
    checks = max(1, math.floor(full_interval_s / check_interval_s))
    return max(least, math.ceil(max(entries, 0) / checks))
