"""PostgreSQL, the source of truth: schedules, the command audit, executions and checkpoints.

Only this module runs queries (all of them named, in ``shared/postgres/sql/queries.sql``). Writes on
the firing path (executions, checkpoints) always go in batches: one statement per batch.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg

from shared.contract import codec, keys
from shared.contract.errors import StoreError
from shared.contract.rows import (
    AmqpTargetRow,
    AppliedCommand,
    Backfill,
    BackfillProgress,
    Checkpoint,
    CommandAudit,
    ExecutionRow,
    LiveBackfill,
    LiveSchedule,
    NewScheduleRow,
    PendingRun,
    PendingRunRow,
    ScheduleRow,
)
from shared.postgres import audit, columns
from shared.postgres.sql import QUERIES
from shared.rules import compact

#: Above every value of the integer column ``priority``: the rebuild's walk starts below it.
ABOVE_ANY_PRIORITY = 2**31

#: A connection, pooled or not.
Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


async def _init_connection(conn: Connection) -> None:
    for kind in ("json", "jsonb"):
        await conn.set_type_codec(
            kind,
            encoder=lambda value: codec.dumps(value).decode(),
            decoder=codec.loads,
            schema="pg_catalog",
        )


@dataclass
class Store:
    pool: asyncpg.Pool
    #: The form schedules' compact values are written in (CRONBUS_COMPACT_FORM).
    compact_form: compact.Form = "binary"

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        min_size: int = 1,
        max_size: int = 8,
        compact_form: compact.Form = "binary",
    ) -> Store:
        pool = await asyncpg.create_pool(
            url,
            min_size=min_size,
            max_size=max_size,
            init=_init_connection,
            command_timeout=30,
        )
        assert pool is not None
        return cls(pool, compact_form)

    async def close(self) -> None:
        await self.pool.close()

    async def ping(self) -> None:
        await self.pool.fetchval("SELECT 1")

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Connection]:
        async with self.pool.acquire() as conn, conn.transaction():
            yield conn

    # --- schedules ----------------------------------------------------------------------------

    async def lock_schedule(
        self, conn: Connection, namespace: str, schedule_id: str
    ) -> ScheduleRow | None:
        record = await conn.fetchrow(QUERIES["lock_schedule"], namespace, schedule_id)
        return None if record is None else ScheduleRow.of(record)

    async def lock_schedules(
        self, conn: Connection, namespace: str, ids: Sequence[str]
    ) -> dict[str, ScheduleRow]:
        records = await conn.fetch(QUERIES["lock_schedules"], namespace, list(ids))
        return {record["id"]: ScheduleRow.of(record) for record in records}

    async def put_schedules(
        self, conn: Connection, rows: Sequence[NewScheduleRow], *, fenced: bool = False
    ) -> int:
        """Create or replace many schedules: one COPY into a staging table, one statement.
        Returns how many were written: ``fenced``, a row is replaced only from an older version
        (a creation that raced the caller's look at the table is left as it is)."""
        await conn.execute(QUERIES["create_schedule_staging"])
        await conn.copy_records_to_table(
            "schedule_staging",
            records=[
                (
                    r.namespace,
                    r.id,
                    r.version,
                    r.state,
                    columns.json_text(r.definition),
                    compact.stored_form(r.compact, self.compact_form),
                    r.priority,
                    codec.dumps(r.labels).decode(),
                    r.fires,
                    r.last_fire_ms,
                    r.next_fire_ms,
                    r.rotation_version,
                )
                for r in rows
            ],
        )
        status = await conn.execute(QUERIES["put_staged_schedules"], fenced)
        return int(status.rsplit(" ", 1)[-1])

    async def get_schedule(self, namespace: str, schedule_id: str) -> ScheduleRow | None:
        record = await self.pool.fetchrow(QUERIES["get_schedule"], namespace, schedule_id)
        return None if record is None else ScheduleRow.of(record)

    async def get_schedules_and_audit(
        self, members: Sequence[tuple[str, str]], audits: Sequence[CommandAudit]
    ) -> dict[tuple[str, str], ScheduleRow]:
        """Many schedules by (namespace, id), writing the gets' audit rows: one round trip."""
        records = await self.pool.fetch(
            QUERIES["get_schedules_and_audit"],
            [ns for ns, _ in members],
            [i for _, i in members],
            *columns.audit_columns(audits),
        )
        return {(r["namespace"], r["id"]): ScheduleRow.of(r) for r in records}

    async def put_schedule(self, conn: Connection, row: NewScheduleRow) -> ScheduleRow:
        record = await conn.fetchrow(
            QUERIES["put_schedule"],
            row.namespace,
            row.id,
            row.version,
            row.state,
            codec.loads(row.definition) if isinstance(row.definition, bytes) else row.definition,
            compact.stored_form(row.compact, self.compact_form),
            row.priority,
            row.labels,
            row.fires,
            row.last_fire_ms,
            row.next_fire_ms,
            row.rotation_version,
        )
        if record is None:
            raise StoreError("put_schedule returned no row")
        return ScheduleRow.of(record)

    async def list_schedules(
        self,
        namespace: str,
        *,
        state: str | None,
        labels: dict[str, str],
        after_id: str,
        limit: int,
    ) -> list[ScheduleRow]:
        records = await self.pool.fetch(
            QUERIES["list_schedules"], namespace, state, labels, after_id, limit
        )
        return [ScheduleRow.of(record) for record in records]

    async def record_command(self, audit: CommandAudit, conn: Connection | None = None) -> None:
        """One audit row. Whatever a hostile command carried, the row can be stored: text loses
        its NULs (PostgreSQL refuses them) and long values are cut."""
        target: Any = conn if conn is not None else self.pool
        await target.execute(
            QUERIES["record_command"],
            columns.audit_text(audit.namespace),
            columns.audit_text(audit.verb),
            columns.audit_text(audit.schedule_id),
            columns.audit_text(audit.user_id),
            columns.audit_text(audit.app_id),
            columns.audit_text(audit.message_id),
            columns.audit_text(audit.correlation_id),
            columns.audit_json(audit.body),
            columns.audit_text(audit.outcome),
            columns.audit_json(audit.error),
            audit.version,
            columns.audit_json(audit.reply),
        )

    async def lock_schedule_keys(
        self, conn: Connection, members: Sequence[tuple[str, str]]
    ) -> tuple[int, dict[tuple[str, str], ScheduleRow]]:
        """The transaction's now() (ms) and the schedules of any namespaces, locked in key order
        (no deadlock between batches)."""
        namespaces, ids = [ns for ns, _ in members], [i for _, i in members]
        await conn.execute(QUERIES["lock_schedule_key_names"], namespaces, ids)
        # A statement of its own: its snapshot shows a creation committed while waiting.
        records = await conn.fetch(QUERIES["lock_schedule_keys"], namespaces, ids)
        rows = {(r["namespace"], r["id"]): ScheduleRow.of(r) for r in records if r["id"]}
        return int(records[0]["txn_now_ms"]), rows

    async def put_schedules_and_audit(
        self, conn: Connection, rows: Sequence[NewScheduleRow], audits: Sequence[CommandAudit]
    ) -> None:
        """Group commit's writes: the schedules and the audit rows, in one statement."""
        await conn.execute(
            QUERIES["put_schedules_and_audit"],
            [r.namespace for r in rows],
            [r.id for r in rows],
            [r.version for r in rows],
            [r.state for r in rows],
            [columns.as_json(r.definition) for r in rows],
            [compact.stored_form(r.compact, self.compact_form) for r in rows],
            [r.priority for r in rows],
            [r.labels for r in rows],
            [r.fires for r in rows],
            [r.last_fire_ms for r in rows],
            [r.next_fire_ms for r in rows],
            [r.rotation_version for r in rows],
            *columns.audit_columns(audits),
        )

    async def lock_message_ids(self, conn: Connection, members: Sequence[tuple[str, str]]) -> None:
        """Hold (namespace, message_id) until the transaction ends, for a replay check after."""
        if members:
            wanted = sorted(set(members))
            await conn.execute(
                QUERIES["lock_message_ids"], [ns for ns, _ in wanted], [m for _, m in wanted]
            )

    async def command_recorded(self, message_id: str, conn: Connection | None = None) -> bool:
        """Whether a committed audit row carries ``message_id``."""
        target: Any = conn if conn is not None else self.pool
        return bool(await target.fetchval(QUERIES["command_recorded"], message_id))

    async def applied_commands(
        self, conn: Connection, members: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], AppliedCommand]:
        """(namespace, message_id) -> the command already applied under it, for each given."""
        wanted = set(members)
        if not wanted:
            return {}
        records = await conn.fetch(QUERIES["applied_commands"], sorted({mid for _, mid in wanted}))
        return {
            (r["namespace"], r["message_id"]): AppliedCommand(r["verb"], r["body"], r["reply"])
            for r in records
            if (r["namespace"], r["message_id"]) in wanted
        }

    async def applied_command(self, namespace: str, message_id: str) -> AppliedCommand | None:
        """The command already applied under this message id in ``namespace``, if any."""
        record = await self.pool.fetchrow(QUERIES["applied_command"], namespace, message_id)
        if record is None:
            return None
        return AppliedCommand(record["verb"], record["body"], record["reply"])

    async def execution_exists(
        self, namespace: str, schedule_id: str, nominal_ms: int, *, is_trigger: bool = False
    ) -> bool:
        return bool(
            await self.pool.fetchval(
                QUERIES["execution_exists"], namespace, schedule_id, nominal_ms, is_trigger
            )
        )

    # --- pending runs (outside the rotation, durable until they complete) ---------------------

    async def add_pending_run(self, conn: Connection, run: PendingRun) -> bool:
        """False when that very run is pending already (nothing written)."""
        added = await conn.fetchval(
            QUERIES["add_pending_run"], run.namespace, run.id, run.kind, run.nominal_ms
        )
        return added is not None

    async def drop_pending_runs(
        self, conn: Connection, namespace: str, schedule_id: str
    ) -> list[PendingRun]:
        records = await conn.fetch(QUERIES["drop_pending_runs"], namespace, schedule_id)
        return [PendingRun(r["namespace"], r["id"], r["kind"], r["nominal_ms"]) for r in records]

    async def pending_run_exists(self, run: PendingRun) -> bool:
        return bool(
            await self.pool.fetchval(
                QUERIES["pending_run_exists"], run.namespace, run.id, run.kind, run.nominal_ms
            )
        )

    async def live_pending_runs(self, batch: int) -> AsyncIterator[list[PendingRunRow]]:
        """Every pending run of a schedule that is not deleted, ``batch`` rows at a time."""
        async with self.pool.acquire() as conn, conn.transaction(readonly=True):
            chunk: list[PendingRunRow] = []
            async for record in conn.cursor(QUERIES["live_pending_runs"], prefetch=batch):
                chunk.append(PendingRunRow.of(record))
                if len(chunk) >= batch:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk

    async def old_pending_runs(self, before_ms: int, limit: int) -> list[PendingRunRow]:
        """Pending runs accepted before ``before_ms``, oldest first, at most ``limit``."""
        records = await self.pool.fetch(QUERIES["old_pending_runs"], before_ms, limit)
        return [PendingRunRow.of(record) for record in records]

    # --- backfills (durable until they complete) -----------------------------------------------

    async def next_backfill_generation(
        self, conn: Connection, namespace: str, schedule_id: str, now_ms: int
    ) -> int:
        """Newer than the schedule's running backfill's (call under the schedule's row lock)."""
        return int(
            await conn.fetchval(QUERIES["next_backfill_generation"], namespace, schedule_id, now_ms)
        )

    async def put_backfill(self, conn: Connection, backfill: Backfill) -> None:
        """Start a backfill, replacing the schedule's; one with nothing left is dropped."""
        if backfill.remaining <= 0:
            await self.drop_backfill(conn, backfill.namespace, backfill.id)
            return
        await conn.execute(
            QUERIES["put_backfill"],
            backfill.namespace,
            backfill.id,
            backfill.generation,
            backfill.from_ms,
            backfill.to_ms,
            backfill.limit,
            backfill.next_ms,
            backfill.remaining,
        )

    async def drop_backfill(self, conn: Connection, namespace: str, schedule_id: str) -> None:
        await conn.execute(QUERIES["drop_backfill"], namespace, schedule_id)

    async def live_backfills(self, batch: int) -> AsyncIterator[list[LiveBackfill]]:
        """Every backfill of a schedule in rotation or paused, ``batch`` rows at a time."""
        async with self.pool.acquire() as conn, conn.transaction(readonly=True):
            chunk: list[LiveBackfill] = []
            async for record in conn.cursor(QUERIES["live_backfills"], prefetch=batch):
                chunk.append(LiveBackfill.of(record))
                if len(chunk) >= batch:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk

    async def kept_backfill(self, namespace: str, schedule_id: str) -> LiveBackfill | None:
        """The schedule's running backfill (None: none, or the schedule is not live)."""
        record = await self.pool.fetchrow(QUERIES["kept_backfill"], namespace, schedule_id)
        return None if record is None else LiveBackfill.of(record)

    async def old_backfills(self, before_ms: int, limit: int) -> list[LiveBackfill]:
        """Backfills started before ``before_ms``, oldest first, at most ``limit``."""
        records = await self.pool.fetch(QUERIES["old_backfills"], before_ms, limit)
        return [LiveBackfill.of(record) for record in records]

    # --- the firing path (batched) ------------------------------------------------------------

    async def write_audit(
        self,
        rows: Sequence[ExecutionRow] = (),
        checkpoints: Sequence[Checkpoint] = (),
        backfills: Sequence[BackfillProgress] = (),
        *,
        flush_id: uuid.UUID | None = None,
    ) -> bool:
        """An executor's flush in one transaction: execution rows with the stats and minutes
        they add, rotation checkpoints, backfill progress. All or nothing, and at most once per
        ``flush_id``: a flush retried after its commit (whose answer was lost) writes nothing
        and returns False."""
        async with self.transaction() as conn:
            if flush_id is not None and not await conn.fetchval(
                QUERIES["claim_audit_flush"], flush_id
            ):
                return False
            await audit.write_audit(conn, rows, checkpoints, backfills)
        return True

    async def write_executions(self, rows: Sequence[ExecutionRow]) -> None:
        """Execution rows alone (with the pending runs they finish), in one transaction."""
        async with self.transaction() as conn:
            await audit.write_executions(conn, columns.executions(rows))

    async def write_checkpoints(self, rows: Sequence[Checkpoint]) -> None:
        """Rotation checkpoints alone (the sweeper's), in one transaction."""
        async with self.transaction() as conn:
            await audit.write_checkpoints(conn, rows)

    async def write_stats(self, deltas: Sequence[Any]) -> None:
        """Per-schedule stats deltas (``shared.policy.stats.Delta``), one statement."""
        await audit.write_stats(self.pool, deltas)

    async def write_minutes(self, entries: Sequence[Any]) -> None:
        """Per-namespace minutes (``shared.policy.stats.Minute``), one statement."""
        await audit.write_minutes(self.pool, entries)

    async def write_backfill_progress(self, items: Sequence[BackfillProgress]) -> None:
        """Backfill completions alone, in one transaction."""
        async with self.transaction() as conn:
            await audit.write_backfill_progress(conn, items)

    async def trim_minutes(self, before: dt.datetime) -> None:
        await self.pool.execute(QUERIES["trim_minutes"], before)

    async def trim_audit_flushes(self, before: dt.datetime) -> None:
        await self.pool.execute(QUERIES["trim_audit_flushes"], before)

    async def schedule_stats(self, namespace: str, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """id -> its ``schedule_stats`` row, for the given schedules of a namespace."""
        records = await self.pool.fetch(QUERIES["schedule_stats"], namespace, list(ids))
        return {record["id"]: dict(record) for record in records}

    async def count_live_schedules(self, conn: Connection, namespace: str) -> int:
        """Live schedules of a namespace, holding its creation lock until the transaction ends."""
        await conn.execute(QUERIES["lock_namespace_creations"], namespace)
        # Counted in a new statement, so with a snapshot taken after the lock was granted.
        record = await conn.fetchrow(QUERIES["count_live_schedules"], namespace)
        return int(record["live"]) if record is not None else 0

    async def reset_stats(self, conn: Connection, namespace: str, schedule_id: str) -> None:
        await conn.execute(QUERIES["reset_stats"], namespace, schedule_id)

    async def reset_stats_many(self, conn: Connection, members: Sequence[tuple[str, str]]) -> None:
        if members:
            await conn.execute(
                QUERIES["reset_stats_many"], [ns for ns, _ in members], [i for _, i in members]
            )

    async def mark_paused_for_failures(
        self, conn: Connection, namespace: str, schedule_id: str, version: int
    ) -> None:
        await conn.execute(QUERIES["mark_paused_for_failures"], namespace, schedule_id, version)

    async def recent_executions(
        self, namespace: str, schedule_id: str, limit: int
    ) -> list[dict[str, Any]]:
        records = await self.pool.fetch(QUERIES["recent_executions"], namespace, schedule_id, limit)
        return [dict(record) for record in records]

    async def analyze_schedules(self) -> None:
        await self.pool.execute(QUERIES["analyze_schedules"])

    async def live_schedules(self, batch: int) -> AsyncIterator[list[LiveSchedule]]:
        """Every active or paused schedule, highest priority first, ``batch`` rows at a time.

        Keyset pages, each its own short statement: one cursor over the whole table was planned
        as a sort of every row when the table had no statistics (10,000,000 rows outlasted the
        statement timeout, so a rebuild never started), and it held one snapshot for minutes,
        which keeps vacuum and page pruning from the executors' checkpoint updates. A schedule a
        command changes meanwhile may be read at its newer version or, if its priority moved to
        one already read, not at all: the command wrote the index itself in both cases."""
        # From above any integer, not above MAX_PRIORITY: the column has no such bound, and a
        # row written past it (by hand, or by a release with wider bounds) must be rebuilt too.
        priority = await self.pool.fetchval(QUERIES["live_priority_below"], ABOVE_ANY_PRIORITY)
        while priority is not None:
            after = ("", "")
            while True:
                records = await self.pool.fetch(
                    QUERIES["live_schedules_page"], priority, *after, batch
                )
                if records:
                    yield [LiveSchedule.of(record) for record in records]
                if len(records) < batch:
                    break
                after = (records[-1]["namespace"], records[-1]["id"])
            priority = await self.pool.fetchval(QUERIES["live_priority_below"], priority)

    async def live_versions_after(
        self, after: tuple[str, str], limit: int
    ) -> list[tuple[str, str, int]]:
        """(namespace, id, version) of at most ``limit`` active or paused schedules whose key
        comes after ``after`` (``("", "")``: from the first), in key order."""
        records = await self.pool.fetch(QUERIES["live_versions_after"], *after, limit)
        return [(r["namespace"], r["id"], r["version"]) for r in records]

    async def amqp_targets(self, batch: int) -> AsyncIterator[list[AmqpTargetRow]]:
        """Every active or paused schedule with an AMQP target, ``batch`` at a time, in key
        order; keyset pages, each its own short statement (no snapshot held for long)."""
        after = ("", "")
        while True:
            records = await self.pool.fetch(QUERIES["amqp_targets_after"], *after, batch)
            if records:
                yield [
                    AmqpTargetRow(r["namespace"], r["id"], r["state"], r["exchange"] or "")
                    for r in records
                ]
            if len(records) < batch:
                return
            after = (records[-1]["namespace"], records[-1]["id"])

    async def schedule_states(
        self, members: Sequence[tuple[str, str]]
    ) -> dict[str, tuple[str, int]]:
        """``namespace/id`` -> (state, version), for those of these schedules that have a row."""
        records = await self.pool.fetch(
            QUERIES["schedule_states"], [ns for ns, _ in members], [i for _, i in members]
        )
        return {keys.member(r["namespace"], r["id"]): (r["state"], r["version"]) for r in records}

    async def changed_schedules(
        self, since_ms: int, batch: int
    ) -> AsyncIterator[list[LiveSchedule]]:
        """Schedules a command changed since ``since_ms``, ``batch`` rows at a time."""
        async for chunk in self._stream(QUERIES["changed_schedules"], batch, since_ms):
            yield chunk

    async def _stream(
        self, query: str, batch: int, *args: object
    ) -> AsyncIterator[list[LiveSchedule]]:
        """A server-side cursor: memory stays at one batch however many rows match."""
        async with self.pool.acquire() as conn, conn.transaction(readonly=True):
            chunk: list[LiveSchedule] = []
            async for record in conn.cursor(query, *args, prefetch=batch):
                chunk.append(LiveSchedule.of(record))
                if len(chunk) >= batch:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk

    async def clock_ms(self) -> int:
        """PostgreSQL's clock, which stamps ``updated_at``."""
        return int(await self.pool.fetchval(QUERIES["clock_ms"]))

    async def index_generation(self) -> int:
        """The generation the Redis index must be at (or ahead of)."""
        return int(await self.pool.fetchval(QUERIES["index_generation"]))

    async def advance_index_generation(self, generation: int) -> None:
        await self.pool.execute(QUERIES["advance_index_generation"], generation)

    async def rewrite_compact_form(self, form: compact.Form, batch: int = 1000) -> int:
        """Store every schedule's compact value in ``form`` (``cronbus migrate --compact-form``):
        before going back to a version that reads only JSON, or to convert the table at once.
        Keyset pages, each its own short statement; returns how many rows were rewritten."""
        rewritten = 0
        after = ("", "")
        while True:
            records = await self.pool.fetch(QUERIES["compact_page"], *after, batch)
            other = [r for r in records if compact.is_json(r["compact"]) != (form == "json")]
            if other:
                status = await self.pool.execute(
                    QUERIES["rewrite_compact"],
                    [r["namespace"] for r in other],
                    [r["id"] for r in other],
                    [r["version"] for r in other],
                    [compact.stored_form(r["compact"], form) for r in other],
                )
                rewritten += int(status.split()[-1])
            if len(records) < batch:
                return rewritten
            after = (records[-1]["namespace"], records[-1]["id"])

    async def schedule_versions(self, members: Sequence[tuple[str, str]]) -> list[LiveSchedule]:
        records = await self.pool.fetch(
            QUERIES["schedule_versions"], [ns for ns, _ in members], [i for _, i in members]
        )
        return [LiveSchedule.of(record) for record in records]
