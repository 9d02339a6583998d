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
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiormq
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from services.dispatcher import batch
from services.dispatcher.views import view
from shared.contract import codec, commands, keys, models, timefmt, validation
from shared.contract.entries import BackfillStart, Upsert
from shared.contract.errors import ValidationFailed
from shared.contract.rows import AppliedCommand, Backfill, CommandAudit, PendingRun, ScheduleRow
from shared.policy import limits, stats
from shared.postgres.store import Store
from shared.rabbitmq import amqp
from shared.redis.batcher import GroupCommit
from shared.redis.index import Index
from shared.rules import backfill, compact, rotation, schedule
from shared.rules.plan import Plan
from shared.runtime import metrics, quotas, transient
from shared.runtime.config import DispatcherSettings

log = logging.getLogger(__name__)

#: A reply lists at most this many field errors.
MAX_ERROR_DETAILS = 50
#: How far (ms) a trigger may move forward to get an identity of its own.
MAX_TRIGGER_SHIFT_MS = 1000
#: How long each step of reporting an unexpected failure may take.
FAIL_SAFE_TIMEOUT_S = 5.0
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


@dataclass(slots=True)
class Received:
    """A command as far as it is understood so far (what a refusal can audit)."""

    body: bytes
    meta: Meta
    #: Earlier deliveries of this message (the quorum queue's ``x-delivery-count``).
    deliveries: int = 0
    namespace: str | None = None
    verb: str | None = None
    parsed: Any = None
    command: models.Strict | None = None
    #: An upsert's checked plan (version 0).
    plan: Plan | None = None
    #: An upsert_many's schedules, each checked or refused on its own.
    items: list[batch.UpsertItem | ValidationFailed] = field(default_factory=list)
    #: The ``id`` each of those schedules gives (None: none that is a string).
    item_ids: list[str | None] = field(default_factory=list)


def _delivery_count(message: AbstractIncomingMessage) -> int:
    value = (message.headers or {}).get("x-delivery-count")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _reply_to_refused(failure: ValidationFailed) -> bool:
    return any(d.get("field") == "reply_to" for d in failure.details)


def _error_of(failure: ValidationFailed) -> dict[str, Any]:
    """The reply's error: a hostile command may have thousands of problems; list the first."""
    return {
        "code": failure.code,
        "message": str(failure)[:2000],
        "details": failure.details[:MAX_ERROR_DETAILS],
    }


class AlreadyApplied(Exception):
    """The command was applied already (by a copy of it on another dispatcher)."""

    def __init__(self, applied: AppliedCommand) -> None:
        super().__init__("already applied")
        self.applied = applied


class Unparseable(ValidationFailed):
    """The message is not a command at all (or keeps failing): it goes to the dead-letter
    queue, answered or not."""


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
        last_id = base64.urlsafe_b64decode(cursor.encode()).decode()
        return models.check_schedule_id(last_id)
    except (binascii.Error, ValueError):
        raise ValidationFailed(
            "invalid_command",
            "cursor: is not a cursor this cronbus returned",
            [{"field": "cursor", "reason": "is not a cursor this cronbus returned"}],
        ) from None


