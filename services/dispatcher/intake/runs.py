"""The verbs that ask for runs outside the rotation: ``trigger`` (one now) and ``backfill``.

Each is made durable in PostgreSQL, with the command's audit row and its reply, before the reply
says ok, so that a rebuild of a lost index restores it; then it is placed in the index. Both run
under the schedule's row lock, where the replay check is made again: a copy of the command
redelivered to another dispatcher may have committed since the check before the transaction.

Each takes its shard's position in its transaction, as every change of a schedule does
(invariant 9): the schedule's row is stamped with it, and the reply waits until Redis has the
run and the position is answered. A failover to a replica that lacks the run leaves the shard
behind its answered position: fenced until the sweeper replays the schedule, pending runs and
backfill included (``services.sweeper.positions``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from services.dispatcher import batch
from services.dispatcher.intake.index_writes import IndexWrites
from services.dispatcher.intake.replays import Replays
from services.dispatcher.views import view
from shared.contract import commands, keys, timefmt
from shared.contract.entries import BackfillStart
from shared.contract.errors import ValidationFailed
from shared.contract.rows import Backfill, CommandAudit, PendingRun, ScheduleRow
from shared.postgres import positions
from shared.postgres.store import Store
from shared.rules import backfill, compact, rotation, schedule
from shared.rules.plan import Plan

#: How far (ms) a trigger may move forward to get an identity of its own.
MAX_TRIGGER_SHIFT_MS = 1000

#: ``Committer.answer_positions``: positions taken (written to Redis or not), and positions of
#: earlier deliveries of a command answered again, recorded and answered before the reply.
AnswerPositions = Callable[[dict[int, int], bool, Mapping[int, int]], Awaitable[None]]


class Runs:
    """``trigger`` and ``backfill``: PostgreSQL first, then the index and a wake-up."""

    def __init__(
        self,
        store: Store,
        writes: IndexWrites,
        replays: Replays,
        now_ms: Callable[[], int],
        answer: AnswerPositions,
    ) -> None:
        self.store = store
        self.writes = writes
        self.index = writes.index
        self.replays = replays
        self.now_ms = now_ms
        self.answer = answer

    async def trigger(
        self, namespace: str, schedule_id: str, audit: CommandAudit
    ) -> dict[str, Any]:
        shard = self.index.shard_of(namespace, schedule_id)
        async with self.store.transaction() as conn:
            old = await self._existing(conn, namespace, schedule_id)
            # Again under the row lock: a copy of this command redelivered to another
            # dispatcher may have committed since the check before the transaction.
            earlier = await self.replays.applied_under_lock(conn, namespace, audit, "trigger")
            if earlier is None:
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
                await self.replays.record(conn, audit, old.version, reply)
                taken = await positions.take(conn, [(namespace, schedule_id, shard)])
                run = PendingRun(namespace, schedule_id, "trigger", now)
                await positions.stamp_run(conn, run, taken[shard])
            else:
                await self.replays.ensure_trigger(namespace, earlier)
                before = await positions.of_schedules(conn, [(namespace, schedule_id)])
        if earlier is not None:
            # The first delivery may have died before its index writes: fenced till replayed.
            await self.answer({}, False, before)
            return {**earlier, "duplicate": True}
        plan = compact.decode(old.compact)
        # The trigger needs the schedule in the index; make sure it is there without moving
        # the rotation ('keep' leaves a running rotation alone, 'park' keeps a paused one out).
        current = _current_of(old)
        placement = (
            rotation.place_upsert(current, plan, False, now, keys.member(namespace, schedule_id))
            if old.state == "active"
            else rotation.Placement("paused", "park", None, old.fires, old.last_fire_ms)
        )
        placed = await self.writes.place(namespace, schedule_id, plan, placement)
        member = keys.trigger_member(namespace, schedule_id, now)
        # The run and its position at once: the sweeper's replay of a shard that lost it (or
        # never got it) writes it the same way, and whichever comes second writes nothing.
        added = await self.writes.write(
            lambda: self.index.add_run(shard, member, now, taken[shard])
        )
        await self.writes.wake(shard, now)
        await self.answer(taken, placed and added, {})
        return reply

    async def backfill(
        self, namespace: str, command: commands.BackfillCommand, audit: CommandAudit
    ) -> dict[str, Any]:
        """Start a backfill (replacing the schedule's running one): durable in PostgreSQL
        with the command's audit before the reply, then placed in the index."""
        from_ms = timefmt.datetime_to_ms(command.from_)
        to_ms = timefmt.datetime_to_ms(command.to)
        now = self.now_ms()
        check_backfill_range(from_ms, to_ms, now)
        schedule_id = command.id
        shard = self.index.shard_of(namespace, schedule_id)
        async with self.store.transaction() as conn:
            old = await self._existing(conn, namespace, schedule_id)
            earlier = await self.replays.applied_under_lock(conn, namespace, audit, "backfill")
            if earlier is not None:
                before = await positions.of_schedules(conn, [(namespace, schedule_id)])
            else:
                plan = compact.decode(old.compact)
                check_backfillable(schedule_id, old.state, plan)
                # Bounded by the limit (100,000 steps at most); counted off the event loop.
                extent = await asyncio.to_thread(
                    backfill.extent, plan, from_ms, to_ms, command.limit
                )
                generation = await self.store.next_backfill_generation(
                    conn, namespace, schedule_id, now
                )
                await self.store.put_backfill(
                    conn,
                    Backfill(
                        namespace,
                        schedule_id,
                        generation,
                        from_ms,
                        to_ms,
                        command.limit,
                        extent.first_ms or 0,
                        extent.occurrences,
                    ),
                )
                reply = {"ok": True, "backfill": {"occurrences": extent.occurrences}}
                await self.replays.record(conn, audit, old.version, reply)
                taken = await positions.take(conn, [(namespace, schedule_id, shard)])
                await positions.stamp_backfill(conn, namespace, schedule_id, taken[shard])
        if earlier is not None:
            await self.answer({}, False, before)
            return {**earlier, "duplicate": True}
        start = BackfillStart(
            keys.member(namespace, schedule_id),
            generation,
            to_ms,
            extent.occurrences,
            extent.first_ms,
        )
        written = await self.writes.write(
            lambda: self.index.start_backfill(shard, start, taken[shard])
        )
        if extent.first_ms is not None and old.state == "active":
            await self.writes.wake(shard, extent.first_ms)
        await self.answer(taken, written, {})
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

    async def _existing(self, conn: Any, namespace: str, schedule_id: str) -> ScheduleRow:
        row = await self.store.lock_schedule(conn, namespace, schedule_id)
        if row is None or row.state == "deleted":
            raise batch.not_found(namespace, schedule_id)
        return row


def _refusal(field: str, reason: str) -> ValidationFailed:
    return ValidationFailed(
        "invalid_command", f"{field}: {reason}", [{"field": field, "reason": reason}]
    )


def check_backfill_range(from_ms: int, to_ms: int, now_ms: int) -> None:
    """``from`` before ``to``, and ``to`` not in the future."""
    if to_ms <= from_ms:
        raise _refusal("to", "must be after from")
    if to_ms > now_ms:
        raise _refusal(
            "to",
            "is in the future: a backfill replays the past; the schedule's rotation fires "
            "the future",
        )


def check_backfillable(schedule_id: str, state: str, plan: Plan) -> None:
    """A schedule with nominal times whose rotation is not over."""
    if not backfill.has_nominal_times(plan):
        raise _refusal(
            "id",
            f"schedule {schedule_id!r} has an after_completion spec: its times follow each "
            "run's completion, so it has no nominal times to backfill",
        )
    if state == "completed":
        raise _refusal(
            "id",
            f"schedule {schedule_id!r} has completed (its rotation is over): upsert it with a "
            "new window to backfill it",
        )


def _current_of(row: ScheduleRow) -> rotation.Current:
    return rotation.Current(
        compact.decode(row.compact), row.state, row.fires, row.last_fire_ms, row.next_fire_ms
    )
