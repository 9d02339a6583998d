"""What a misfire policy owes for a stretch of missed times (pure, no I/O).

A *stretch* is a run of consecutive nominal times of one rotation whose due times (nominal +
jitter offset) fell while the schedule could not be delivered on time: a fault, a backlog, or
its rate key held (an open breaker, a Retry-After hold). Which of them the system really
missed depends on timing the ledger cannot see, so the oracle asks for the least every
correct run delivers, as documented (docs/concepts.md, Misfires):

- ``skip`` drops every missed time and fires the next on-time one: a stretch owes nothing
  (the on-time times around it are owed one by one, outside the stretch);
- ``fire_once`` fires one catch-up, the latest missed time: a stretch owes one delivery;
- ``fire_all`` replays missed times oldest first, at most ``limit`` of them and none whose
  due time is older than ``window`` when the policy decides. The decision comes at the latest
  when the disturbance is over and the system had ``settle_ms`` to catch up, so the times due
  within the window before that moment are eligible whatever happened earlier, and the
  stretch owes ``min(limit, eligible)`` deliveries.

A held occurrence is delayed, never judged again (it was flagged a catch-up when parked), so
holding a time never lowers what its stretch owes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.rules.plan import MisfireRule


@dataclass(frozen=True, slots=True)
class Owed:
    """The least number of deliveries a stretch owes, and why."""

    count: int
    reason: str


def owed(misfire: MisfireRule, dues: Sequence[int], decided_by_ms: int) -> Owed:
    """What a stretch of missed times owes: ``dues`` are the due times of the stretch (any
    order), ``decided_by_ms`` the latest moment the policy can have decided about them."""
    if not dues:
        return Owed(0, "no time missed")
    if misfire.policy == "skip":
        return Owed(0, "skip drops missed times")
    if misfire.policy == "fire_once":
        return Owed(1, "fire_once fires one catch-up")
    oldest_eligible = decided_by_ms - misfire.window_ms
    eligible = sum(1 for due in dues if due >= oldest_eligible)
    count = min(misfire.limit, eligible)
    return Owed(count, f"fire_all replays {count} of {len(dues)} (limit {misfire.limit})")


def delivered_enough(owes: Owed, delivered: int) -> int:
    """How many deliveries a stretch is short of what it owes (0: none)."""
    return max(0, owes.count - delivered)
