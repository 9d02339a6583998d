"""The rows PostgreSQL keeps, as the services pass them around: schedules, command audits,
executions, checkpoints, pending runs and backfills (pure: ``shared.postgres.store`` reads and
writes them)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.contract import timefmt


class Record(Protocol):
    """A row as the PostgreSQL driver returns it: read by column name."""

    def __getitem__(self, key: str, /) -> Any: ...

    def keys(self) -> Iterator[str]: ...


def _ms(value: dt.datetime | None) -> int | None:
    return None if value is None else timefmt.datetime_to_ms(value)


@dataclass(frozen=True, slots=True)
class ScheduleRow:
    namespace: str
    id: str
    version: int
    state: str
    definition: dict[str, Any]
    compact: bytes
    priority: int
    labels: dict[str, str]
    fires: int
    last_fire_ms: int | None
    next_fire_ms: int | None
    created_ms: int
    updated_ms: int
    #: Occurrences its running backfill has left as PostgreSQL keeps them (read by get only).
    backfill_remaining: int | None = None

    @classmethod
    def of(cls, record: Record) -> ScheduleRow:
        return cls(
            namespace=record["namespace"],
            id=record["id"],
            version=record["version"],
            state=record["state"],
            definition=record["definition"],
            compact=bytes(record["compact"]),
            priority=record["priority"],
            labels=record["labels"],
            fires=record["fires"],
            last_fire_ms=_ms(record["last_fire_at"]),
            next_fire_ms=_ms(record["next_fire_at"]),
            created_ms=_ms(record["created_at"]) or 0,
            updated_ms=_ms(record["updated_at"]) or 0,
            backfill_remaining=(
                record["backfill_remaining"]
                if "backfill_remaining" in record.keys()  # noqa: SIM118 - not a mapping
                else None
            ),
        )


@dataclass(frozen=True, slots=True)
class NewScheduleRow:
    namespace: str
    id: str
    version: int
    state: str
    #: The definition as an object, or already encoded as JSON.
    definition: dict[str, Any] | bytes
    compact: bytes
    priority: int
    labels: dict[str, str]
    fires: int = 0
    last_fire_ms: int | None = None
    next_fire_ms: int | None = None
    #: The version, when this write starts a new rotation (checkpoints of older rotations are
    #: refused from then on); None when the rotation goes on.
    rotation_version: int | None = None


@dataclass(frozen=True, slots=True)
class CommandAudit:
    namespace: str | None
    verb: str | None
    schedule_id: str | None
    outcome: str
    body: Any = None
    error: dict[str, Any] | None = None
    version: int | None = None
    user_id: str | None = None
    app_id: str | None = None
    message_id: str | None = None
    correlation_id: str | None = None
    reply: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class AppliedCommand:
    """What the audit kept of an applied command: enough to tell a replay from a conflict."""

    verb: str
    body: Any
    reply: dict[str, Any]


@dataclass(slots=True)
class ExecutionRow:
    namespace: str
    id: str
    nominal_ms: int
    is_trigger: bool
    attempts: int
    #: succeeded | retrying | dead | skipped
    status: str
    http_status: int | None
    error: str | None
    idempotency_key: str
    started_ms: int
    finished_ms: int
    #: Excluded times (``spec.exclude``) the rotation stepped over after this occurrence.
    excluded: int = 0
    #: A backfilled delivery (``ns/id#b``): its own row beside the regular occurrence's.
    is_backfill: bool = False
    #: When the occurrence was due (its nominal time plus jitter): lateness counts from here,
    #: to the start of its first attempt. None: the nominal time.
    due_ms: int | None = None
    #: The failed attempts this row records (see ``failed_attempt``), oldest first.
    failed_attempts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def lateness_ms(self) -> int:
        return self.started_ms - (self.nominal_ms if self.due_ms is None else self.due_ms)


def failed_attempt(row: ExecutionRow) -> dict[str, Any]:
    """One entry of ``executions.failed_attempts``: what a person asks of a failed try."""
    return {
        "attempt": row.attempts,
        "http_status": row.http_status,
        "error": row.error,
        "started_ms": row.started_ms,
        "finished_ms": row.finished_ms,
    }


@dataclass(slots=True)
class Checkpoint:
    namespace: str
    id: str
    last_fire_ms: int
    next_fire_ms: int | None
    fires: int
    finished: bool = False
    #: The version of the schedule the occurrence ran under: a checkpoint from before a
    #: change that restarted the rotation is refused (see ``write_checkpoints``).
    version: int = 0
    #: False when the index does not count this schedule's fires (no ``max_fires``: its
    #: resting entry stays small); ``fires`` is then what this checkpoint adds (1 for a fire,
    #: 0 for a skip), not the total.
    counted: bool = True


#: Statuses after which an occurrence is never attempted again.
FINAL_STATUSES = frozenset({"succeeded", "dead"})


@dataclass(frozen=True, slots=True)
class PendingRun:
    """An occurrence outside the rotation, kept in PostgreSQL until its run completes.

    ``kind`` is ``trigger`` (a ``backfill`` kind is reserved for backfilled occurrences).
    """

    namespace: str
    id: str
    kind: str
    nominal_ms: int


@dataclass(frozen=True, slots=True)
class PendingRunRow:
    """A pending run with what the index needs of its (not deleted) schedule."""

    run: PendingRun
    version: int
    state: str
    compact: bytes

    @classmethod
    def of(cls, record: Record) -> PendingRunRow:
        return cls(
            PendingRun(record["namespace"], record["id"], record["kind"], record["nominal_ms"]),
            record["version"],
            record["state"],
            bytes(record["compact"]),
        )


def finished_runs(rows: Sequence[ExecutionRow]) -> list[PendingRun]:
    """The pending runs these execution rows complete: triggers that succeeded or died."""
    return [
        PendingRun(r.namespace, r.id, "trigger", r.nominal_ms)
        for r in rows
        if r.is_trigger and r.status in FINAL_STATUSES
    ]


@dataclass(frozen=True, slots=True)
class Backfill:
    """A schedule's running backfill as PostgreSQL keeps it."""

    namespace: str
    id: str
    generation: int
    from_ms: int
    to_ms: int
    limit: int
    #: The nominal time of the occurrence due or in flight.
    next_ms: int
    #: Occurrences left to deliver, that one included.
    remaining: int


