"""Command intake: schedule commands from ``cronbus.commands`` into PostgreSQL, then the index.

Every command is validated first (a bad one changes nothing and gets an error reply naming the
field), applied to PostgreSQL in one transaction with its audit row, then written to the Redis
index, then answered on ``reply_to``. A body that cannot be parsed goes to the dead-letter
queue with the reason in a header.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from shared import (
    amqp,
    codec,
    compact,
    keys,
    metrics,
    models,
    rotation,
    schedule,
    timefmt,
    transient,
    validation,
)
from shared.config import DispatcherSettings
from shared.errors import ValidationFailed
from shared.index import Index
from shared.plan import AfterCompletionRule, Plan
from shared.store import CommandAudit, NewScheduleRow, PendingRun, ScheduleRow, Store

log = logging.getLogger(__name__)

NEXT_FIRES_SHOWN = 5
#: How far (ms) a trigger may move forward to get an identity of its own.
MAX_TRIGGER_SHIFT_MS = 1000
Wake = Callable[[int, int], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Meta:
    """Who sent a command and where to answer, from the AMQP properties."""

    routing_key: str
    reply_to: str | None = None
    correlation_id: str | None = None
    user_id: str | None = None
    app_id: str | None = None
    message_id: str | None = None

    @classmethod
    def of(cls, message: AbstractIncomingMessage) -> Meta:
        return cls(
            routing_key=message.routing_key or "",
            reply_to=message.reply_to,
            correlation_id=message.correlation_id,
            user_id=message.user_id,
            app_id=message.app_id,
            message_id=message.message_id,
        )


class Unparseable(ValidationFailed):
    """The message is not a command at all: it goes to the dead-letter queue."""


def split_routing_key(routing_key: str) -> tuple[str, str]:
    namespace, dot, verb = routing_key.partition(".")
    if not dot or not namespace or not verb:
        raise Unparseable(
            "invalid_command",
            f"routing key {routing_key!r} is not <namespace>.<verb>",
            [{"field": "routing_key", "reason": "must be <namespace>.<verb>"}],
        )
    return namespace, verb


def encode_cursor(last_id: str) -> str:
    return base64.urlsafe_b64encode(last_id.encode()).decode()


def decode_cursor(cursor: str | None) -> str:
    if not cursor:
        return ""
    try:
        return base64.urlsafe_b64decode(cursor.encode()).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ValidationFailed(
            "invalid_command",
            "cursor: is not a cursor this cronbus returned",
            [{"field": "cursor", "reason": "is not a cursor this cronbus returned"}],
        ) from None


def _next_fires(row: ScheduleRow, plan: Plan, now_ms: int) -> list[str]:
    if row.state != "active":
        return []
    remaining = NEXT_FIRES_SHOWN
    if plan.max_fires is not None:
        remaining = min(remaining, max(plan.max_fires - row.fires, 0))
    times: list[int] = []
    current = row.next_fire_ms
    if current is None or current < now_ms:
        times = schedule.upcoming(plan, now_ms, remaining, fires=0)
    else:
        while current is not None and len(times) < remaining:
            times.append(current)
            current = (
                None
                if isinstance(plan.rule, AfterCompletionRule)
                else (schedule.next_nominal(plan, current))
            )
    return [timefmt.format_ms(t) for t in times]


def view(row: ScheduleRow, now_ms: int) -> dict[str, Any]:
    """A schedule as replies show it: the definition plus what cronbus assigns."""
    out = dict(row.definition)
    out.update(
        namespace=row.namespace,
        version=row.version,
        state=row.state,
        fires=row.fires,
        last_fire_at=None if row.last_fire_ms is None else timefmt.format_ms(row.last_fire_ms),
        next_fires=[]
        if row.state == "deleted"
        else _next_fires(row, compact.decode(row.compact), now_ms),
        created_at=timefmt.format_ms(row.created_ms),
        updated_at=timefmt.format_ms(row.updated_ms),
    )
    return out


def not_found(namespace: str, schedule_id: str) -> ValidationFailed:
    return ValidationFailed(
        "not_found",
        f"no schedule {namespace}/{schedule_id}",
        [{"field": "id", "reason": f"no schedule {schedule_id!r} in namespace {namespace!r}"}],
    )


class Intake:
    def __init__(
        self,
        settings: DispatcherSettings,
        store: Store,
        index: Index,
        channel: AbstractChannel,
        wake: Wake,
        stopping: asyncio.Event,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.stopping = stopping
        self.store = store
        self.index = index
        self.channel = channel
        self.wake = wake
        self.clock = clock
        self.policy = settings.target_policy()
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    # --- the message --------------------------------------------------------------------------

    async def handle(self, message: AbstractIncomingMessage) -> None:
        """Apply one command and answer it; dependency outages are waited out."""
        meta = Meta.of(message)
        try:
            reply = await transient.retry(
                lambda: self._apply(message.body, meta), what="command", stopping=self.stopping
            )
            await transient.retry(
                lambda: self._answer(meta, reply), what="command reply", stopping=self.stopping
            )
        except transient.Stopped:
            await message.nack(requeue=True)
            return
        await message.ack()

    async def _apply(self, body: bytes, meta: Meta) -> dict[str, Any]:
        verb: str | None = None
        namespace: str | None = None
        parsed: Any = None
        try:
            namespace, verb = split_routing_key(meta.routing_key)
            validation.check_namespace(namespace)
            try:
                parsed = validation.parse_body(body)
            except ValidationFailed as failure:
                raise Unparseable(failure.code, str(failure), failure.details) from None
            command = validation.parse_command(verb, parsed)
            async with self._lock_for(namespace, _schedule_id_of(parsed) or ""):
                reply = await self._execute(namespace, verb, command, meta, parsed)
        except ValidationFailed as failure:
            return await self._refuse(failure, namespace, verb, parsed, body, meta)
        metrics.COMMANDS.labels(verb, "ok").inc()
        return reply

    def _lock_for(self, namespace: str, schedule_id: str) -> asyncio.Lock:
        """Commands on one schedule run one at a time in this process, in arrival order."""
        key = (namespace, schedule_id)
        lock = self._locks.get(key)
        if lock is None:
            if len(self._locks) > 10_000:
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def _refuse(
        self,
        failure: ValidationFailed,
        namespace: str | None,
        verb: str | None,
        parsed: Any,
        body: bytes,
        meta: Meta,
    ) -> dict[str, Any]:
        error = {"code": failure.code, "message": str(failure), "details": failure.details}
        metrics.COMMANDS.labels(verb if verb in models.VERBS else "unknown", failure.code).inc()
        log.info(
            "command refused",
            extra={
                "action": "command_refused",
                "routing_key": meta.routing_key,
                "code": failure.code,
                "error": str(failure),
            },
        )
        schedule_id = _schedule_id_of(parsed)
        await self.store.record_command(
            CommandAudit(
                namespace=namespace,
                verb=verb,
                schedule_id=schedule_id,
                outcome=failure.code,
                body=parsed if isinstance(parsed, dict | list) else None,
                error=error,
                user_id=meta.user_id,
                app_id=meta.app_id,
                message_id=meta.message_id,
                correlation_id=meta.correlation_id,
            )
        )
        if isinstance(failure, Unparseable) or not meta.reply_to:
            # Nobody would hear of it otherwise: keep the message, with why, for an operator.
            await amqp.dead_letter(
                self.channel,
                keys.COMMANDS_QUEUE,
                body,
                f"{failure.code}: {failure}",
                {
                    "reply_to": meta.reply_to,
                    "correlation_id": meta.correlation_id,
                    "message_id": meta.message_id,
                    "headers": {"x-cronbus-routing-key": meta.routing_key},
                },
            )
            metrics.DEAD_LETTERED.labels(keys.COMMANDS_QUEUE).inc()
        return {"ok": False, "error": error}

    async def _answer(self, meta: Meta, reply: dict[str, Any]) -> None:
        if not meta.reply_to:
            return
        message = aio_pika.Message(
            codec.dumps(reply), content_type="application/json", correlation_id=meta.correlation_id
        )
        await self.channel.default_exchange.publish(
            message, routing_key=meta.reply_to, mandatory=False
        )

    # --- the verbs ----------------------------------------------------------------------------

    async def _execute(
        self, namespace: str, verb: str, command: models.Strict, meta: Meta, parsed: Any
    ) -> dict[str, Any]:
        audit = CommandAudit(
            namespace=namespace,
            verb=verb,
            schedule_id=_schedule_id_of(parsed),
            outcome="ok",
            body=parsed,
            user_id=meta.user_id,
            app_id=meta.app_id,
            message_id=meta.message_id,
            correlation_id=meta.correlation_id,
        )
        replayed = await self._replayed(namespace, verb, meta)
        if replayed is not None:
            return replayed
        if isinstance(command, models.UpsertCommand):
            return await self.upsert(namespace, command, audit)
        if isinstance(command, models.ListCommand):
            reply = await self.list(namespace, command)
            await self.store.record_command(audit)
            return reply
        assert isinstance(command, models.IdCommand)
        handlers = {
            "delete": self.delete,
            "pause": self.pause,
            "resume": self.resume,
            "trigger": self.trigger,
        }
        if verb == "get":
            reply = await self.get(namespace, command.id)
            await self.store.record_command(audit)
            return reply
        return await handlers[verb](namespace, command.id, audit)

    async def upsert(
        self, namespace: str, command: models.UpsertCommand, audit: CommandAudit
    ) -> dict[str, Any]:
        item = command.schedule
        now = self.now_ms()
        checked = validation.check_schedule(item, 0, now, self.policy)
        async with self.store.transaction() as conn:
            old = await self.store.lock_schedule(conn, namespace, item.id)
            live = old is not None and old.state != "deleted"
            current_version = old.version if old is not None and live else 0
            if command.expected_version is not None and command.expected_version != (
                current_version
            ):
                raise ValidationFailed(
                    "version_conflict",
                    f"expected version {command.expected_version}, found {current_version}",
                    [
                        {
                            "field": "expected_version",
                            "reason": f"the stored version is {current_version}",
                        }
                    ],
                )
            version = (old.version if old is not None else 0) + 1
            plan = dataclasses.replace(checked, version=version)
            current = _current_of(old) if live and old is not None else None
            placement = rotation.place_upsert(
                current, plan, item.paused, now, keys.member(namespace, item.id)
            )
            row = await self.store.put_schedule(
                conn,
                NewScheduleRow(
                    namespace,
                    item.id,
                    version,
                    placement.state,
                    item.model_dump(mode="json"),
                    compact.encode(plan),
                    item.priority,
                    item.labels,
                    placement.fires,
                    placement.last_fire_ms,
                    placement.next_nominal,
                    placement.rotation_version(version),
                ),
            )
            reply = {"ok": True, "created": not live, "schedule": view(row, now)}
            await self._record(conn, audit, version, reply)
        await self._index(namespace, item.id, plan, placement)
        return reply

    async def delete(self, namespace: str, schedule_id: str, audit: CommandAudit) -> dict[str, Any]:
        now = self.now_ms()
        async with self.store.transaction() as conn:
            old = await self._existing(conn, namespace, schedule_id)
            version = old.version + 1
            gone = rotation.Placement("deleted", None, None, old.fires, old.last_fire_ms)
            row = await self.store.put_schedule(conn, _next_version(old, gone, old.definition))
            dropped = await self.store.drop_pending_runs(conn, namespace, schedule_id)
            reply = {"ok": True, "schedule": view(row, now)}
            await self._record(conn, audit, version, reply)
        shard = self.index.shard_of(namespace, schedule_id)
        member = keys.member(namespace, schedule_id)
        # Its pending triggers go too, even one already handed to the broker: fenced out.
        gone_runs = [(m, None) for m in _trigger_members(dropped)]
        await self._write_index(lambda: self.index.remove({shard: [(member, version), *gone_runs]}))
        return reply

    async def pause(self, namespace: str, schedule_id: str, audit: CommandAudit) -> dict[str, Any]:
        return await self._change_state(namespace, schedule_id, audit, paused=True)

    async def resume(self, namespace: str, schedule_id: str, audit: CommandAudit) -> dict[str, Any]:
        return await self._change_state(namespace, schedule_id, audit, paused=False)

    async def _change_state(
        self, namespace: str, schedule_id: str, audit: CommandAudit, *, paused: bool
    ) -> dict[str, Any]:
        now = self.now_ms()
        async with self.store.transaction() as conn:
            old = await self._existing(conn, namespace, schedule_id)
            if old.state == "completed" or (old.state == "paused") == paused:
                # Already where the command asks it to be: nothing changes, no new version.
                unchanged = {"ok": True, "unchanged": True, "schedule": view(old, now)}
                await self._record(conn, audit, old.version, unchanged)
                return unchanged
            version = old.version + 1
            plan = dataclasses.replace(compact.decode(old.compact), version=version)
            current = _current_of(old)
            placement = (
                rotation.place_pause(current)
                if paused
                else rotation.place_resume(current, now, keys.member(namespace, schedule_id))
            )
            row = await self.store.put_schedule(
                conn, _next_version(old, placement, {**old.definition, "paused": paused})
            )
            reply = {"ok": True, "schedule": view(row, now)}
            await self._record(conn, audit, version, reply)
        await self._index(namespace, schedule_id, plan, placement)
        return reply

    async def trigger(
        self, namespace: str, schedule_id: str, audit: CommandAudit
    ) -> dict[str, Any]:
        async with self.store.transaction() as conn:
            old = await self._existing(conn, namespace, schedule_id)
            # Durable before the reply says ok: a rebuild of a lost index restores it.
            now = await self._pending_trigger(conn, namespace, schedule_id, self.now_ms())
            reply = {
                "ok": True,
                "schedule": view(old, now),
                "trigger": {
                    "fire_time": timefmt.format_ms(now),
                    "idempotency_key": schedule.trigger_key(namespace, schedule_id, now),
                },
            }
            await self._record(conn, audit, old.version, reply)
        plan = compact.decode(old.compact)
        shard = self.index.shard_of(namespace, schedule_id)
        # The trigger needs the schedule in the index; make sure it is there without moving
        # the rotation ('keep' leaves a running rotation alone, 'park' keeps a paused one out).
        current = _current_of(old)
        placement = (
            rotation.place_upsert(current, plan, False, now, keys.member(namespace, schedule_id))
            if old.state == "active"
            else rotation.Placement("paused", "park", None, old.fires, old.last_fire_ms)
        )
        await self._index(namespace, schedule_id, plan, placement)
        member = keys.trigger_member(namespace, schedule_id, now)
        await self._write_index(lambda: self.index.add_trigger(shard, member, now))
        await self.wake(shard, now)
        return reply

    async def _pending_trigger(
        self, conn: Any, namespace: str, schedule_id: str, now_ms: int
    ) -> int:
        """Keep a new trigger pending; returns its time. A trigger's identity is its time, so
        a second trigger of the schedule within the same millisecond takes the next free one
        (the schedule's row lock orders them)."""
        for offset in range(MAX_TRIGGER_SHIFT_MS):
            run = PendingRun(namespace, schedule_id, "trigger", now_ms + offset)
            if await self.store.add_pending_run(conn, run):
                return run.nominal_ms
        raise ValidationFailed(
            "conflict",
            f"more than {MAX_TRIGGER_SHIFT_MS} triggers of {namespace}/{schedule_id} pending now",
            [{"field": "id", "reason": "too many triggers at once; try again"}],
        )

    async def get(self, namespace: str, schedule_id: str) -> dict[str, Any]:
        row = await self.store.get_schedule(namespace, schedule_id)
        if row is None or row.state == "deleted":
            raise not_found(namespace, schedule_id)
        return {"ok": True, "schedule": view(row, self.now_ms())}

    async def list(self, namespace: str, command: models.ListCommand) -> dict[str, Any]:
        rows = await self.store.list_schedules(
            namespace,
            state=command.state,
            labels=command.labels,
            after_id=decode_cursor(command.cursor),
            limit=command.limit,
        )
        now = self.now_ms()
        next_cursor = encode_cursor(rows[-1].id) if len(rows) == command.limit else None
        return {
            "ok": True,
            "schedules": [view(row, now) for row in rows],
            "next_cursor": next_cursor,
        }

    # --- helpers ------------------------------------------------------------------------------

    async def _record(
        self, conn: Any, audit: CommandAudit, version: int, reply: dict[str, Any]
    ) -> None:
        """The audit row, with the reply: a redelivery of the command is answered from it."""
        await self.store.record_command(
            dataclasses.replace(audit, version=version, reply=reply), conn
        )

    async def _replayed(self, namespace: str, verb: str, meta: Meta) -> dict[str, Any] | None:
        """The reply already given to this message (same message_id), if it was applied.

        A command redelivered after a crash between its commit and its ack is answered, not
        applied twice: a second trigger would be a second run. Should the index write of the
        first delivery have been lost with the crash, drift repair redoes it for a schedule,
        and for a trigger it is redone here when no trace of the run exists.
        """
        if not meta.message_id or verb in ("get", "list"):
            return None
        reply = await self.store.applied_reply(namespace, verb, meta.message_id)
        if reply is None:
            return None
        if verb == "trigger":
            await self._ensure_trigger(namespace, reply)
        return {**reply, "duplicate": True}

    async def _ensure_trigger(self, namespace: str, reply: dict[str, Any]) -> None:
        schedule_id = reply["schedule"]["id"]
        fire_ms = timefmt.parse_rfc3339_ms(reply["trigger"]["fire_time"])
        shard = self.index.shard_of(namespace, schedule_id)
        member = keys.trigger_member(namespace, schedule_id, fire_ms)
        if await self.index.knows(shard, member):
            return
        if not await self.store.pending_run_exists(
            PendingRun(namespace, schedule_id, "trigger", fire_ms)
        ):
            return  # it ran to completion (or its schedule was deleted)
        await self.index.add_trigger(shard, member, fire_ms)
        await self.wake(shard, fire_ms)

    async def _existing(self, conn: Any, namespace: str, schedule_id: str) -> ScheduleRow:
        row = await self.store.lock_schedule(conn, namespace, schedule_id)
        if row is None or row.state == "deleted":
            raise not_found(namespace, schedule_id)
        return row

    async def _index(
        self, namespace: str, schedule_id: str, plan: Plan, placement: rotation.Placement
    ) -> None:
        """Write the placement to Redis (after PostgreSQL committed it)."""
        shard = self.index.shard_of(namespace, schedule_id)
        upsert = rotation.index_write(namespace, schedule_id, plan, compact.encode(plan), placement)
        if upsert is None:
            member = keys.member(namespace, schedule_id)
            await self._write_index(lambda: self.index.remove({shard: [(member, plan.version)]}))
            return
        await self._write_index(lambda: self.index.upsert({shard: [upsert]}))
        if upsert.next_fire_ms is not None:
            await self.wake(shard, upsert.next_fire_ms)

    async def _write_index(self, write: Callable[[], Awaitable[object]]) -> None:
        """PostgreSQL has committed: only the index write is repeated while Redis is away.
        If the service stops first, the sweeper's drift repair finishes the job."""
        try:
            await transient.retry(write, what="index write", stopping=self.stopping)
        except transient.Stopped:
            log.warning("index write left to drift repair", extra={"action": "index_deferred"})


def _next_version(
    old: ScheduleRow, placement: rotation.Placement, definition: dict[str, Any]
) -> NewScheduleRow:
    """The row of ``old`` at its next version, where ``placement`` puts it."""
    version = old.version + 1
    return NewScheduleRow(
        old.namespace,
        old.id,
        version,
        placement.state,
        definition,
        compact.with_version(old.compact, version),
        old.priority,
        old.labels,
        placement.fires,
        placement.last_fire_ms,
        placement.next_nominal,
        placement.rotation_version(version),
    )


def _trigger_members(runs: list[PendingRun]) -> list[str]:
    return [
        keys.trigger_member(run.namespace, run.id, run.nominal_ms)
        for run in runs
        if run.kind == "trigger"
    ]


def _current_of(row: ScheduleRow) -> rotation.Current:
    return rotation.Current(
        compact.decode(row.compact), row.state, row.fires, row.last_fire_ms, row.next_fire_ms
    )


def _schedule_id_of(parsed: Any) -> str | None:
    if not isinstance(parsed, dict):
        return None
    found = parsed.get("id")
    inner = parsed.get("schedule")
    if found is None and isinstance(inner, dict):
        found = inner.get("id")
    return found if isinstance(found, str) else None
