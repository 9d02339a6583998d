"""Where a schedule's rotation stands after a command, a rebuild or a resume (pure).

The intake, the sweeper and the executor all place a schedule's next occurrence with these
functions, so a schedule behaves the same whichever path put it back into the index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.contract import keys
from shared.contract.entries import Upsert, UpsertMode, resting_occ_state
from shared.rules import compact, schedule
from shared.rules.plan import CronRule, IntervalRule, Plan, same_rotation

State = Literal["active", "paused", "completed", "deleted"]


@dataclass(frozen=True, slots=True)
class Current:
    """What PostgreSQL holds for a schedule before the change."""

    plan: Plan
    state: str
    fires: int
    last_fire_ms: int | None
    next_fire_ms: int | None


@dataclass(frozen=True, slots=True)
class Placement:
    state: State
    #: How to write the index; None: leave the index alone (nothing to fire).
    mode: UpsertMode | None
    #: The next nominal fire time (None: the schedule has no more).
    next_nominal: int | None
    fires: int
    last_fire_ms: int | None
    #: This placement starts a new rotation (checkpoints of the old one are refused).
    new_rotation: bool = False
    #: The next occurrence is a catch-up the misfire policy chose: delivered, never re-judged.
    catch_up: bool = False

    def rotation_version(self, version: int) -> int | None:
        """What the row's ``rotation_version`` becomes at ``version`` (None: unchanged)."""
        return version if self.new_rotation else None


def choose(
    plan: Plan, candidate_ms: int | None, now_ms: int, member: str = ""
) -> tuple[int | None, bool]:
    """The misfire policy applied to the rule's next time: (the nominal time to place, whether
    the policy chose it because the candidate was missed: a catch-up, never judged again)."""
    chosen = schedule.resolve_due(plan, candidate_ms, now_ms, member)
    missed = candidate_ms is not None and schedule.is_missed(plan, member, candidate_ms, now_ms)
    return chosen, chosen is not None and missed


def _fresh(plan: Plan, now_ms: int, member: str) -> tuple[int | None, bool]:
    return choose(plan, schedule.first_nominal(plan, now_ms), now_ms, member)


def _continued(
    plan: Plan, fires: int, last_fire_ms: int | None, now_ms: int, member: str
) -> tuple[int | None, bool]:
    if schedule.is_exhausted(plan, fires):
        return None, False
    if last_fire_ms is None:
        return choose(plan, _first_still_owed(plan, now_ms, member), now_ms, member)
    return choose(plan, schedule.following(plan, last_fire_ms, now_ms), now_ms, member)


def _first_still_owed(plan: Plan, now_ms: int, member: str) -> int | None:
    """Where a rotation that never fired picks up (a resume, a rebuild): the first time that
    is due at or after now. For a grid rule that can be a nominal time already past, whose
    jitter offset makes it due later: it is on time, and starting at the first nominal time
    after now would drop it. (Times due before now came while the rotation was away: like a
    fresh start, it does not go back for them.)"""
    if isinstance(plan.rule, IntervalRule | CronRule):
        earliest = schedule.first_nominal(plan, now_ms - plan.jitter_ms)
        if earliest is None:
            return None
        return schedule.first_on_time(plan, member, earliest, now_ms)
    return schedule.first_nominal(plan, now_ms)


def fresh_start(plan: Plan, now_ms: int, member: str = "") -> int | None:
    """The first occurrence of a new (or changed) rotation, misfire policy applied."""
    return _fresh(plan, now_ms, member)[0]


def continuation(
    plan: Plan, fires: int, last_fire_ms: int | None, now_ms: int, member: str = ""
) -> int | None:
    """Where a rotation picks up after a pause or an outage: the rule's next time after the
    last fire, with the misfire policy deciding what to do about the times missed meanwhile."""
    return _continued(plan, fires, last_fire_ms, now_ms, member)[0]


def _finished_or(
    state: State,
    mode: UpsertMode,
    placed: tuple[int | None, bool],
    fires: int,
    last_fire_ms: int | None,
    new_rotation: bool = False,
) -> Placement:
    next_nominal, catch_up = placed
    if next_nominal is None and state == "active":
        return Placement("completed", None, None, fires, last_fire_ms, new_rotation)
    return Placement(state, mode, next_nominal, fires, last_fire_ms, new_rotation, catch_up)