@dataclass(frozen=True, slots=True)
class LiveBackfill:
    """What the index needs of a kept backfill (the rebuild, drift repair)."""

    namespace: str
    id: str
    generation: int
    to_ms: int
    next_ms: int
    remaining: int
    paused: bool

    @classmethod
    def of(cls, record: Record) -> LiveBackfill:
        return cls(
            record["namespace"],
            record["id"],
            record["generation"],
            record["to_ms"],
            record["next_ms"],
            record["remaining"],
            record["state"] == "paused",
        )


@dataclass(frozen=True, slots=True)
class BackfillProgress:
    """A backfill occurrence completed: its backfill goes on at ``next_ms`` with
    ``remaining`` left, or ends (``remaining`` 0)."""

    namespace: str
    id: str
    generation: int
    next_ms: int | None
    remaining: int


@dataclass(frozen=True, slots=True)
class AmqpTargetRow:
    """A live schedule's AMQP target, as stored (checked again by cronbus doctor)."""

    namespace: str
    id: str
    state: str
    exchange: str


@dataclass(frozen=True, slots=True)
class LiveSchedule:
    """What a rebuild (or drift repair) needs of one schedule."""

    namespace: str
    id: str
    version: int
    state: str
    compact: bytes
    fires: int
    last_fire_ms: int | None
    next_fire_ms: int | None

    @classmethod
    def of(cls, record: Record) -> LiveSchedule:
        return cls(
            record["namespace"],
            record["id"],
            record["version"],
            record["state"],
            bytes(record["compact"]),
            record["fires"],
            record["last_fire_ms"],
            record["next_fire_ms"],
        )
