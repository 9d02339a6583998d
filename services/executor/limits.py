"""Rate limits, Retry-After holds and circuit breakers per rate key, shared by all executors.

Before a delivery, the executor asks ``gate.lua`` (one call per batch) whether the rate key
admits it: go now, go after a reserved wait (at most ``MAX_RESERVE_MS``, waited out in its
delivery slot), or held until some instant. A held
occurrence is not slept on, nor re-polled: it is parked once behind the key that held it
(``services.executor.parking``) with its attempt unchanged, so it burns no attempt and holds
no lease, no concurrency slot and no message meanwhile, and is released when the gate can let
it through. After the attempt, ``report.lua`` (one call per batch) feeds the breaker and
records a Retry-After hold; a breaker it closes releases what is parked behind it at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from services.executor.settle import Outcome
from shared.contract.delivery import Occurrence
from shared.policy import limits
from shared.policy.holds import format_limit
from shared.redis.batcher import Batcher
from shared.redis.index import Index
from shared.runtime import metrics, quotas, transient
from shared.runtime.config import ExecutorSettings

log = logging.getLogger(__name__)

BATCH_ITEMS = 2000
#: Longest wait a rate limit reserves a slot for (the occurrence waits in its delivery slot, so
#: a limited key holds at most rate x 2 s + burst slots); a longer wait defers it back to due.
MAX_RESERVE_MS = 2000
#: A probe may take its timeout plus this before another probe is let through.
PROBE_MARGIN_MS = 5000
#: A breaker with no failure for its cooldown plus this long is forgotten.
BREAKER_IDLE_MS = 3_600_000
GO, WAIT, HELD = 0, 1, 2
#: What report.lua is told of an attempt: the host down, up, or nothing sent.
DOWN, UP, NO_NEWS = 0, 1, 2
#: The namespace's own bucket for max_fires_per_s (a space: no user rate key has one).
QUOTA_KEY = " max_fires_per_s"
#: An unlimited rate key found clear (no hold, no failures) is not asked again for this long:
#: a hold or a breaker another executor sets is seen at most this late.
CLEAR_FOR_S = 0.25
#: Most rate keys remembered as clear.
MAX_CLEAR_KEYS = 10_000


@dataclass(frozen=True, slots=True)
class Admission:
    rate_key: str
    code: int
    #: WAIT: how long to wait; HELD: until when (epoch ms).
    ms: int
    probe: bool
    #: The breaker counts failures: a success must be reported to close it.
    dirty: bool
    #: HELD: the key that held it (the target's, or the namespace's quota bucket) and that
    #: key's limit (``shared.policy.holds.format_limit``), for parking behind it.
    held_by: str = ""
    held_limit: str = "0.000|1"


class Limits:
    def __init__(
        self,
        index: Index,
        settings: ExecutorSettings,
        stopping: asyncio.Event,
        clock: Callable[[], int],
        flush_ms: int,
        on_close: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.index = index
        self.stopping = stopping
        self.now_ms = clock
        self.breaker_failures = settings.breaker_failures
        self.cooldown_ms = round(settings.breaker_cooldown_s * 1000)
        self.max_retry_after_ms = round(settings.max_retry_after_s * 1000)
        options = {"max_delay_ms": flush_ms, "max_items": BATCH_ITEMS}
        self._gate = Batcher(self._flush_gate, name="gate", **options)
        self._report = Batcher(self._flush_report, name="report", **options)
        #: Called with a rate key whose breaker this executor closed.
        self.on_close = on_close
        self.quotas = quotas.QuotaFile(settings.quotas_file)
        #: Unlimited rate keys found clear, until (monotonic seconds).
        self._clear_until: dict[str, float] = {}

    # --- batched Redis calls ------------------------------------------------------------------

    async def _flush_gate(
        self, items: Sequence[tuple[str, float, int, int]]
    ) -> list[tuple[int, int, int]]:
        return await self.index.gate(items, self.breaker_failures, MAX_RESERVE_MS)

    async def _flush_report(self, items: Sequence[tuple[str, int, int | None]]) -> list[int]:
        return await self.index.report(
            items, self.breaker_failures, self.cooldown_ms, BREAKER_IDLE_MS
        )

    # --- the executor's hooks -----------------------------------------------------------------

    async def admit(self, occ: Occurrence) -> Admission:
        """Admission by the target's rate key, and by the namespace's max_fires_per_s."""
        admission = await self._admit_target(occ)
        quota = self.quotas.of(occ.namespace)
        if quota is None or quota.max_fires_per_s is None or admission.code == HELD:
            return admission
        item = (
            f"{occ.namespace}|{QUOTA_KEY}",
            1000 / quota.max_fires_per_s,
            max(1, math.ceil(quota.max_fires_per_s)),
            0,
        )
        code, ms, _ = await transient.retry(
            lambda: self._gate.submit(item), what="quota gate", stopping=self.stopping
        )
        if code == HELD:
            metrics.RATE_HELD.labels(metrics.NAMESPACES(occ.namespace)).inc()
            if admission.probe:
                # The target's gate gave it the half-open breaker's one probe, and it goes
                # nowhere: the next delivery of the key probes at once, not after a timeout.
                await self._give_back_probe(admission.rate_key)
            held_limit = format_limit(item[1], item[2])
            return dataclasses.replace(
                admission, code=HELD, ms=ms, probe=False, held_by=item[0], held_limit=held_limit
            )
        if code == WAIT and (admission.code != WAIT or ms > admission.ms):
            metrics.RATE_WAITS.labels(metrics.NAMESPACES(occ.namespace)).inc()
            return dataclasses.replace(admission, code=WAIT, ms=ms)
        return admission

    def admitted_now(self, occ: Occurrence) -> Admission | None:
        """The admission ``admit`` would give without a round trip (an unlimited rate key
        found clear moments ago, and no fire rate quota), or None when it must be asked."""
        target = occ.plan.target
        if target.rate_per_s is not None:
            return None
        key = limits.rate_key(occ.namespace, target)
        if self._clear_until.get(key, 0.0) <= time.monotonic():
            return None
        quota = self.quotas.of(occ.namespace)
        if quota is not None and quota.max_fires_per_s is not None:
            return None
        return Admission(key, GO, 0, False, False)

    async def _admit_target(self, occ: Occurrence) -> Admission:
        target = occ.plan.target
        key = limits.rate_key(occ.namespace, target)
        bucket = limits.bucket_of(target)
        if bucket is None and self._clear_until.get(key, 0.0) > time.monotonic():
            return Admission(key, GO, 0, False, False)
        item = (
            key,
            bucket.interval_ms if bucket else 0.0,
            bucket.burst if bucket else 1,
            target.timeout_ms + PROBE_MARGIN_MS,
        )
        code, ms, flags = await transient.retry(
            lambda: self._gate.submit(item), what="rate gate", stopping=self.stopping
        )
        admission = Admission(
            key, code, ms, bool(flags & 1), bool(flags & 2), key, format_limit(item[1], item[2])
        )
        if bucket is None and code == GO and not flags:
            if len(self._clear_until) >= MAX_CLEAR_KEYS:
                self._clear_until.clear()
            self._clear_until[key] = time.monotonic() + CLEAR_FOR_S
        label = metrics.NAMESPACES(occ.namespace)
        if code == WAIT:
            metrics.RATE_WAITS.labels(label).inc()
        elif code == HELD:
            metrics.RATE_HELD.labels(label).inc()
        return admission

    async def report(self, occ: Occurrence, admission: Admission, outcome: Outcome) -> None:
        health = limits.attempt_health(outcome)
        if health is limits.Health.UNKNOWN:
            # Refused before anything was sent: it says nothing of the target's health, and
            # must not open a breaker other schedules of the rate key share. A probe gives
            # its slot back, or what waits behind the breaker would wait out its timeout.
            if admission.probe:
                await self._give_back_probe(admission.rate_key)
            return
        retry_after = outcome.retry_after_ms
        if retry_after is not None:
            retry_after = min(retry_after, self.max_retry_after_ms)
        # The breaker counts only what says the host is unhealthy: a 404 on one schedule's
        # path is the host answering, and closes the breaker like a success.
        up = health is limits.Health.UP
        if up and retry_after is None and not admission.dirty and not admission.probe:
            return  # nothing to close, nothing to hold: no round trip
        self._clear_until.pop(admission.rate_key, None)
        item = (admission.rate_key, UP if up else DOWN, retry_after)
        code = await transient.retry(
            lambda: self._report.submit(item), what="rate report", stopping=self.stopping
        )
        if code:
            state = "closed" if code == 1 else "open"
            metrics.BREAKER_TRANSITIONS.labels(metrics.NAMESPACES(occ.namespace), state).inc()
            log.warning(
                "circuit breaker %s",
                state,
                extra={"action": f"breaker_{state}", "rate_key": admission.rate_key},
            )
            if code == 1 and self.on_close is not None:
                await self.on_close(admission.rate_key)

    async def _give_back_probe(self, rate_key: str) -> None:
        item = (rate_key, NO_NEWS, None)
        await transient.retry(
            lambda: self._report.submit(item), what="rate report", stopping=self.stopping
        )
        if self.on_close is not None:
            await self.on_close(rate_key)  # look at the key now: the next probe may go

    def capped(self, outcome: Outcome) -> Outcome:
        """The outcome with its Retry-After capped at CRONBUS_MAX_RETRY_AFTER_S."""
        if outcome.retry_after_ms is None or outcome.retry_after_ms <= self.max_retry_after_ms:
            return outcome
        return dataclasses.replace(outcome, retry_after_ms=self.max_retry_after_ms)

    async def drain(self) -> None:
        for batcher in (self._gate, self._report):
            await batcher.drain()