not_found = batch.not_found
#: Verbs that go through group commit besides upsert.
CHANGE_VERBS: dict[str, Literal["delete", "pause", "resume"]] = {
    "delete": "delete",
    "pause": "pause",
    "resume": "resume",
}


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
        self.quotas = quotas.QuotaFile(settings.quotas_file)
        #: Per schedule, the last command in its line (done when that command is).
        self._tails: dict[tuple[str, str], asyncio.Future[None]] = {}
        self.committer: GroupCommit[batch.Item, dict[str, Any] | Exception] = GroupCommit(
            self._commit_upserts,
            max_items=settings.commands_batch,
            workers=settings.commands_commit_workers,
            name="upsert-commit",
        )
        #: Gets ready together are read (and audited) in one round trip.
        self.reader: GroupCommit[tuple[str, str, CommandAudit], ScheduleRow | None] = GroupCommit(
            self._read_schedules,
            max_items=settings.commands_batch,
            workers=settings.commands_commit_workers,
            name="get-batch",
        )

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    # --- the message --------------------------------------------------------------------------

    async def handle(self, message: AbstractIncomingMessage) -> None:
        """Apply one command and answer it; dependency outages are waited out.

        Whatever the input, the message ends acknowledged with a reply or a dead letter: an
        unexpected error is logged with its traceback and answered with code ``internal``.
        """
        received = Received(message.body, Meta.of(message), _delivery_count(message))
        try:
            reply = await self._apply(received)
            if reply is not None:
                await transient.retry(
                    lambda: self._answer(received.meta, reply),
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
            await self._fail_safely(received)
        await message.ack()

    async def _apply(self, received: Received) -> dict[str, Any] | None:
        """The reply to send (None: none may be sent)."""
        try:
            self._validate(received)
            assert received.namespace is not None and received.verb is not None
            assert received.command is not None
            namespace, verb, command = received.namespace, received.verb, received.command
            # No await before the lock: commands on one schedule take it in arrival order.
            async with self._locks_for(namespace, _schedule_ids_of(received)):
                reply = await transient.retry(
                    lambda: self._execute(namespace, verb, command, received),
                    what="command",
                    stopping=self.stopping,
                )
        except ValidationFailed as failure:
            refused = failure
            refusal = await transient.retry(
                lambda: self._refuse(refused, received),
                what="command refusal",
                stopping=self.stopping,
            )
            return None if _reply_to_refused(refused) else refusal
        metrics.COMMANDS.labels(received.verb, "ok").inc()
        return reply

    def _validate(self, received: Received) -> None:
        """Everything that needs no I/O, in order; fills ``received`` as parts become known."""
        meta = received.meta
        if received.deliveries >= amqp.COMMAND_DELIVERY_LIMIT:
            raise Unparseable(
                "internal",
                f"the command was delivered {received.deliveries} times without an answer; "
                "it is kept in the dead-letter queue",
            )
        if meta.reply_to and not keys.reply_queue_allowed(meta.reply_to):
            raise ValidationFailed(
                "invalid_command",
                f"reply_to {meta.reply_to[:255]!r} is not allowed: replies go only to "
                "amq.rabbitmq.reply-to or a server-named amq.gen-* queue",
                [{"field": "reply_to", "reason": "must be amq.rabbitmq.reply-to or amq.gen-*"}],
            )
        if len(received.body) > self.settings.max_command_bytes:
            raise ValidationFailed(
                "too_large",
                f"the command is {len(received.body)} bytes; at most "
                f"{self.settings.max_command_bytes} are accepted",
                [{"field": "(body)", "reason": "is too large"}],
            )
        validation.check_properties(meta.message_id, meta.correlation_id)
        namespace, verb = split_routing_key(meta.routing_key)
        validation.check_namespace(namespace)
        received.namespace = namespace
        received.verb = verb
        try:
            received.parsed = validation.parse_body(received.body)
        except ValidationFailed as failure:
            raise Unparseable(failure.code, str(failure), failure.details) from None
        received.command = validation.parse_command(verb, received.parsed)
        if isinstance(received.command, commands.UpsertCommand):
            received.plan = validation.check_schedule(
                received.command.schedule, 0, self.now_ms(), self.policy
            )
        elif isinstance(received.command, commands.UpsertManyCommand):
            now = self.now_ms()
            raws = received.command.schedules
            received.items = [self._checked_item(namespace, raw, now) for raw in raws]
            received.item_ids = [_schedule_id_of(raw) for raw in raws]

    def _checked_item(
        self, namespace: str, raw: Any, now_ms: int
    ) -> batch.UpsertItem | ValidationFailed:
        try:
            item = validation.parse_schedule(raw)
            plan = validation.check_schedule(item, 0, now_ms, self.policy)
        except ValidationFailed as failure:
            return failure
        return batch.UpsertItem(namespace, item, plan)

    @contextlib.asynccontextmanager
    async def _locks_for(self, namespace: str, schedule_ids: list[str]) -> AsyncIterator[None]:
        """Wait for every earlier command on any of these schedules, then run.

        The command's place in the line of each schedule is taken at once, before any wait: a
        command waiting for one of its schedules already holds its place on the others, so a
        later command on those cannot overtake it (commands on one schedule run in arrival
        order). It waits only for earlier commands: no deadlock.
        """
        members = [(namespace, schedule_id) for schedule_id in set(schedule_ids)]
        earlier = {self._tails[m] for m in members if m in self._tails}
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for member in members:
            self._tails[member] = mine
        try:
            if earlier:
                await asyncio.wait(earlier)  # never cancels them
            yield
        finally:
            self._release(mine, members, earlier)

    def _release(
        self,
        mine: asyncio.Future[None],
        members: list[tuple[str, str]],
        earlier: set[asyncio.Future[None]],
    ) -> None:
        """Let the next commands go; a command cancelled while waiting lets them go only once
        the commands before it are done."""

        def done(_: object = None) -> None:
            if not mine.done():
                mine.set_result(None)
            for member in members:
                if self._tails.get(member) is mine:
                    del self._tails[member]

        waiting = [future for future in earlier if not future.done()]
        if waiting:
            asyncio.gather(*waiting).add_done_callback(done)
        else:
            done()

    async def _refuse(self, failure: ValidationFailed, received: Received) -> dict[str, Any]:
        meta = received.meta
        error = _error_of(failure)
        verb = received.verb
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
        await self.store.record_command(self._audit_of(received, failure.code, error))
        if _reply_to_refused(failure):
            metrics.REPLY_TO_REFUSED.inc()
        if isinstance(failure, Unparseable) or not meta.reply_to or _reply_to_refused(failure):
            # Nobody would hear of it otherwise: keep the message, with why, for an operator.
            await self._dead_letter(received, f"{failure.code}: {failure}")
        return {"ok": False, "error": error}

    def _audit_of(
        self, received: Received, outcome: str, error: dict[str, Any] | None = None
    ) -> CommandAudit:
        meta = received.meta
        parsed = received.parsed
        return CommandAudit(
            namespace=received.namespace,
            verb=received.verb,
            schedule_id=_schedule_id_of(parsed),
            outcome=outcome,
            body=parsed if isinstance(parsed, dict | list) else None,
            error=error,
            user_id=meta.user_id,
            app_id=meta.app_id,
            message_id=meta.message_id,
            correlation_id=meta.correlation_id,
        )

    async def _dead_letter(self, received: Received, reason: str) -> None:
        meta = received.meta
        await amqp.dead_letter(
            self.channel,
            keys.COMMANDS_QUEUE,
            received.body,
            reason,
            {
                "reply_to": meta.reply_to,
                "correlation_id": meta.correlation_id,
                "message_id": meta.message_id,
                "headers": {"x-cronbus-routing-key": meta.routing_key},
            },
        )
        metrics.DEAD_LETTERED.labels(keys.COMMANDS_QUEUE).inc()

    async def _fail_safely(self, received: Received) -> None:
        """After an unexpected error: audit, dead-letter and answer ``internal``, each as far as
        it goes (whatever failed may fail again), and never raise."""
        failure = ValidationFailed(
            "internal", "cronbus could not handle this command; the error is logged"
        )
        metrics.COMMANDS.labels(
            received.verb if received.verb in models.VERBS else "unknown", "internal"
        ).inc()
        error = _error_of(failure)
        steps: list[Callable[[], Awaitable[None]]] = [
            lambda: self.store.record_command(self._audit_of(received, "internal", error)),
            lambda: self._dead_letter(received, "internal: the error is in the dispatcher's log"),
        ]
        if received.meta.reply_to and keys.reply_queue_allowed(received.meta.reply_to):
            steps.append(lambda: self._answer(received.meta, {"ok": False, "error": error}))
        for step in steps:
            try:
                await asyncio.wait_for(step(), FAIL_SAFE_TIMEOUT_S)
            except Exception:
                log.exception("could not report a failed command", extra={"action": "internal"})

    async def _answer(self, meta: Meta, reply: dict[str, Any]) -> None:
        if not meta.reply_to:
            return
        # Straight to the protocol channel: aio-pika's Message and Exchange layers cost more
        # per reply than the publish itself.
        channel = await self.channel.get_underlay_channel()
        await channel.basic_publish(
            codec.dumps(reply),
            exchange="",
            routing_key=meta.reply_to,
            properties=aiormq.spec.Basic.Properties(
                content_type="application/json", correlation_id=meta.correlation_id
            ),
        )

    # --- the verbs ----------------------------------------------------------------------------

    async def _execute(
        self, namespace: str, verb: str, command: models.Strict, received: Received
    ) -> dict[str, Any]:
        audit = self._audit_of(received, "ok")
        if isinstance(command, commands.UpsertCommand):
            # Group commit: with the upserts ready at the same time, replay check included.
            assert received.plan is not None
            item = batch.UpsertItem(
                namespace,
                command.schedule,
                received.plan,
                command.expected_version,
                audit,
                received.meta.message_id,
                received.parsed,
            )
            result = await self.committer.submit(item)
            if isinstance(result, Exception):
                raise result
            return result
        change_verb = CHANGE_VERBS.get(verb)
        if change_verb is not None:
            assert isinstance(command, commands.IdCommand)
            change = batch.ChangeItem(
                namespace,
                command.id,
                change_verb,
                audit,
                received.meta.message_id,
                received.parsed,
            )
            changed = await self.committer.submit(change)
            if isinstance(changed, Exception):
                raise changed
            return changed
        replayed = await self._replayed(namespace, verb, received)
        if replayed is not None:
            return replayed
        if isinstance(command, commands.BackfillCommand):
            return await self.backfill(namespace, command, audit)
        if isinstance(command, commands.UpsertManyCommand):
            return await self.upsert_many(received.items, received.item_ids, audit)
        if isinstance(command, commands.ListCommand):
            reply = await self.list(namespace, command)
            await self.store.record_command(audit)
            return reply
        assert isinstance(command, commands.IdCommand)
        if verb == "get":
            return await self.get(namespace, command.id, audit)
        return await self.trigger(namespace, command.id, audit)

    async def get(self, namespace: str, schedule_id: str, audit: CommandAudit) -> dict[str, Any]:
        """One schedule as stored, with its stats, its rate key's breaker and its backfill."""
        row = await self.reader.submit((namespace, schedule_id, audit))
        if row is None or row.state == "deleted":
            raise not_found(namespace, schedule_id)
        [shown] = await self._with_stats(namespace, [view(row, self.now_ms())])
        key = limits.rate_key(namespace, compact.decode(row.compact).target)
        fails, open_until, _, hold_until = await self.index.breaker_state(key)
        now = self.now_ms()
        shown["breaker"] = limits.breaker_view(key, fails, open_until, hold_until, now)
        remaining, indexed = await self.index.backfill_remaining_and_epoch(
            self.index.shard_of(namespace, schedule_id), keys.member(namespace, schedule_id)
        )
        if remaining is None and not indexed:
            # Redis lost its data and the rebuild has not put the backfill back yet: what
            # PostgreSQL keeps is where it will resume. (With the index present, Redis is
            # current: PostgreSQL learns of each completion a batch later.)
            remaining = row.backfill_remaining
        if remaining is not None:
            shown["backfill"] = {"remaining": remaining}
        return {"ok": True, "schedule": shown}

    async def upsert_many(
        self,
        items: list[batch.UpsertItem | ValidationFailed],
        ids: list[str | None],
        audit: CommandAudit,
    ) -> dict[str, Any]:
        """Each schedule applied or refused on its own, as a single upsert; one transaction."""
        valid = [item for item in items if isinstance(item, batch.UpsertItem)]
        results: list[dict[str, Any]] = []

        def answered(effect: batch.BatchEffect) -> list[CommandAudit]:
            outcomes = iter(effect.results)
            for item, schedule_id in zip(items, ids, strict=True):
                outcome = item if isinstance(item, ValidationFailed) else next(outcomes)
                results.append(_item_result(schedule_id, outcome))
            return [dataclasses.replace(audit, reply={"ok": True, "results": results})]

        message_id = audit.message_id
        own = (audit.namespace or "", message_id) if message_id else None
        try:
            await self.apply_batch(valid, answered, own)
        except AlreadyApplied as done:
            if done.applied.verb != "upsert_many" or done.applied.body != audit.body:
                raise batch.message_id_conflict(
                    audit.namespace or "", message_id or "", done.applied.verb
                ) from None
            return {**done.applied.reply, "duplicate": True}
        return {"ok": True, "results": results}

    async def _commit_upserts(
        self, items: Sequence[batch.Item]
    ) -> list[dict[str, Any] | Exception]:
        """One transaction for the upserts ready together. Should it fail for a reason other
        than an outage, each is applied alone, so that one bad command fails only itself."""
        try:
            effect = await transient.retry(
                lambda: self.apply_batch(list(items)), what="commands", stopping=self.stopping
            )
        except transient.Stopped:
            raise
        except Exception as exc:  # noqa: BLE001 - isolated below: each command fails alone
            if len(items) == 1:
                return [exc]
            log.warning(
                "a batch of commands failed; applying them one at a time",
                extra={"action": "command_batch_split", "commands": len(items)},
            )
            results: list[dict[str, Any] | Exception] = []
            for item in items:
                results += await self._commit_upserts([item])
            return results
        return list(effect.results)

    async def _read_schedules(
        self, asked: Sequence[tuple[str, str, CommandAudit]]
    ) -> list[ScheduleRow | None]:
        members = [(namespace, schedule_id) for namespace, schedule_id, _ in asked]
        found = await transient.retry(
            lambda: self.store.get_schedules_and_audit(members, [a for _, _, a in asked]),
            what="get",
            stopping=self.stopping,
        )
        return [found.get(member) for member in members]

    async def apply_batch(
        self,
        items: Sequence[batch.Item],
        more_audits: Callable[[batch.BatchEffect], list[CommandAudit]] | None = None,
        own: tuple[str, str] | None = None,
    ) -> batch.BatchEffect:
        """Upserts in one PostgreSQL transaction (locks, one COPY, one audit statement), then
        one index call per shard. ``more_audits`` adds rows that need the outcome. ``own`` is
        the (namespace, message_id) of the command the batch is (an upsert_many): applied
        already, nothing is written and ``AlreadyApplied`` says with what."""
        metrics.COMMAND_BATCH.observe(len(items))
        now = self.now_ms()
        members = sorted({(item.namespace, batch.schedule_id_of(item)) for item in items})
        async with self.store.transaction() as conn:
            txn_now, stored = await self.store.lock_schedule_keys(conn, members)
            message_ids = [(i.namespace, i.message_id) for i in items if i.message_id]
            message_ids += [own] if own is not None else []
            # Another batch may carry the same message_id for another schedule.
            await self.store.lock_message_ids(conn, message_ids)
            applied = await self.store.applied_commands(conn, message_ids)
            if own is not None and own in applied:
                # A copy committed by another dispatcher since the check before the batch.
                raise AlreadyApplied(applied[own])
            refused = await self._over_quota(conn, items, stored)
            kept = [item for i, item in enumerate(items) if i not in refused]
            effect = batch.apply_upserts(kept, stored, now, txn_now, applied)
            effect.results = _with_refusals(effect.results, refused, len(items))
            created = [
                key
                for key, row in effect.rows.items()
                if row.state != "deleted"
                and (stored.get(key) is None or stored[key].state == "deleted")
            ]
            await self.store.reset_stats_many(conn, created)
            audits = effect.audits + (more_audits(effect) if more_audits else [])
            await self.store.put_schedules_and_audit(conn, list(effect.rows.values()), audits)
            dropped: list[PendingRun] = []
            for (namespace, schedule_id), row in effect.rows.items():
                if row.state == "deleted":
                    dropped += await self.store.drop_pending_runs(conn, namespace, schedule_id)
                if row.state in ("deleted", "completed"):
                    # Its index entry is removed, backfill included (remove.lua): a row kept
                    # here would never be restored nor removed by a completion.
                    await self.store.drop_backfill(conn, namespace, schedule_id)
        await self._index_batch(effect, dropped)
        return effect

    async def _over_quota(
        self,
        conn: Any,
        items: Sequence[batch.Item],
        stored: dict[tuple[str, str], ScheduleRow],
    ) -> dict[int, ValidationFailed]:
        """Upserts that would create a schedule in a namespace already at its max_schedules
        (counted under the namespace's creation lock, so racing creations cannot both pass)."""
        refused: dict[int, ValidationFailed] = {}
        room: dict[str, int] = {}
        #: New schedules already given a place: naming one again in the batch is an update.
        placed: set[tuple[str, str]] = set()
        for i, item in enumerate(items):
            if not isinstance(item, batch.UpsertItem):
                continue
            key = (item.namespace, item.schedule.id)
            old = stored.get(key)
            if (old is not None and old.state != "deleted") or key in placed:
                continue
            if item.expected_version not in (None, 0):
                continue  # refused for its version (nothing stored to match): creates nothing
            quota = self.quotas.of(item.namespace)
            if quota is None or quota.max_schedules is None:
                continue
            if item.namespace not in room:
                live = await self.store.count_live_schedules(conn, item.namespace)
                room[item.namespace] = quota.max_schedules - live
            if room[item.namespace] <= 0:
                reason = (
                    f"namespace {item.namespace!r} is at its max_schedules ({quota.max_schedules})"
                )
                refused[i] = ValidationFailed(
                    "quota_exceeded",
                    f"quota exceeded: {reason}",
                    [{"field": "id", "reason": f"a new schedule is over the quota: {reason}"}],
                )
            else:
                room[item.namespace] -= 1
                placed.add(key)
        return refused

    async def _with_stats(
        self, namespace: str, shown: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Views with their ``stats`` and ``paused_reason`` (one query for all of them)."""
        records = await self.store.schedule_stats(namespace, [item["id"] for item in shown])
        return [stats.decorate(item, records.get(item["id"])) for item in shown]

    async def _index_batch(
        self, effect: batch.BatchEffect, dropped: Sequence[PendingRun] = ()
    ) -> None:
        upserts: dict[int, list[Upsert]] = {}
        removals: dict[int, list[tuple[str, int | None]]] = {}
        # A deleted schedule's pending triggers go too, even one already handed to the
        # broker: fenced out.
        for run in dropped:
            if run.kind == "trigger":
                member = keys.trigger_member(run.namespace, run.id, run.nominal_ms)
                removals.setdefault(self.index.shard_of(run.namespace, run.id), []).append(
                    (member, None)
                )
        earliest: dict[int, int] = {}
        for (namespace, schedule_id), (write, version) in effect.index_writes.items():
            shard = self.index.shard_of(namespace, schedule_id)
            if write is None:
                member = keys.member(namespace, schedule_id)
                removals.setdefault(shard, []).append((member, version))
                continue
            upserts.setdefault(shard, []).append(write)
            if write.next_fire_ms is not None:
                earliest[shard] = min(earliest.get(shard, write.next_fire_ms), write.next_fire_ms)
        if upserts:
            await self._write_index(lambda: self.index.upsert(upserts))
        if removals:
            await self._write_index(lambda: self.index.remove(removals))
        soonest = min(earliest.items(), key=lambda item: item[1], default=None)
        if soonest is not None and soonest[1] < self.now_ms() + self.settings.max_sleep_s * 1000:
            # Later fires are found by the dispatchers' own next look: no wake-up needed.
            await self.wake(*soonest)

    async def trigger(
        self, namespace: str, schedule_id: str, audit: CommandAudit
    ) -> dict[str, Any]:
        async with self.store.transaction() as conn:
            old = await self._existing(conn, namespace, schedule_id)
            # Again under the row lock: a copy of this command redelivered to another
            # dispatcher may have committed since the check before the transaction.
            earlier = await self._applied_under_lock(conn, namespace, audit, "trigger")
            if earlier is not None:
                await self._ensure_trigger(namespace, earlier)
                return {**earlier, "duplicate": True}
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

    async def _applied_under_lock(
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
        async with self.store.transaction() as conn:
            old = await self._existing(conn, namespace, schedule_id)
            earlier = await self._applied_under_lock(conn, namespace, audit, "backfill")
            if earlier is not None:
                return {**earlier, "duplicate": True}
            plan = compact.decode(old.compact)
            check_backfillable(schedule_id, old.state, plan)
            # Bounded by the limit (100,000 steps at most); counted off the event loop.
            extent = await asyncio.to_thread(backfill.extent, plan, from_ms, to_ms, command.limit)
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
            await self._record(conn, audit, old.version, reply)
        shard = self.index.shard_of(namespace, schedule_id)
        start = BackfillStart(
            keys.member(namespace, schedule_id),
            generation,
            to_ms,
            extent.occurrences,
            extent.first_ms,
        )
        await self._write_index(lambda: self.index.start_backfill(shard, start))
        if extent.first_ms is not None and old.state == "active":
            await self.wake(shard, extent.first_ms)
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

    async def list(self, namespace: str, command: commands.ListCommand) -> dict[str, Any]:
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
            "schedules": await self._with_stats(namespace, [view(row, now) for row in rows]),
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

    async def _replayed(
        self, namespace: str, verb: str, received: Received
    ) -> dict[str, Any] | None:
        """The reply already given to this command, if it was applied; ``conflict`` when its
        ``message_id`` was applied to another command.

        A command redelivered after a crash between its commit and its ack is answered, not
        applied twice: a second trigger would be a second run. It is the same command only when
        its verb and body are the same too (the namespace scopes message ids: tenants pick
        theirs independently). Should the index write of the first delivery have been lost
        with the crash, drift repair redoes it for a schedule, and for a trigger it is redone
        here when no trace of the run exists.
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
            await self._ensure_trigger(namespace, reply)
        elif verb == "backfill" and isinstance(received.command, commands.BackfillCommand):
            await self._ensure_backfill(namespace, received.command.id)
        return {**reply, "duplicate": True}

    async def _ensure_backfill(self, namespace: str, schedule_id: str) -> None:
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
        except Exception:  # committed: raising would make callers apply it again
            log.exception(
                "index write refused; left to drift repair", extra={"action": "index_deferred"}
            )


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


def _item_result(
    schedule_id: str | None, outcome: dict[str, Any] | ValidationFailed
) -> dict[str, Any]:
    """One entry of an upsert_many reply."""
    if isinstance(outcome, ValidationFailed):
        return {"id": schedule_id, "ok": False, "error": _error_of(outcome)}
    schedule = outcome["schedule"]
    return {"id": schedule["id"], "ok": True, "version": schedule["version"]}


def _schedule_ids_of(received: Received) -> list[str]:
    """The schedules a command touches (their locks keep commands on each in order)."""
    if isinstance(received.command, commands.UpsertManyCommand):
        return [item.schedule.id for item in received.items if isinstance(item, batch.UpsertItem)]
    return [_schedule_id_of(received.parsed) or ""]


def _schedule_id_of(parsed: Any) -> str | None:
    if not isinstance(parsed, dict):
        return None
    found = parsed.get("id")
    inner = parsed.get("schedule")
    if found is None and isinstance(inner, dict):
        found = inner.get("id")
    return found if isinstance(found, str) else None


def _with_refusals(
    results: list[Any], refused: dict[int, ValidationFailed], count: int
) -> list[Any]:
    """The batch's results back in item order, the items refused before it in their place."""
    kept = iter(results)
    return [refused[i] if i in refused else next(kept) for i in range(count)]
