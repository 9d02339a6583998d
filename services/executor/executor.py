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
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from services.executor import limits, settle, tally, waves
from services.executor.audit import AuditWriter
from services.executor.autopause import AutoPause
from services.executor.deadletters import DeadLetters
from services.executor.events import Events
from services.executor.fairslots import FairSlots
from services.executor.parking import Parking
from services.executor.settle import Outcome, Settlement
from services.executor.targets import AmqpTargets, Webhooks
from services.executor.waiting import BATCH_ITEMS, WaitingLeases
from shared.contract import delivery
from shared.contract.delivery import Occurrence
from shared.contract.entries import Completion
from shared.redis.batcher import Batcher
from shared.redis.index import Index
from shared.rules.plan import WebhookPlan
from shared.runtime import metrics, transient
from shared.runtime.config import ExecutorSettings
from shared.runtime.spans import Spans

log = logging.getLogger(__name__)

#: Wake the dispatchers for occurrences due within this long (they sleep at most a second).
WAKE_HORIZON_MS = 1500
#: Longest wait of a begin or gate call for others to share its round trip (lateness).
BEGIN_FLUSH_MS = 5
#: A bug met on the way, raised once the others of the message are settled.
Failure = BaseException | None
#: An occurrence begun: the Redis clock (ms) then, and begin.lua's code (``Index.begin``).
Begun = tuple[int, int]
#: begin.lua's code for an occurrence missed by now, not flagged as begun: judge it.
MISSED = 3