def place_upsert(
    current: Current | None, plan: Plan, paused: bool, now_ms: int, member: str = ""
) -> Placement:
    """Create, or replace, a schedule. A replacement that keeps the fire times (same rule,
    window, count and jitter) keeps its rotation, fire count and checkpoint; any other
    replacement starts a new rotation from now."""
    live = current is not None and current.state in ("active", "paused", "completed")
    if current is None or not live or not same_rotation(current.plan, plan):
        if paused:
            return Placement("paused", "park", None, 0, None, new_rotation=True)
        placed = _fresh(plan, now_ms, member)
        return _finished_or("active", "reset", placed, 0, None, new_rotation=True)
    fires, last = current.fires, current.last_fire_ms
    if paused:
        return Placement("paused", "park", None, fires, last)
    if current.state == "completed":
        return Placement("completed", None, None, fires, last)
    if current.state == "paused":
        resumed = _continued(plan, fires, last, now_ms, member)
        return _finished_or("active", "resume", resumed, fires, last)
    pending = current.next_fire_ms
    placed = (
        choose(plan, pending, now_ms, member)
        if pending is not None
        else _continued(plan, fires, last, now_ms, member)
    )
    return _finished_or("active", "keep", placed, fires, last)


def place_resume(current: Current, now_ms: int, member: str = "") -> Placement:
    """A paused schedule goes back into rotation where it left off (misfire policy applied)."""
    return _finished_or(
        "active",
        "resume",
        _continued(current.plan, current.fires, current.last_fire_ms, now_ms, member),
        current.fires,
        current.last_fire_ms,
    )


def place_pause(current: Current) -> Placement:
    return Placement("paused", "park", None, current.fires, current.last_fire_ms)


def index_write(
    namespace: str,
    schedule_id: str,
    plan: Plan,
    raw_plan: bytes,
    placement: Placement,
    *,
    version: int | None = None,
) -> Upsert | None:
    """The index write of a placement (None: the schedule has nothing to fire; remove it).

    ``version`` overrides ``plan.version`` (a bulk import stamps it into ``raw_plan`` only).
    """
    if placement.mode is None:
        return None
    member = keys.member(namespace, schedule_id)
    nominal = placement.next_nominal
    fire = None if nominal is None else schedule.fire_at_ms(plan, member, nominal)
    occ = (
        ""
        if nominal is None or fire is None
        else resting_occ_state(
            nominal, fire, placement.fires, plan.max_fires is not None, placement.catch_up
        )
    )
    return Upsert(
        member, plan.version if version is None else version, raw_plan, placement.mode, fire, occ
    )


def index_entry(
    namespace: str,
    schedule_id: str,
    state: str,
    raw_plan: bytes,
    fires: int,
    last_fire_ms: int | None,
    next_fire_ms: int | None,
    now_ms: int,
) -> Upsert | None:
    """The index write that restores one schedule from its PostgreSQL row (rebuild, drift).

    The rotation continues from the checkpoint: the stored next fire if there is one, else the
    rule's next time after the last fire; the misfire policy decides about what was missed
    while the index was gone. 'keep' leaves a rotation that survived in Redis alone.
    """
    member = keys.member(namespace, schedule_id)
    plan = compact.decode(raw_plan)
    if state == "paused":
        return Upsert(member, plan.version, raw_plan, "park", None)
    if state != "active":
        return None
    if next_fire_ms is not None and not schedule.is_exhausted(plan, fires):
        nominal, catch_up = choose(plan, next_fire_ms, now_ms, member)
    else:
        nominal, catch_up = _continued(plan, fires, last_fire_ms, now_ms, member)
    if nominal is None:
        return None
    fire = schedule.fire_at_ms(plan, member, nominal)
    occ = resting_occ_state(nominal, fire, fires, plan.max_fires is not None, catch_up)
    return Upsert(member, plan.version, raw_plan, "keep", fire, occ)
