"""What the console shows, read from PostgreSQL (the truth) and Redis (live state).

The console's own read side: its queries live in ``shared/postgres/sql/console.sql`` and only this
module runs them. Each page is a few index lookups (see migration 0004). Fields a later
schema adds (per-schedule ``stats``, ``paused_reason``) belong in ``ScheduleSummary.stats``
and ``ScheduleSummary.paused_reason``; the templates already show them when present.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from services.console import views
from shared.contract import codec, keys
from shared.postgres.sql import HERE, parse_queries
from shared.redis.index import Index

QUERIES = parse_queries((HERE / "console.sql").read_text())

#: Execution statuses that count as a failure: the occurrence's latest attempt failed.
FAILED_STATUSES = ("retrying", "dead")
#: States a schedule list may be filtered by.
STATES = ("active", "paused", "completed")


#: The recent minutes the home page's rates are taken over.
RATE_MINUTES = 5


@dataclass(frozen=True, slots=True)
class Rates:
    """A namespace's deliveries: per minute over the last RATE_MINUTES whole minutes and the
    current one so far (or since the minute its deliveries began, when that is later; None
    until a minute of them is recorded), and the last hour's."""

    fires_per_min: float | None = 0.0
    failed_per_min: float | None = 0.0
    hour_fires: int = 0
    hour_failed: int = 0
    hour_dead: int = 0
    #: What the per-minute rates are taken over (ms); None: no rate yet.
    window_ms: int | None = RATE_MINUTES * 60_000

    @property
    def window(self) -> str:
        """The rates' window as a person reads it (the cells' hover text)."""
        if self.window_ms is None:
            return "less than a minute of deliveries recorded yet: no rate"
        return f"per minute over the last {views.duration_text(self.window_ms)}"


@dataclass(frozen=True, slots=True)
class NamespaceSummary:
    namespace: str
    counts: dict[str, int]
    rates: Rates = field(default_factory=Rates)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True, slots=True)
class Execution:
    namespace: str
    id: str
    nominal_at: dt.datetime
    is_trigger: bool
    attempts: int
    status: str
    http_status: int | None
    error: str | None
    finished_at: dt.datetime
    lateness_ms: int
    started_at: dt.datetime | None = None
    #: A backfilled delivery (its own row beside the regular occurrence's).
    is_backfill: bool = False
    #: Each failed attempt, oldest first (``executions.failed_attempts``), one per attempt.
    failed_attempts: tuple[views.Attempt, ...] = ()

    @property
    def tries(self) -> list[views.Attempt]:
        """Every attempt known, oldest first: the failed ones, and the last if it succeeded."""
        found = list(self.failed_attempts)
        if self.status == "succeeded" and self.started_at is not None:
            found.append(
                views.Attempt(
                    self.attempts,
                    self.http_status,
                    None,
                    round(self.started_at.timestamp() * 1000),
                    round(self.finished_at.timestamp() * 1000),
                )
            )
        return found

    @property
    def error_text(self) -> str:
        """The Error cell: this row's error, else its failed attempts' (a retried success)."""
        return views.error_text(self.error, self.failed_attempts)

    @property
    def latency_ms(self) -> int | None:
        """Time the last attempt took (start to finish)."""
        if self.started_at is None:
            return None
        return round((self.finished_at - self.started_at).total_seconds() * 1000)

    @property
    def failed(self) -> bool:
        return self.status in FAILED_STATUSES


@dataclass(slots=True)
class LiveState:
    """Where the schedule stands in the Redis index right now."""

    due_ms: int | None = None
    lease_ms: int | None = None
    attempt: int | None = None

    @property
    def label(self) -> str:
        if self.lease_ms is not None:
            return "in flight"
        if self.due_ms is not None:
            return "due"
        return "not indexed"


@dataclass(slots=True)
class ScheduleSummary:
    namespace: str
    id: str
    version: int
    state: str
    definition: dict[str, Any]
    compact: bytes
    labels: dict[str, str]
    fires: int
    last_fire_at: dt.datetime | None
    next_fire_at: dt.datetime | None
    updated_at: dt.datetime
    last: Execution | None = None
    live: LiveState = field(default_factory=LiveState)
    #: Counters (fires, succeeded, failed, ...) where the schema keeps them.
    stats: dict[str, Any] = field(default_factory=dict)
    paused_reason: str | None = None
    created_at: dt.datetime | None = None


