"""Delivering occurrences: check the token, deliver, then complete or retry, then ack.

A message from ``cronbus.deliveries`` carries many occurrences. Each is fenced first (begin.lua:
a stale token means another process already took care of it, so it is skipped), delivered
with bounded concurrency, and settled: complete.lua places the schedule's next occurrence, or
retry.lua puts the same occurrence back with a backoff. Only when every occurrence of the
message is settled in Redis is the message acknowledged; a crash before that redelivers it,
and the fencing tokens make the redelivery skip what was already settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TypeVar

from aio_pika.abc import AbstractIncomingMessage

from services.executor import limits, settle
from services.executor.audit import AuditWriter
from services.executor.autopause import AutoPause
from services.executor.events import Events
from services.executor.fairslots import FairSlots
from services.executor.settle import Outcome, Settlement
from services.executor.targets import AmqpTargets, Webhooks
from shared import delivery, metrics, schedule, transient
from shared.batcher import Batcher
from shared.config import ExecutorSettings
from shared.delivery import Occurrence
from shared.index import Completion, Index
from shared.plan import WebhookPlan

log = logging.getLogger(__name__)

T = TypeVar("T")
BATCH_ITEMS = 2000
#: Wake the dispatchers for occurrences due within this long (they sleep at most a second).
WAKE_HORIZON_MS = 1500


def _by_shard(items: Sequence[tuple[int, T]]) -> dict[int, list[T]]:
    grouped: dict[int, list[T]] = defaultdict(list)
    for shard, item in items:
        grouped[shard].append(item)
    return grouped


def _in_order(items: Sequence[tuple[int, object]], codes: dict[int, list[int]]) -> list[int]:
    """Per-shard results back into the order the items were submitted in."""
    cursors = dict.fromkeys(codes, 0)
    ordered = []
    for shard, _ in items:
        ordered.append(codes[shard][cursors[shard]])
        cursors[shard] += 1
    return ordered


def _count_outcome(namespace: str, settlement: Settlement) -> None:
    label = metrics.NAMESPACES(namespace)
    metrics.NAMESPACE_OUTCOMES.labels(label, settlement.event).inc()
    if settlement.row.excluded:
        metrics.NAMESPACE_OUTCOMES.labels(label, "excluded").inc(settlement.row.excluded)


class Executor:
    def __init__(
        self,
        settings: ExecutorSettings,
        index: Index,
        webhooks: Webhooks,
        amqp_targets: AmqpTargets,
        audit: AuditWriter,
        events: Events,
        stopping: asyncio.Event,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.index = index
        self.webhooks = webhooks
        self.amqp_targets = amqp_targets
        self.audit = audit
        self.events = events
        self.stopping = stopping
        self.clock = clock
        self.rng = random.Random()
        #: Delivery slots, handed to the namespaces with waiters in turn.
        self.fair_slots = FairSlots(settings.concurrency)
        self.lease_ms = round(settings.lease_s * 1000)
        self.autopause = AutoPause(index, audit.store, events, stopping, settings.complete_flush_ms)
        self.limits = limits.Limits(
            index, settings, stopping, self.now_ms, settings.complete_flush_ms
        )
        #: Occurrences begun (lease held) and not settled yet: handed back if cut off.
        self._holding: dict[tuple[int, str], int] = {}
        self._complete = Batcher(
            self._flush_complete,
            max_delay_ms=settings.complete_flush_ms,
            max_items=BATCH_ITEMS,
            name="complete",
        )
        self._retry = Batcher(
            self._flush_retry,
            max_delay_ms=settings.complete_flush_ms,
            max_items=BATCH_ITEMS,
            name="retry",
        )

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    # --- batched Redis calls ------------------------------------------------------------------

    async def _flush_begin(self, items: Sequence[tuple[int, tuple[str, int, int]]]) -> list[int]:
        return _in_order(items, await self.index.begin(_by_shard(items)))

    async def _flush_complete(self, items: Sequence[tuple[int, Completion]]) -> list[int]:
        codes = _in_order(items, await self.index.complete(_by_shard(items)))
        await self._wake_for(
            [
                c.next_fire_ms
                for (_, c), code in zip(items, codes, strict=True)
                if code and c.next_fire_ms is not None
            ]
        )
        return codes

    async def _flush_retry(self, items: Sequence[tuple[int, tuple[str, int, int]]]) -> list[int]:
        codes = _in_order(items, await self.index.retry(_by_shard(items)))
        now = self.now_ms()
        await self._wake_for(
            [now + delay for (_, (_, _, delay)), code in zip(items, codes, strict=True) if code]
        )
        return codes

    async def _wake_for(self, fire_times: Sequence[int]) -> None:
        """Dispatchers sleep until the earliest due time they know of; an occurrence this
        executor just put back (a retry, a short interval) may be due sooner than that."""
        if not fire_times:
            return
        soonest = min(fire_times)
        if soonest - self.now_ms() < WAKE_HORIZON_MS:
            with contextlib.suppress(*transient.ERRORS):
                await self.index.client.publish(self.index.keys.wake_channel, str(soonest))

    # --- one message --------------------------------------------------------------------------

    async def handle(self, message: AbstractIncomingMessage) -> None:
        try:
            occurrences = delivery.decode(message.body)
        except (ValueError, KeyError, TypeError) as exc:
            log.error(
                "undecodable delivery message dead-lettered",
                extra={"action": "delivery_rejected", "error": repr(exc)},
            )
            metrics.DEAD_LETTERED.labels("cronbus.deliveries").inc()
            await message.reject(requeue=False)
            return
        try:
            await self.audit.wait_for_room()
            live = await self.begin(occurrences)
            await asyncio.gather(*(self.process(occ) for occ in live))
        except (transient.Stopped, asyncio.CancelledError) as exc:
            # Handed back: the redelivery's fencing skips whatever was settled already.
            with contextlib.suppress(Exception):
                await asyncio.shield(message.nack(requeue=True))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        except Exception:
            # A bug, not an outage: park the message; its leases expire and the sweeper
            # hands the occurrences out again.
            log.exception("delivery message failed", extra={"action": "delivery_failed"})
            with contextlib.suppress(*transient.ERRORS):
                await message.reject(requeue=False)
            return
        with contextlib.suppress(*transient.ERRORS):
            # If the ack is lost the broker redelivers, and fencing skips what is settled.
            await message.ack()

    async def begin(self, occurrences: Sequence[Occurrence]) -> list[Occurrence]:
        """Fence a message's occurrences in one round trip: those whose token is still
        current are held (lease extended for the delivery); the others are stale."""
        items = [
            (occ.shard, (occ.member, occ.token, occ.plan.target.timeout_ms + self.lease_ms))
            for occ in occurrences
        ]
        codes = await transient.retry(
            lambda: self._flush_begin(items), what="begin", stopping=self.stopping
        )
        live = []
        for occ, code in zip(occurrences, codes, strict=True):
            if code:
                self._holding[(occ.shard, occ.member)] = occ.token
                live.append(occ)
            else:
                metrics.STALE.labels("begin").inc()
        return live

    async def process(self, occ: Occurrence) -> None:
        """Deliver and settle one fenced occurrence (waiting out Redis outages)."""
        key = schedule.idempotency_key(occ.namespace, occ.id, occ.nominal_ms)
        chosen = settle.missed_choice(occ, self.now_ms())
        if chosen != occ.nominal_ms and await self.limits.was_deferred(occ):
            chosen = occ.nominal_ms  # admitted before a rate key held it: late, not missed
        if chosen != occ.nominal_ms:
            metrics.MISFIRES.labels(occ.plan.misfire.policy).inc()
            log.info(
                "missed occurrence skipped by its misfire policy",
                extra={
                    "action": "misfire",
                    "schedule": occ.member,
                    "nominal_ms": occ.nominal_ms,
                    "next_ms": chosen,
                    "policy": occ.plan.misfire.policy,
                },
            )
            await self._settle(occ, settle.skip(occ, key, chosen, self.now_ms()))
            return
        delivered = await self._deliver_within_limits(occ, key)
        if delivered is None:
            return  # held by its rate key: back in due at the hold's end
        outcome, started, finished = delivered
        await self._settle(
            occ, settle.settle(occ, key, outcome, started, finished, self.now_ms(), self.rng)
        )

    async def _deliver_within_limits(
        self, occ: Occurrence, key: str
    ) -> tuple[Outcome, int, int] | None:
        """Deliver when the rate key admits it (waiting a reserved slot out without holding a
        concurrency slot); None when the rate key holds it, and it was put back into due."""
        admission = await self.limits.admit(occ)
        if admission.code == limits.HELD:
            code = await self.limits.defer(occ, admission.ms)
            self._holding.pop((occ.shard, occ.member), None)
            if not code:
                metrics.STALE.labels("defer").inc()
            return None
        if admission.code == limits.WAIT:
            await asyncio.sleep(admission.ms / 1000)
        async with self.fair_slots.slot(occ.namespace):
            outcome, started, finished = await self._deliver(occ, key)
        outcome = self.limits.capped(outcome)
        await self.limits.report(occ, admission, outcome)
        return outcome, started, finished

    async def _deliver(self, occ: Occurrence, key: str) -> tuple[Outcome, int, int]:
        kind = "webhook" if isinstance(occ.plan.target, WebhookPlan) else "amqp"
        started = self.now_ms()
        if occ.attempt == 1:
            # Retries are late by design (their backoff); lateness measures the first attempt.
            metrics.FIRE_LATENESS.observe(max(started - occ.nominal_ms, 0) / 1000)
        if self.events.wanted("fired"):
            await self.events.publish(
                "fired", settle.row_of(occ, key, "fired", None, started, started)
            )
        metrics.IN_FLIGHT.inc()
        try:
            if kind == "webhook":
                outcome = await self.webhooks.deliver(occ, key)
            else:
                outcome = await self.amqp_targets.deliver(occ, key)
        except Exception as exc:
            # A bug must not strand the occurrence: it counts as a failed attempt.
            log.exception(
                "delivery raised", extra={"action": "delivery_error", "schedule": occ.member}
            )
            outcome = Outcome(False, None, f"internal error: {exc!r}"[:500])
        finally:
            metrics.IN_FLIGHT.dec()
        finished = self.now_ms()
        metrics.DELIVERY_DURATION.labels(kind).observe((finished - started) / 1000)
        attempt_result = (
            "succeeded"
            if outcome.ok
            else ("failed" if occ.attempt < occ.plan.retry.max_attempts else "dead")
        )
        metrics.DELIVERED.labels(kind, attempt_result).inc()
        return outcome, started, finished

    async def _settle(self, occ: Occurrence, settlement: Settlement) -> None:
        if settlement.completion is not None:
            completion = settlement.completion
            code = await transient.retry(
                lambda: self._complete.submit((occ.shard, completion)),
                what="complete",
                stopping=self.stopping,
            )
        else:
            delay = settlement.retry_delay_ms or 0
            code = await transient.retry(
                lambda: self._retry.submit((occ.shard, (occ.member, occ.token, delay))),
                what="retry",
                stopping=self.stopping,
            )
            if code:
                metrics.RETRIES.inc()
        self._holding.pop((occ.shard, occ.member), None)
        if not code:
            # Reclaimed or revoked while we delivered: another message carries it now.
            metrics.STALE.labels("complete").inc()
        if settlement.event == "dead":
            metrics.DEAD.inc()
        _count_outcome(occ.namespace, settlement)
        self.audit.add(settlement.row, settlement.checkpoint if code else None)
        self._log(occ, settlement)
        await self.events.publish(settlement.event, settlement.row)
        if code:
            await self.autopause.record(occ, settlement.event)

    def _log(self, occ: Occurrence, settlement: Settlement) -> None:
        if settlement.event == "succeeded" and not log.isEnabledFor(logging.DEBUG):
            return
        row = settlement.row
        level = logging.WARNING if settlement.event in ("failed", "dead") else logging.DEBUG
        log.log(
            level,
            "occurrence %s",
            settlement.event,
            extra={
                "action": f"occurrence_{settlement.event}",
                "schedule": occ.member,
                "nominal_ms": occ.nominal_ms,
                "attempt": occ.attempt,
                "idempotency_key": row.idempotency_key,
                "http_status": row.http_status,
                "error": row.error,
                "retry_in_ms": settlement.retry_delay_ms,
            },
        )

    async def release_abandoned(self) -> int:
        """Occurrences begun but cut off by shutdown go back to due at once (release.lua)."""
        if not self._holding:
            return 0
        by_shard: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for (shard, member), token in self._holding.items():
            by_shard[shard].append((member, token))
        self._holding.clear()
        with contextlib.suppress(*transient.ERRORS):
            codes = await self.index.release(dict(by_shard))
            released = sum(sum(c) for c in codes.values())
            log.info(
                "occurrences handed back", extra={"action": "released", "occurrences": released}
            )
            return released
        return 0

    async def drain(self) -> None:
        for batcher in (self._complete, self._retry):
            await batcher.drain()
        await self.autopause.drain()
        await self.limits.drain()
