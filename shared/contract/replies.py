"""What replies carry, as typed models (pure): a stored schedule with what cronbus assigns, its
stats, breaker and backfill, and a trigger's run. The Python client returns these.

Replies are read leniently (``stored``, ``triggered``): a newer cronbus may add fields at any
level and new state names; they are kept (on the reply models) or dropped (in the definition),
never refused."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from shared.contract.models import REPLY_CONTEXT, Instant, ScheduleDefinition

#: A schedule's state; a newer cronbus may name others (kept as the string).
State = Literal["active", "paused", "completed", "deleted"] | str


class Reply(BaseModel):
    """Replies may grow fields (the contract is extended, never broken): a newer cronbus's
    extra fields are kept, not refused."""

    model_config = ConfigDict(extra="allow", frozen=True)


class Stats(Reply):
    """Outcomes folded from the execution rows (``get`` and ``list`` only)."""

    #: Occurrences whose first attempt started (regular and triggered).
    fires: int
    #: Occurrences delivered successfully.
    succeeded: int
    #: Failed attempts, retried or not.
    failed: int
    #: Occurrences that failed their last attempt.
    dead: int
    #: Missed occurrences the misfire policy dropped.
    skipped: int
    #: Nominal times ``spec.exclude`` stepped over.
    excluded: int
    #: Occurrences ended ``dead`` since the last success.
    consecutive_failures: int
    #: ``succeeded``, ``retrying``, ``dead`` or ``skipped``, of the latest attempt.
    last_status: str | None
    #: Its error (``HTTP 503``, a timeout...), None on success.
    last_error: str | None
    #: When the latest attempt started.
    last_fire_at: Instant | None


class Breaker(Reply):
    """The circuit breaker of the schedule's rate key, and any Retry-After hold (``get``)."""

    rate_key: str
    state: Literal["open", "half_open", "closed"] | str
    consecutive_failures: int
    open_until: Instant | None = None
    #: Until when a Retry-After of a 429 or 503 holds the rate key.
    held_until: Instant | None = None


class BackfillProgress(Reply):
    """A running backfill (``get``)."""

    #: Occurrences left to deliver, the one in flight included.
    remaining: int


class Notice(Reply):
    """Something to notice in an accepted upsert: the field and why (a ``once`` in the past)."""

    field: str
    reason: str


class StoredSchedule(ScheduleDefinition):
    """A schedule as cronbus stores it: its definition, plus what cronbus assigns."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    namespace: str
    #: Raised by every change; an upsert's ``expected_version`` compares with it.
    version: int
    state: State
    #: Regular fires of the current rotation: what ``max_fires`` counts. Triggers and backfills
    #: are not among them, and new fire times (rule, window, count, jitter) start it from 0;
    #: ``stats.fires`` counts every occurrence started.
    fires: int
    last_fire_at: Instant | None
    #: The next nominal fire times (up to 5; none unless active).
    next_fires: list[Instant]
    created_at: Instant
    updated_at: Instant
    stats: Stats | None = None
    #: ``failures`` when ``pause_after_failures`` paused it, ``command`` for a pause or upsert.
    paused_reason: Literal["failures", "command"] | str | None = None
    breaker: Breaker | None = None
    backfill: BackfillProgress | None = None
    #: Set by ``upsert`` only: the definition sent was the stored one, so nothing changed
    #: (the version stays).
    unchanged: bool = False
    #: Set by ``upsert`` only: what to notice, though the upsert was applied.
    warnings: list[Notice] = []


class Triggered(Reply):
    """One extra run, outside the rotation: its time and key, and the schedule."""

    #: The run's identity: the trigger time (``X-Cronbus-Fire-Time``).
    fire_time: Instant
    #: The ``Idempotency-Key`` its deliveries carry.
    idempotency_key: str
    schedule: StoredSchedule


def stored(data: Any) -> StoredSchedule:
    """A reply's schedule, read leniently: what a newer cronbus adds is kept or dropped."""
    return StoredSchedule.model_validate(data, context=REPLY_CONTEXT)


def triggered(data: Any) -> Triggered:
    """A trigger's reply (``trigger`` and ``schedule`` merged), read leniently."""
    return Triggered.model_validate(data, context=REPLY_CONTEXT)