@dataclass(frozen=True, slots=True)
class ScheduleFilter:
    """A list page's query: the id prefix, one label, one state, and the cursor (an id)."""

    search: str = ""
    label: tuple[str, str] | None = None
    state: str | None = None
    after: str = ""


@dataclass(frozen=True, slots=True)
class CommandRecord:
    seq: int
    received_at: dt.datetime
    verb: str | None
    user_id: str | None
    app_id: str | None
    outcome: str
    version: int | None


def _summary(record: asyncpg.Record) -> ScheduleSummary:
    definition = record["definition"]
    summary = ScheduleSummary(
        namespace=record["namespace"],
        id=record["id"],
        version=record["version"],
        state=record["state"],
        definition=definition,
        compact=bytes(record["compact"]),
        labels=record["labels"],
        fires=record["fires"],
        last_fire_at=record["last_fire_at"],
        next_fire_at=record["next_fire_at"],
        updated_at=record["updated_at"],
        stats=dict(record["stats"]) if "stats" in record.keys() and record["stats"] else {},  # noqa: SIM118
        paused_reason=record["paused_reason"] if "paused_reason" in record.keys() else None,  # noqa: SIM118
    )
    if "created_at" in record.keys():  # noqa: SIM118 - asyncpg records are not mappings
        summary.created_at = record["created_at"]
    if "last_status" in record.keys() and record["last_status"] is not None:  # noqa: SIM118
        summary.last = Execution(
            namespace=summary.namespace,
            id=summary.id,
            nominal_at=record["last_fire_at"] or record["last_finished_at"],
            is_trigger=False,
            attempts=0,
            status=record["last_status"],
            http_status=record["last_http_status"],
            error=record["last_error"],
            finished_at=record["last_finished_at"],
            lateness_ms=record["last_lateness_ms"],
        )
    return summary


def _execution(namespace: str, schedule_id: str, record: asyncpg.Record) -> Execution:
    return Execution(
        namespace=namespace,
        id=schedule_id,
        nominal_at=record["nominal_at"],
        is_trigger=record["is_trigger"],
        is_backfill=record["is_backfill"],
        attempts=record["attempts"],
        status=record["status"],
        http_status=record["http_status"],
        error=record["error"],
        finished_at=record["finished_at"],
        lateness_ms=record["lateness_ms"],
        started_at=record["started_at"] if "started_at" in record.keys() else None,  # noqa: SIM118
        failed_attempts=views.attempts_of(
            record["failed_attempts"] if "failed_attempts" in record.keys() else None  # noqa: SIM118
        ),
    )


def _rates(row: asyncpg.Record, now: dt.datetime) -> Rates:
    now_ms = _ms(now)
    first = row["first_minute"]
    start = views.rate_window_start(now_ms, RATE_MINUTES, None if first is None else _ms(first))
    return Rates(
        views.per_minute(int(row["recent_fires"] or 0), start, now_ms),
        views.per_minute(int(row["recent_failed"] or 0), start, now_ms),
        int(row["hour_fires"] or 0),
        int(row["hour_failed"] or 0),
        int(row["hour_dead"] or 0),
        None if start is None else now_ms - start,
    )


def _ms(at: dt.datetime) -> int:
    return round(at.timestamp() * 1000)


async def _init_connection(conn: asyncpg.Connection) -> None:
    for kind in ("json", "jsonb"):
        await conn.set_type_codec(
            kind,
            encoder=lambda value: codec.dumps(value).decode(),
            decoder=codec.loads,
            schema="pg_catalog",
        )


