"""Command intake: schedule commands from ``cronbus.commands`` into PostgreSQL, then the index.

Every command is validated first (a bad one changes nothing and gets an error reply naming the
field), applied to PostgreSQL in one transaction with its audit row, then written to the Redis
index, then answered on ``reply_to``. A body that cannot be parsed goes to the dead-letter
queue with the reason in a header.

``Intake`` is the path of one message through the parts, each in a module of its own:
``receiving`` (the message and its checks), ``ordering`` (commands on one schedule in arrival
order), ``answers`` (replies, refusals, dead letters), ``replays`` (a redelivered command
answered, not applied twice), ``group_commit`` (upserts, deletes, pauses and resumes committed
together), ``reads`` (get, list), ``runs`` (trigger, backfill) and ``index_writes`` (the index
after PostgreSQL).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from services.dispatcher import batch
from services.dispatcher.fence import Fence
from services.dispatcher.intake.answers import Answers, reply_to_refused
from services.dispatcher.intake.group_commit import CHANGE_VERBS, Committer
from services.dispatcher.intake.index_writes import IndexWrites, Wake
from services.dispatcher.intake.ordering import ArrivalOrder
from services.dispatcher.intake.reads import Reads
from services.dispatcher.intake.receiving import (
    Checks,
    Meta,
    Received,
    audit_of,
    delivery_count,
    provisional_turn,
    schedule_ids_of,
)
from services.dispatcher.intake.replays import Replays
from services.dispatcher.intake.reply_queues import ReplyQueues
from services.dispatcher.intake.runs import Runs
from shared.contract import commands, models
from shared.contract.errors import ValidationFailed
from shared.contract.rows import CommandAudit
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.runtime import metrics, transient
from shared.runtime.config import DispatcherSettings

__all__ = ["Intake", "Meta", "Received", "Wake"]

log = logging.getLogger(__name__)


class Intake:
    """One dispatcher's command intake: the parts wired together, and each message's path."""

    def __init__(
        self,
        settings: DispatcherSettings,
        store: Store,
        index: Index,
        channel: AbstractChannel,
        wake: Wake,
        stopping: asyncio.Event,
        clock: Callable[[], float] = time.time,
        reply_queues: ReplyQueues | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.settings = settings
        self.stopping = stopping
        self.store = store
        self.clock = clock
        self.checks = Checks(settings, self.now_ms)
        self.order = ArrivalOrder()
        self.reply_queues = reply_queues or ReplyQueues(settings.amqp_url)
        self.answers = Answers(store, channel, self.reply_queues)
        self.replays = Replays(store, index, wake)
        self.writes = IndexWrites(index, wake, stopping)
        self.commits = Committer(settings, store, self.writes, stopping, self.now_ms, fence)
        self.reads = Reads(settings, store, index, stopping, self.now_ms)
        self.runs = Runs(
            store, self.writes, self.replays, self.now_ms, self.commits.answer_positions
        )

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    async def handle(self, message: AbstractIncomingMessage) -> None:
        """Apply one command and answer it; dependency outages are waited out.

        Whatever the input, the message ends acknowledged with a reply or a dead letter: an
        unexpected error is logged with its traceback and answered with code ``internal``.
        """
        received = Received(message.body, Meta.of(message), delivery_count(message))
        try:
            reply = await self._apply(received)
            if reply is not None:
                await transient.retry(
                    lambda: self.answers.reply(received, reply),
                    what="command reply",
                    stopping=self.stopping,
                )
        except transient.Stopped:
            await message.nack(requeue=True)
            return
        except Exception:
            log.exception(
                "command failed unexpectedly",
                extra={
                    "action": "command_internal_error",
                    "routing_key": received.meta.routing_key,
                },
            )
            await self.answers.fail_safely(received)
        await message.ack()

    async def _apply(self, received: Received) -> dict[str, Any] | None:
        """The reply to send (None: none may be sent).

        Commands on one schedule take their turn in arrival order, before any wait: a
        ``reply_to`` the broker must be asked about waits for the answer inside the turn, so
        a later command on the schedule cannot overtake it meanwhile.
        """
        meta = received.meta
        try:
            if self.reply_queues.must_ask(meta.reply_to):
                max_bytes = self.settings.max_command_bytes
                namespace, schedule_ids = provisional_turn(received, max_bytes)
                async with self.order.turn(namespace, schedule_ids):
                    await self._check_reply_to(received)
                    self.checks.validate(received)
                    reply = await self._executed(received)
            else:
                await self._check_reply_to(received)  # known: decided without a wait
                self.checks.validate(received)
                assert received.namespace is not None
                async with self.order.turn(received.namespace, schedule_ids_of(received)):
                    reply = await self._executed(received)
        except ValidationFailed as failure:
            refused = failure
            refusal = await transient.retry(
                lambda: self.answers.refuse(refused, received),
                what="command refusal",
                stopping=self.stopping,
            )
            return None if reply_to_refused(refused) else refusal
        metrics.COMMANDS.labels(received.verb, "ok").inc()
        return reply

    async def _check_reply_to(self, received: Received) -> None:
        meta = received.meta
        await transient.retry(
            lambda: self.reply_queues.check(
                meta.reply_to, undecodable="reply_to" in meta.undecodable
            ),
            what="reply queue check",
            stopping=self.stopping,
        )

    async def _executed(self, received: Received) -> dict[str, Any]:
        assert received.namespace is not None and received.verb is not None
        assert received.command is not None
        namespace, verb, command = received.namespace, received.verb, received.command
        return await transient.retry(
            lambda: self._execute(namespace, verb, command, received),
            what="command",
            stopping=self.stopping,
        )

    async def _execute(
        self, namespace: str, verb: str, command: models.Strict, received: Received
    ) -> dict[str, Any]:
        audit = audit_of(received, "ok")
        if isinstance(command, commands.UpsertCommand):
            # Group commit: with the upserts ready at the same time, replay check included.
            return await self.commits.upsert(namespace, command, received, audit)
        change_verb = CHANGE_VERBS.get(verb)
        if change_verb is not None:
            assert isinstance(command, commands.IdCommand)
            return await self.commits.change(namespace, command.id, change_verb, received, audit)
        replayed = await self.replays.replayed(namespace, verb, received)
        if replayed is not None:
            return replayed
        if isinstance(command, commands.BackfillCommand):
            return await self.runs.backfill(namespace, command, audit)
        if isinstance(command, commands.UpsertManyCommand):
            return await self.commits.upsert_many(received.items, received.item_ids, audit)
        if isinstance(command, commands.ListCommand):
            reply = await self.reads.list(namespace, command)
            await self.store.record_command(audit)
            return reply
        assert isinstance(command, commands.IdCommand)
        if verb == "get":
            return await self.reads.get(namespace, command.id, audit)
        return await self.runs.trigger(namespace, command.id, audit)

    # Two verbs by name, for callers that hold checked commands already (the race tests).

    async def apply_batch(
        self,
        items: Sequence[batch.Item],
        more_audits: Callable[[batch.BatchEffect], list[CommandAudit]] | None = None,
        own: tuple[str, str] | None = None,
    ) -> batch.BatchEffect:
        return await self.commits.apply_batch(items, more_audits, own)

    async def trigger(
        self, namespace: str, schedule_id: str, audit: CommandAudit
    ) -> dict[str, Any]:
        return await self.runs.trigger(namespace, schedule_id, audit)
