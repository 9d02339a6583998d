"""The claim loop: due occurrences out of the Redis shards, onto ``cronbus.deliveries``.

It sleeps until the earliest due time (or a wake-up from the intake), claims in batches with
claim.lua, publishes many occurrences per message with publisher confirms, many messages in
flight at once, and stops claiming while the deliveries queue is above its high-water mark,
so that overload waits in Redis rather than in the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Sequence

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange

from services.dispatcher import pacing
from services.dispatcher.fence import Fence
from shared.contract import delivery, keys
from shared.contract.entries import Claimed, ClaimResult
from shared.policy import fairness
from shared.rabbitmq import amqp
from shared.redis.index import Index
from shared.rules import schedule
from shared.runtime import metrics, transient
from shared.runtime.config import DispatcherSettings
from shared.runtime.spans import Spans

log = logging.getLogger(__name__)

#: How often the deliveries queue depth is read for backpressure.
BACKLOG_CHECK_S = 0.25
#: How long claiming waits before looking again at an index found older than seen (s).
STALE_INDEX_PAUSE_S = 0.5
#: How soon a shard fenced (its position behind an answered command) is looked at again (s).
FENCED_PAUSE_S = 0.05


class Dispatcher:
    def __init__(
        self,
        settings: DispatcherSettings,
        index: Index,
        channel: AbstractChannel,
        stopping: asyncio.Event,
        spans: Spans | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.settings = settings
        #: The answered positions claims are fenced with (None: unfenced; tests only).
        self.fence = fence
        #: None unless spans are exported (CRONBUS_OTLP_ENDPOINT).
        self.spans = spans
        self.index = index
        self.channel = channel
        self.stopping = stopping
        self.wake_event = asyncio.Event()
        #: The shards this dispatcher claims from (all of them unless leases say otherwise).
        self.shards: list[int] = list(range(settings.shards))
        self._exchange: AbstractExchange | None = None
        self._ready_messages = 0
        self._published_since_check = 0
        self._backlog_checked = 0.0
        self._sleep_until_ms: float = 0
        #: From a claim until the sleep after it is planned (see pacing.wakes_the_loop).
        self._claiming = False
        self._redis_offset_ms = 0.0
        self._claim_span_ns = (0, 0)
        #: Occurrences claimed and being published: leased until published or released.
        self.publishing = 0
        #: The highest index generation seen (cronbus:meta:epoch): one going backwards means
        #: Redis was restored from an older snapshot, whose entries must not fire.
        self._generation = 0

    def use_shards(self, shards: list[int]) -> None:
        """The shard leases changed: claim from these from now on."""
        self.shards = list(shards)
        self.wake_event.set()

    def wake(self, fire_ms: int) -> None:
        """A schedule is due at ``fire_ms``: wake the loop if it sleeps past it."""
        now_ms = self._redis_now_ms()
        if pacing.wakes_the_loop(fire_ms, now_ms, self._sleep_until_ms, self._claiming):
            self.wake_event.set()

    def _redis_now_ms(self) -> float:
        return time.time() * 1000 + self._redis_offset_ms

    async def run(self) -> None:
        self._exchange = await self.channel.get_exchange(keys.DELIVERIES_EXCHANGE, ensure=False)
        while not self.stopping.is_set():
            try:
                await self.step()
            except transient.ERRORS as exc:
                log.warning(
                    "claim loop waits for a dependency",
                    extra={"action": "dispatcher_wait", "error": repr(exc)},
                )
                await self._pause(1.0)

    async def step(self) -> None:
        # Cleared before claiming: a wake-up that arrives while we publish is not lost.
        self.wake_event.clear()
        if await self._backpressured():
            await self._pause(BACKLOG_CHECK_S)
            return
        if await self._index_went_back():
            await self._pause(STALE_INDEX_PAUSE_S)
            return
        if self.fence is not None and not self.fence.known.is_set():
            await self._pause(FENCED_PAUSE_S)  # the answered positions are not read yet
            return
        self._claiming = True
        try:
            results = await self._claim_and_publish()
        finally:
            self._claiming = False
        await self._sleep_until_next(results)

    async def _claim_and_publish(self) -> list[ClaimResult]:
        claim_start_ns = time.time_ns() if self.spans is not None else 0
        results = await self.index.claim(
            self.shards,
            self.settings.claim_batch,
            round(self.settings.lease_s * 1000),
            answered=self.fence.answered if self.fence is not None else None,
        )
        if self.spans is not None:
            self._claim_span_ns = (claim_start_ns, time.time_ns())
        claimed = [c for result in results for c in result.claimed]
        if len(claimed) > self.settings.delivery_batch:
            # Each namespace's first occurrences lead the messages (see shared.policy.fairness).
            claimed = fairness.interleave(claimed, lambda c: fairness.namespace_of(c.member))
        for result in results:
            if result.orphans:
                metrics.ORPHANS.inc(result.orphans)
            if result.waiting:
                metrics.SIBLING_WAITS.inc(result.waiting)
            if result.fenced:
                metrics.FENCED_CLAIMS.inc()
        if claimed:
            metrics.CLAIMED.inc(len(claimed))
            self.publishing = len(claimed)
            await self.publish(claimed)
            self.publishing = 0
        return results

    async def _index_went_back(self) -> bool:
        """True while the index is of an older generation than one already seen: Redis was
        restored from an older snapshot, and until the sweeper has dropped and rebuilt it
        (a new, higher generation) nothing is claimed from it. A missing epoch is a lost
        index being rebuilt: what is rebuilt fires."""
        raw = await self.index.client.get(self.index.keys.epoch)
        if raw is None:
            return False
        generation = int(raw)
        if generation < self._generation:
            metrics.STALE_INDEX_WAITS.inc()
            log.warning(
                "index generation went back: waiting for the sweeper's rebuild",
                extra={
                    "action": "stale_index_wait",
                    "generation": generation,
                    "seen": self._generation,
                },
            )
            return True
        self._generation = generation
        return False

    async def publish(self, claimed: Sequence[Claimed]) -> None:
        """Publish in messages of up to ``delivery_batch`` occurrences, all confirms awaited
        together; what could not be published goes straight back to due (release.lua)."""
        size = self.settings.delivery_batch
        batches = [claimed[i : i + size] for i in range(0, len(claimed), size)]
        outcomes = await asyncio.gather(
            *(self._publish_one(b) for b in batches), return_exceptions=True
        )
        failed = [
            c
            for batch, outcome in zip(batches, outcomes, strict=True)
            if isinstance(outcome, BaseException)
            for c in batch
        ]
        published = len(claimed) - len(failed)
        metrics.PUBLISHED.inc(published)
        if self.spans is not None:
            self._record_spans(claimed, {id(c) for c in failed})
        messages = sum(1 for o in outcomes if not isinstance(o, BaseException))
        self._published_since_check += messages
        metrics.DELIVERY_MESSAGES.inc(messages)
        if failed:
            why = next(o for o in outcomes if isinstance(o, BaseException))
            await self._release(failed, why)

    def _record_spans(self, claimed: Sequence[Claimed], failed: set[int]) -> None:
        assert self.spans is not None
        claim_start, claim_end = self._claim_span_ns
        now = time.time_ns()
        for c in claimed:
            namespace, schedule_id, _ = keys.split_member(c.member)
            key = schedule.idempotency_key(namespace, schedule_id, c.nominal_ms)
            where: dict[str, str | int | bool] = {
                "cronbus.schedule": f"{namespace}/{schedule_id}",
                "cronbus.shard": c.shard,
            }
            self.spans.record("claim", key, c.attempt, claim_start, claim_end, where)
            error = "publish failed" if id(c) in failed else None
            self.spans.record("publish", key, c.attempt, claim_end, now, where, error)

    async def _publish_one(self, batch: Sequence[Claimed]) -> None:
        assert self._exchange is not None
        message = aio_pika.Message(
            delivery.encode(batch),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            headers={"x-cronbus-occurrences": len(batch)},
        )
        await self._exchange.publish(
            message, routing_key=amqp.DELIVERIES_ROUTING_KEY, mandatory=True, timeout=30
        )

    async def _release(self, failed: Sequence[Claimed], why: BaseException) -> None:
        metrics.PUBLISH_FAILURES.inc(len(failed))
        log.warning(
            "publish failed; occurrences released",
            extra={
                "action": "publish_failed",
                "occurrences": len(failed),
                "error": f"{type(why).__name__}: {why}"[:300],
            },
        )
        by_shard: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for c in failed:
            by_shard[c.shard].append((c.member, c.token))
        # If Redis is away too, the leases expire and the sweeper reclaims them.
        with contextlib.suppress(*transient.ERRORS):
            await self.index.release(dict(by_shard))

    async def _backpressured(self) -> bool:
        """Whether the deliveries queue is above its high-water mark.

        The broker is asked a few times a second; in between, what this dispatcher published
        counts as waiting, and reaching the mark that way asks again at once, so a fast claim
        loop cannot overshoot the mark by more than one step.
        """
        now = time.monotonic()
        mark = self.settings.deliveries_high_water
        estimate = self._ready_messages + self._published_since_check
        if now - self._backlog_checked >= BACKLOG_CHECK_S or estimate > mark:
            self._backlog_checked = now
            self._ready_messages = await amqp.ready_messages(self.channel, keys.DELIVERIES_QUEUE)
            self._published_since_check = 0
            metrics.DELIVERIES_READY.set(self._ready_messages)
        high = self._ready_messages > mark
        metrics.BACKPRESSURE.set(1 if high else 0)
        return high

    async def _sleep_until_next(self, results: Sequence[ClaimResult]) -> None:
        if not results:
            await self._pause(self.settings.max_sleep_s)
            return
        now_ms = max(r.now_ms for r in results)
        self._redis_offset_ms = now_ms - time.time() * 1000
        if any(len(r.claimed) >= self.settings.claim_batch for r in results):
            return  # more is due right now
        upcoming = [r.next_due_ms for r in results if r.next_due_ms is not None]
        if any(r.fenced for r in results):
            # A fenced shard is looked at again soon: the sweeper's replay ends the fence.
            upcoming.append(now_ms + round(FENCED_PAUSE_S * 1000))
        # At a steady load, without the coalescing window each claim and each message would
        # carry one or two occurrences.
        delay_s = (
            pacing.claim_delay_ms(
                min(upcoming, default=None),
                now_ms,
                self.settings.max_sleep_s * 1000,
                self.settings.claim_coalesce_ms,
            )
            / 1000
        )
        if delay_s <= 0:
            return
        self._sleep_until_ms = now_ms + delay_s * 1000
        await self._pause(delay_s)
        self._sleep_until_ms = 0

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once for an intake's wake-up or a stop."""
        waits = [
            asyncio.ensure_future(self.wake_event.wait()),
            asyncio.ensure_future(self.stopping.wait()),
        ]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()

    async def report_backlog(self) -> None:
        """Due-now entries per shard, as a gauge (every few seconds)."""
        while not self.stopping.is_set():
            with contextlib.suppress(*transient.ERRORS):
                now_ms = int(self._redis_now_ms())
                shards = list(self.shards)  # only the ones this dispatcher claims from
                pipe = self.index.client.pipeline(transaction=False)
                for shard in shards:
                    pipe.zcount(self.index.keys.due(shard), "-inf", now_ms)
                counts = await pipe.execute()
                metrics.DUE_BACKLOG.clear()
                for shard, count in zip(shards, counts, strict=True):
                    metrics.DUE_BACKLOG.labels(str(shard)).set(count)
            await self._pause_backlog(5.0)

    async def _pause_backlog(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)