class ReadModel:
    """The console's queries over one pool of its own."""

    def __init__(self, pool: asyncpg.Pool, index: Index | None, page_size: int) -> None:
        self.pool = pool
        self.index = index
        self.page_size = page_size

    @classmethod
    async def open(cls, url: str, index: Index | None, page_size: int) -> ReadModel:
        pool = await asyncpg.create_pool(
            url,
            min_size=1,
            max_size=4,
            init=_init_connection,
            command_timeout=10,
            # The list queries take their bounds and label filter as parameters: a plan made
            # for the values at hand picks the right index, a generic one may scan.
            server_settings={
                "plan_cache_mode": "force_custom_plan",
                "application_name": "cronbus-console",
            },
        )
        assert pool is not None
        return cls(pool, index, page_size)

    async def close(self) -> None:
        await self.pool.close()

    async def ping(self) -> None:
        await self.pool.fetchval("SELECT 1")

    async def namespaces(self, now: dt.datetime) -> list[NamespaceSummary]:
        counts: dict[str, dict[str, int]] = {}
        for row in await self.pool.fetch(QUERIES["console_namespaces"]):
            counts.setdefault(row["namespace"], {})[row["state"]] = row["schedules"]
        this_minute = now.replace(second=0, microsecond=0)
        recent = this_minute - dt.timedelta(minutes=RATE_MINUTES)
        rows = await self.pool.fetch(QUERIES["console_rates"], now - dt.timedelta(hours=1), recent)
        rates = {row["namespace"]: _rates(row, now) for row in rows}
        names = sorted(set(counts) | set(rates))
        return [NamespaceSummary(n, counts.get(n, {}), rates.get(n, Rates())) for n in names]

    async def namespace_known(self, namespace: str, now: dt.datetime) -> bool:
        """Whether the home page lists the namespace: it has a schedule, or deliveries in the
        last hour (its schedules deleted since)."""
        known = await self.pool.fetchval(
            QUERIES["console_namespace_known"], namespace, now - dt.timedelta(hours=1)
        )
        return bool(known)

    async def schedules(self, namespace: str, where: ScheduleFilter) -> list[ScheduleSummary]:
        low, high = views.prefix_bounds(where.search)
        labels = {where.label[0]: where.label[1]} if where.label else {}
        args: list[Any] = [namespace, where.after, low, high, labels, self.page_size + 1]
        name = "console_schedules"
        if where.state is not None:
            name = "console_schedules_in_state"
            args.append(where.state)
        rows = [_summary(r) for r in await self.pool.fetch(QUERIES[name], *args)]
        await self.fill_live(rows)
        return rows

    async def schedule(self, namespace: str, schedule_id: str) -> ScheduleSummary | None:
        row = await self.pool.fetchrow(QUERIES["console_schedule"], namespace, schedule_id)
        if row is None:
            return None
        found = _summary(row)
        await self.fill_live([found])
        return found

    async def executions(
        self, namespace: str, schedule_id: str, before: dt.datetime, limit: int
    ) -> list[Execution]:
        rows = await self.pool.fetch(
            QUERIES["console_executions"], namespace, schedule_id, before, limit
        )
        return [_execution(namespace, schedule_id, r) for r in rows]

    async def failures(self, before: dt.datetime, namespace: str = "") -> list[Execution]:
        rows = await self.pool.fetch(
            QUERIES["console_failures"], before, self.page_size + 1, namespace
        )
        return [_execution(r["namespace"], r["id"], r) for r in rows]

    async def commands(self, namespace: str, schedule_id: str, limit: int) -> list[CommandRecord]:
        rows = await self.pool.fetch(QUERIES["console_commands"], namespace, schedule_id, limit)
        return [
            CommandRecord(
                r["seq"],
                r["received_at"],
                r["verb"],
                r["user_id"],
                r["app_id"],
                r["outcome"],
                r["version"],
            )
            for r in rows
        ]

    async def fill_live(self, summaries: Sequence[ScheduleSummary]) -> None:
        """Due time, lease and attempt of each schedule, in one pipeline."""
        index = self.index
        if index is None or not summaries:
            return
        pipe = index.client.pipeline(transaction=False)
        for summary in summaries:
            shard = keys.shard_of(summary.namespace, summary.id, index.shards)
            member = keys.member(summary.namespace, summary.id)
            pipe.zscore(index.keys.due(shard), member)
            pipe.zscore(index.keys.lease(shard), member)
            pipe.hget(index.keys.occ(shard), member)
        values = await pipe.execute()
        for i, summary in enumerate(summaries):
            due, lease, occ = values[3 * i : 3 * i + 3]
            summary.live = LiveState(
                due_ms=None if due is None else int(due),
                lease_ms=None if lease is None else int(lease),
                attempt=views.attempt_of(occ),
            )
