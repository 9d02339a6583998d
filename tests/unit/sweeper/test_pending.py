"""Which index entries a pending run needs (pure parts of services.sweeper.pending)."""

from __future__ import annotations

from services.sweeper import pending
from shared.contract import keys
from shared.contract.rows import PendingRun, PendingRunRow


def row(state: str, kind: str = "trigger") -> PendingRunRow:
    return PendingRunRow(PendingRun("ns", "x", kind, 17), 3, state, b'{"v":3}')


def test_a_pending_trigger_is_its_trigger_member() -> None:
    assert pending.member_of(row("active").run) == keys.trigger_member("ns", "x", 17)
    # A kind this version does not index is left alone rather than guessed at.
    assert pending.member_of(row("active", kind="backfill").run) is None


def test_only_a_completed_schedule_is_parked_for_its_trigger() -> None:
    assert pending.schedule_park(row("active")) is None
    assert pending.schedule_park(row("paused")) is None
    park = pending.schedule_park(row("completed"))
    assert park is not None
    assert (park.member, park.version, park.mode, park.next_fire_ms) == ("ns/x", 3, "park", None)