class Executor(WaitingLeases, DeadLetters):
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
        spans: Spans | None = None,
    ) -> None:
        self.settings = settings
        #: None unless spans are exported (CRONBUS_OTLP_ENDPOINT).
        self.spans = spans
        self.index = index
        self.webhooks = webhooks
        self.amqp_targets = amqp_targets
        self.audit = audit
        self.events = events
        self.stopping = stopping
        self.clock = clock
        self.rng = random.Random()
        #: Calls on the way to a delivery (fencing, rate gates) wait less than completions.
        self.begin_flush_ms = min(settings.complete_flush_ms, BEGIN_FLUSH_MS)
        #: Delivery slots, handed to the namespaces with waiters in turn.
        self.fair_slots = FairSlots(settings.concurrency)
        self.autopause = AutoPause(index, audit.store, events, stopping, settings.complete_flush_ms)
        self.parking = Parking(
            index,
            stopping,
            settings.breaker_failures,
            limits.MAX_RESERVE_MS,
            settings.complete_flush_ms,
            safety_ms=round(settings.park_safety_s * 1000),
        )
        self.limits = limits.Limits(
            index,
            settings,
            stopping,
            self.now_ms,
            self.begin_flush_ms,
            on_close=self.parking.nudge,
        )
        self.lease_ms = round(settings.lease_s * 1000)
        #: Occurrences begun (lease held) and not settled yet: handed back if cut off.
        self._holding: dict[tuple[int, str], int] = {}
        #: Occurrences received and waiting for a delivery slot: their leases are kept alive
        #: (``keep_waiting_leases``) so a long wait never lets the sweeper hand them out again.
        self._waiting: dict[tuple[int, str], int] = {}
        self._begin = Batcher(
            self._flush_begin,
            max_delay_ms=self.begin_flush_ms,
            max_items=BATCH_ITEMS,
            name="begin",
        )
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

    async def _flush_begin(
        self, items: Sequence[tuple[int, tuple[str, int, int, int | None]]]
    ) -> list[Begun | None]:
        """Per item whose delivery starts, ``Begun`` when its lease is held, or None when it
        is stale."""
        now, codes = await self.index.begin(tally.by_shard(items))
        return [(now, code) if code else None for code in tally.in_order(items, codes)]

    async def _flush_complete(self, items: Sequence[tuple[int, Completion]]) -> list[int]:
        codes = tally.in_order(items, await self.index.complete(tally.by_shard(items)))
        await self._wake_for(
            [
                c.next_fire_ms
                for (_, c), code in zip(items, codes, strict=True)
                if code and c.next_fire_ms is not None
            ]
        )
        return codes

    async def _flush_retry(self, items: Sequence[tuple[int, tuple[str, int, int]]]) -> list[int]:
        codes = tally.in_order(items, await self.index.retry(tally.by_shard(items)))
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
            free = self.fair_slots.take_now(len(occurrences))
            if free == len(occurrences):
                # Nothing waits for a slot: no hold, begun right away.
                await self._deliver_as_granted(occurrences, {})
            else:
                await self._run_when_slots(occurrences, free)
        except (transient.Stopped, asyncio.CancelledError) as exc:
            # Handed back: the redelivery's fencing skips whatever was settled already.
            with contextlib.suppress(Exception):
                await asyncio.shield(message.nack(requeue=True))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        except Exception:
            # A bug, not an outage: back to the queue, whose delivery limit counts the
            # failures; past it the broker dead-letters the message, and its occurrences end
            # dead with the reason (settle_dead_letter) instead of failing forever.
            log.exception("delivery message failed", extra={"action": "delivery_failed"})
            with contextlib.suppress(*transient.ERRORS):
                await message.nack(requeue=True)
            return
        with contextlib.suppress(*transient.ERRORS):
            # If the ack is lost the broker redelivers, and fencing skips what is settled.
            await message.ack()

    async def _run_when_slots(self, occurrences: Sequence[Occurrence], free: int) -> None:
        """A message with slots for its first ``free`` occurrences only (taken): the others
        are held (their leases kept alive meanwhile) and each claims a slot; those granted
        together start together."""
        try:
            live = await self.hold(occurrences[free:])
        except BaseException:
            for _ in range(free):
                self.fair_slots.release()
            raise
        claims = {self.fair_slots.claim(occ.namespace): occ for occ in live}
        try:
            await self._deliver_as_granted(occurrences[:free], claims)
        finally:
            self._stop_waiting(live)

    async def process(self, occ: Occurrence) -> None:
        """Deliver and settle one held occurrence once a slot is free for it."""
        await self._deliver_as_granted((), {self.fair_slots.claim(occ.namespace): occ})

    async def _deliver_as_granted(
        self,
        granted: Sequence[Occurrence],
        claims: dict[asyncio.Future[None], Occurrence],
    ) -> None:
        """Occurrences holding a slot (``granted``) and occurrences waiting for one
        (``claims``), in waves: those granted together are begun in one round trip, judged
        (misfire, admission) without one where nothing special applies, and delivered
        concurrently; those whose deliveries end together are settled together (each within
        its own lease). A failure (a bug) is raised once the others are settled, as gathering
        them did."""
        arrivals = waves.Arrivals()
        waiting = set(claims)
        for claim in waiting:
            claim.add_done_callback(arrivals.add)
        attempts = waves.Watched(arrivals)
        later: waves.Later = []  # events, failure counts (a pause may wait for PostgreSQL)
        failure: BaseException | None = None
        try:
            if granted:
                failure = await waves.kept(self._start(granted, attempts, later))
            while waiting or attempts:
                done = await arrivals.next()
                now_granted = self._granted(done, waiting, claims)
                ended, failed = waves.ended(done, attempts)
                failures = [failure, failed]
                if now_granted:
                    failures.append(await waves.kept(self._start(now_granted, attempts, later)))
                if ended:
                    failures.append(await waves.kept(self._settle_ended(ended, later)))
                failure = next((f for f in failures if f is not None), None)
            for result in await asyncio.gather(*later, return_exceptions=True):
                if isinstance(result, BaseException):
                    failure = failure or result
        finally:
            self._done_with(granted, claims, waiting, attempts, later)
        if failure is not None:
            raise failure

    def _done_with(
        self,
        granted: Sequence[Occurrence],
        claims: dict[asyncio.Future[None], Occurrence],
        waiting: set[asyncio.Future[None]],
        attempts: waves.Watched,
        later: waves.Later,
    ) -> None:
        """A message's waves are over, or cut off: what they still hold is given back."""
        # Whatever became of them (settled, or a bug on the way), a rebuild's audit barrier
        # no longer waits for this message's occurrences.
        for occ in (*granted, *claims.values()):
            self.audit.barrier.end(id(occ))
        for claim in waiting:
            self.fair_slots.withdraw(claims[claim].namespace, claim)
        for attempt in attempts:
            attempt.cancel()
        for pending in later:
            pending.cancel()

    def _granted(
        self,
        done: set[asyncio.Future[Any]],
        waiting: set[asyncio.Future[None]],
        claims: dict[asyncio.Future[None], Occurrence],
    ) -> list[Occurrence]:
        """The occurrences whose claims were granted (no longer waiting: their leases are
        no longer kept alive here; begin extends them)."""
        granted = []
        for claim in done & waiting:
            waiting.discard(claim)
            occ = claims[claim]
            self._waiting.pop((occ.shard, occ.member), None)
            granted.append(occ)
        return granted

    async def _start(
        self, granted: Sequence[Occurrence], attempts: waves.Watched, later: waves.Later
    ) -> Failure:
        """Begin occurrences holding a slot each, in one round trip (the lease is checked
        and extended only now, right before the delivery: one whose lease ran out while it
        waited was handed out again by the sweeper, and is left to that copy; misfire
        decisions use the Redis clock this answers with); their attempts go into
        ``attempts``, each giving its slot back when it ends. A stale one gives its slot back
        at once, as does one the misfire policy skips (settled here) or one whose judging
        failed (a bug: the first is returned, the others go on). begin.lua flags what is on
        time (or never judged) as begun; a missed one its policy still delivers is flagged by
        a second round trip (``_start_late``)."""
        unused = len(granted)
        failure: BaseException | None = None
        skipped: list[tuple[Occurrence, Settlement]] = []
        late: list[tuple[Occurrence, int]] = []
        begun = self.now_ms()
        try:
            # Before begin.lua flags them: a barrier read meanwhile must wait for them.
            for occ in granted:
                self.audit.barrier.begin(id(occ))
            items = [
                (occ.shard, self._begin_item(occ, settle.misfire_cutoff(occ))) for occ in granted
            ]
            results = await transient.retry(
                lambda: self._begin.submit_many(items), what="begin", stopping=self.stopping
            )
            for occ, fenced in zip(granted, results, strict=True):
                unused -= 1
                if fenced is None:
                    metrics.STALE.labels("begin").inc()
                    self._let_go(occ)
                    self.fair_slots.release()
                    continue
                now, code = fenced
                self._hold(occ)
                if code != MISSED:
                    self._launch(occ, now, begun, attempts)
                    continue
                try:
                    chosen = settle.missed_choice(occ, now)
                    if chosen == occ.nominal_ms:
                        late.append((occ, now))
                        continue
                    skipped.append((occ, settle.skip(occ, occ.idempotency_key, chosen, now)))
                    tally.log_misfire(occ, chosen)
                except Exception as exc:  # noqa: BLE001 - returned, raised once all are settled
                    self._let_go(occ)
                    failure = failure or exc
                self.fair_slots.release()
        finally:
            for _ in range(unused):
                self.fair_slots.release()
        try:
            await self._settle_many(skipped, later)
        finally:
            if late:
                await self._start_late(late, attempts, begun)
        return failure

    async def _start_late(
        self, late: Sequence[tuple[Occurrence, int]], attempts: waves.Watched, begun: int
    ) -> None:
        """Missed occurrences their misfire policy delivers all the same (fire_once's or
        fire_all's catch-up): flagged as begun, then delivered as judged."""
        items = [(occ.shard, self._begin_item(occ, None)) for occ, _ in late]
        try:
            results = await transient.retry(
                lambda: self._begin.submit_many(items), what="begin", stopping=self.stopping
            )
        except BaseException:
            for occ, _ in late:
                self._let_go(occ)
                self.fair_slots.release()
            raise
        for (occ, now), fenced in zip(late, results, strict=True):
            if fenced is None:
                metrics.STALE.labels("begin").inc()
                self._let_go(occ)
                self.fair_slots.release()
            else:
                self._launch(occ, now, begun, attempts)

    def _begin_item(self, occ: Occurrence, cutoff: int | None) -> tuple[str, int, int, int | None]:
        return (occ.member, occ.token, occ.plan.target.timeout_ms + self.lease_ms, cutoff)

    def _launch(self, occ: Occurrence, now: int, begun: int, attempts: waves.Watched) -> None:
        attempt = asyncio.ensure_future(self._attempt(occ, occ.idempotency_key, now, begun))
        attempt.add_done_callback(lambda _: self.fair_slots.release())
        attempts.add(attempt)

    def _hold(self, occ: Occurrence) -> None:
        """Begun: held until settled (a rebuild's audit barrier waits for it meanwhile: its
        ticket was taken before begin.lua ran)."""
        self._holding[(occ.shard, occ.member)] = occ.token

    def _let_go(self, occ: Occurrence) -> None:
        """Settled (its row buffered), parked, handed back, or never begun (stale)."""
        self._holding.pop((occ.shard, occ.member), None)
        self.audit.barrier.end(id(occ))

    async def _settle_ended(self, ended: Sequence[waves.Attempt], later: waves.Later) -> Failure:
        """Settle attempts that ended together; one whose settlement cannot be decided (a
        bug) is left out (the first such failure is returned), the others are settled."""
        settled, failure = waves.settlements(ended, self.rng)
        await self._settle_many(settled, later)
        if self.spans is not None:
            for a in ended:
                tally.record_spans(self.spans, a.occ, a.key, a.outcome, a.started, a.finished)
        return failure

    async def _attempt(
        self, occ: Occurrence, key: str, now: int, begun: int
    ) -> waves.Attempt | None:
        """One occurrence's admission and delivery, in the slot taken for it; None when its
        rate key held it (parked, not settled)."""
        admission: limits.Admission | None = None
        if not self.amqp_targets.refuses(occ):
            admission = self.limits.admitted_now(occ)
            if admission is None:
                admission = await self.limits.admit(occ)
                if admission.code == limits.HELD:
                    await self._park(occ, admission)
                    return None
                if admission.code == limits.WAIT:
                    await asyncio.sleep(admission.ms / 1000)
        outcome, started, finished = await self._deliver(occ, key)
        settled_now = now + (finished - begun)
        outcome = self.limits.capped(outcome)
        if admission is not None:
            await self.limits.report(occ, admission, outcome)
        return waves.Attempt(occ, key, now, outcome, started, finished, settled_now)

    async def begin(self, occ: Occurrence) -> int | None:
        """Fence one occurrence as its delivery starts: if its token is still current, hold
        its lease for the delivery and return the Redis clock (ms); None when it is stale.
        Calls from occurrences starting together go to Redis in one round trip."""
        self.audit.barrier.begin(id(occ))
        try:
            begun = await transient.retry(
                lambda: self._begin.submit((occ.shard, self._begin_item(occ, None))),
                what="begin",
                stopping=self.stopping,
            )
        except BaseException:
            self._let_go(occ)
            raise
        if begun is None:
            metrics.STALE.labels("begin").inc()
            self._let_go(occ)
            return None
        self._hold(occ)
        return begun[0]

    async def _park(self, occ: Occurrence, admission: limits.Admission) -> None:
        """Held by a rate key: parked behind it, same attempt, until its gate can let it
        through (``services.executor.parking``)."""
        code = await self.parking.park(occ, admission.held_by, admission.ms, admission.held_limit)
        self._let_go(occ)
        if not code:
            metrics.STALE.labels("park").inc()

    async def _deliver(self, occ: Occurrence, key: str) -> tuple[Outcome, int, int]:
        kind = "webhook" if isinstance(occ.plan.target, WebhookPlan) else "amqp"
        started = self.now_ms()
        if occ.attempt == 1 and not occ.is_backfill:
            # Retries are late by design (their backoff), backfills by definition (the past,
            # asked for): lateness measures first attempts, from the due time.
            metrics.FIRE_LATENESS.observe(max(started - occ.due_ms, 0) / 1000)
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
            outcome = Outcome(False, None, f"internal error: {exc!r}"[:500], sent=False)
        finally:
            metrics.IN_FLIGHT.dec()
        finished = self.now_ms()
        tally.delivery_duration(kind).observe((finished - started) / 1000)
        attempt_result = (
            "succeeded"
            if outcome.ok
            else (
                "failed"
                if occ.attempt < occ.plan.retry.max_attempts and not outcome.permanent
                else "dead"
            )
        )
        tally.delivered(kind, attempt_result).inc()
        if occ.is_backfill:
            metrics.BACKFILL_DELIVERED.labels(attempt_result).inc()
        return outcome, started, finished

    def holding(self) -> int:
        """Occurrences begun (leased) and not settled: left to their leases if not released."""
        return len(self._holding)

    async def release_abandoned(self) -> int:
        """Occurrences begun but cut off by shutdown go back to due at once (release.lua).

        When Redis cannot be reached they stay held, and their leases expire instead.
        """
        if not self._holding:
            return 0
        by_shard: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for (shard, member), token in self._holding.items():
            by_shard[shard].append((member, token))
        with contextlib.suppress(*transient.ERRORS):
            codes = await self.index.release(dict(by_shard))
            self.audit.barrier.end_all()
            self._holding.clear()
            released = sum(sum(c) for c in codes.values())
            log.info(
                "occurrences handed back", extra={"action": "released", "occurrences": released}
            )
            return released
        return 0

    async def drain(self) -> None:
        for batcher in (self._begin, self._complete, self._retry):
            await batcher.drain()
        await self.autopause.drain()
        await self.limits.drain()
        await self.parking.drain()
