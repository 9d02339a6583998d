"""Replays: a command delivered again is answered from its first reply, not applied twice.

A command redelivered after a crash between its commit and its ack, or a copy of it taken by
another dispatcher, must not act again: a second trigger would be a second run. The reply of
each applied command is kept with its audit row under its ``message_id``; a later delivery with
the same ``message_id``, verb and body gets that reply marked ``duplicate``, and one with the
same ``message_id`` for another command is a ``conflict`` (the namespace scopes message ids:
tenants pick theirs independently).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.dispatcher import batch
from services.dispatcher.intake.index_writes import Wake
from services.dispatcher.intake.receiving import Received, schedule_ids_of
from shared.contract import commands, keys, timefmt
from shared.contract.entries import BackfillStart
from shared.contract.rows import AppliedCommand, CommandAudit, PendingRun
from shared.postgres import positions
from shared.postgres.store import Store
from shared.redis.index import Index


class AlreadyApplied(Exception):
    """The command was applied already (by a copy of it on another dispatcher)."""

    def __init__(self, applied: AppliedCommand) -> None:
        super().__init__("already applied")
        self.applied = applied


class Replays:
    """The replay check before a command, again under its locks, and the reply kept after."""

    def __init__(self, store: Store, index: Index, wake: Wake) -> None:
        self.store = store
        self.index = index
        self.wake = wake

    async def replayed(
        self, namespace: str, verb: str, received: Received
    ) -> dict[str, Any] | None:
        """The reply already given to this command, if it was applied; ``conflict`` when its
        ``message_id`` was applied to another command.

        It is the same command only when its verb and body are the same too. Should the index
        write of the first delivery have been lost with the crash, drift repair redoes it for a
        schedule, and for a trigger or a backfill it is redone here when no trace of it exists.
        """
        message_id = received.meta.message_id
        if not message_id or verb in ("get", "list"):
            return None
        applied = await self.store.applied_command(namespace, message_id)
        if applied is None:
            return None
        if applied.verb != verb or applied.body != received.parsed:
            raise batch.message_id_conflict(namespace, message_id, applied.verb)
        reply = applied.reply
        if verb == "trigger":
            await self.ensure_trigger(namespace, reply)
        elif verb == "backfill" and isinstance(received.command, commands.BackfillCommand):
            await self.ensure_backfill(namespace, received.command.id)
        if verb in ("upsert_many", "trigger", "backfill"):
            await self.answer_again(namespace, received)
        return {**reply, "duplicate": True}

    async def answer_again(self, namespace: str, received: Received) -> None:
        """Its schedules' positions answered (invariant 9): the first delivery may have died
        before its index writes, and this reply says ok; the shard is fenced until it is
        replayed."""
        ids = [i for i in schedule_ids_of(received) if i]
        found = await positions.of_schedules(self.store.pool, [(namespace, i) for i in ids])
        await positions.mark_answered(self.store.pool, found)

    async def applied_under_lock(
        self, conn: Any, namespace: str, audit: CommandAudit, verb: str
    ) -> dict[str, Any] | None:
        """The reply of the ``verb`` command already applied under ``audit``'s message_id, read
        in the transaction; ``conflict`` when that message_id was used for another command."""
        message_id = audit.message_id
        if not message_id:
            return None
        found = await self.store.applied_commands(conn, [(namespace, message_id)])
        applied = found.get((namespace, message_id))
        if applied is None:
            return None
        if applied.verb != verb or applied.body != audit.body:
            raise batch.message_id_conflict(namespace, message_id, applied.verb)
        return applied.reply

    async def record(
        self, conn: Any, audit: CommandAudit, version: int, reply: dict[str, Any]
    ) -> None:
        """The audit row, with the reply: a redelivery of the command is answered from it."""
        await self.store.record_command(
            dataclasses.replace(audit, version=version, reply=reply), conn
        )

    async def ensure_backfill(self, namespace: str, schedule_id: str) -> None:
        """The schedule's kept backfill back into the index, unless the index holds it (or a
        newer one) already: backfill.lua writes nothing for a generation it has. Drift repair
        would put it back too, a few minutes on."""
        kept = await self.store.kept_backfill(namespace, schedule_id)
        if kept is None:
            return
        shard = self.index.shard_of(namespace, schedule_id)
        start = BackfillStart(
            keys.member(namespace, schedule_id),
            kept.generation,
            kept.to_ms,
            kept.remaining,
            kept.next_ms,
        )
        if await self.index.start_backfill(shard, start) and not kept.paused:
            await self.wake(shard, kept.next_ms)

    async def ensure_trigger(self, namespace: str, reply: dict[str, Any]) -> None:
        """The replied trigger back into the index, unless it is there or has run already."""
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
