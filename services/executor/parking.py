"""Holding deliveries behind a closed gate at next to no cost: park once, release in bulk.

An occurrence the rate gate holds (a Retry-After hold, an open or half-open breaker, a rate
limit or a quota too far ahead) is parked by ``park.lua``: it stays in due at a safety deadline
far ahead, listed in its rate key's parked set, with the key's wake time in the shard's
registry. It holds no lease, no message, no executor slot, and is not claimed again while the
gate stays closed. Every executor looks at the registry a few times a second (``wakes.lua``,
one pipelined call for all shards); for each key whose wake came it reads the key's gate and
releases what the gate can take (``shared.policy.holds.decide``): nothing while a hold or an
open breaker lasts (the wake moves to its end), one probe when the breaker is half-open, a
window's worth of slots of a limited key, or the whole set in chunks once the key is clear.
A breaker closing here looks at its key at once. Two executors releasing the same key are
fenced by the wake they read (``unpark.lua``).

Nothing is lost on a crash: parking is one script (the occurrence is in lease before and in
due after); a release is one script per shard; the safety deadline brings back whatever no
executor released (``CRONBUS_PARK_SAFETY_S``, each occurrence's own a little apart:
``shared.policy.holds.safety_ms_of``, so they do not all come back in one millisecond).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import defaultdict
from collections.abc import Sequence

from services.executor import tally
from shared.contract.delivery import Occurrence
from shared.policy import holds
from shared.redis import holds as parked
from shared.redis.batcher import Batcher
from shared.redis.index import Index
from shared.runtime import metrics, transient

log = logging.getLogger(__name__)

BATCH_ITEMS = 2000
#: How often the registry is looked at.
LOOK_S = 0.25
#: Most rate keys per shard taken from the registry per look.
WAKES_PER_LOOK = 64


class Parking:
    def __init__(
        self,
        index: Index,
        stopping: asyncio.Event,
        breaker_failures: int,
        window_ms: int,
        flush_ms: int,
        safety_ms: int = holds.SAFETY_MS,
    ) -> None:
        self.index = index
        self.stopping = stopping
        self.breaker_failures = breaker_failures
        self.window_ms = window_ms
        self.safety_ms = safety_ms
        self._park = Batcher(
            self._flush_park, max_delay_ms=flush_ms, max_items=BATCH_ITEMS, name="park"
        )
        self._turns = itertools.count()
        self._look_now = asyncio.Event()

    async def _flush_park(self, items: Sequence[tuple[int, parked.ToPark]]) -> list[int]:
        codes = await parked.park(self.index, dict(tally.by_shard(items)), self.safety_ms)
        in_order = tally.in_order(items, codes)
        landed = {
            p.rate_key: p.limit for (_, p), code in zip(items, in_order, strict=True) if code == 1
        }
        if landed:
            await self._look_if_over(landed)
        return in_order

    async def _look_if_over(self, landed: dict[str, str]) -> None:
        """Parks that just landed registered a wake for the hold they were held by; a breaker
        that closed (or a hold that ended) while they were in the batcher already released
        its key and will not look again. Read the gates now that the parks are in: a key
        whose hold is over is nudged, so nothing waits for a wake of a hold that is gone.
        (A close after this read finds the parks in place and nudges them itself.)"""
        names = list(landed)
        try:
            now, found = await parked.gates_at(self.index, names)
            over = [
                name
                for name, gate in zip(names, found, strict=True)
                if holds.hold_over(
                    gate,
                    holds.parse_limit(landed[name]),
                    now,
                    self.breaker_failures,
                    self.window_ms,
                )
            ]
            if over:
                await parked.nudge(self.index, over)
        except transient.ERRORS as exc:
            # The parks are in: at worst they wait for their wake (the safety deadline after).
            log.warning(
                "parked deliveries not looked at again",
                extra={
                    "action": "dependency_wait",
                    "operation": "park",
                    "error": transient.said(exc),
                },
            )
            return
        if over:
            self._look_now.set()

    async def park(self, occ: Occurrence, rate_key: str, wake_ms: int, limit: str) -> int:
        """Park a held occurrence behind ``rate_key`` until ``wake_ms`` (1 parked, 0 stale,
        2 due now: its schedule was written since it was claimed, perhaps to a new target)."""
        item = (
            occ.shard,
            parked.ToPark(occ.member, occ.token, rate_key, wake_ms, limit, occ.plan.version),
        )
        code: int = await transient.retry(
            lambda: self._park.submit(item), what="park", stopping=self.stopping
        )
        if code == parked.DUE_NOW:
            # Dispatchers sleep until the earliest due time they know of: tell them.
            with contextlib.suppress(*transient.ERRORS):
                await self.index.client.publish(self.index.keys.wake_channel, "0")
        return code

    async def nudge(self, rate_key: str) -> None:
        """The key's breaker closed (or its probe gave its slot back): release what waits
        behind it now, not at its wake."""
        with contextlib.suppress(*transient.ERRORS):
            await parked.nudge(self.index, [rate_key])
        self._look_now.set()

    async def look(self, now_ms: int | None = None) -> int:
        """One look at the registry: release what the gates of the woken keys let through.
        Returns how many occurrences were released. (``now_ms``: the Redis clock; tests only.)"""
        now, woken = await parked.wakes(self.index, WAKES_PER_LOOK, now_ms)
        if not woken:
            return 0
        by_key: dict[str, list[parked.Wake]] = defaultdict(list)
        for wake in woken:
            by_key[wake.rate_key].append(wake)
        names = list(by_key)
        gates = await parked.gates(self.index, names)
        items: dict[int, list[parked.ToRelease]] = defaultdict(list)
        for name, gate in zip(names, gates, strict=True):
            found = by_key[name]
            limit = holds.parse_limit(found[0].limit)
            release = holds.decide(gate, limit, now, self.breaker_failures, self.window_ms)
            shares = holds.shares(release, gate, [w.shard for w in found], next(self._turns))
            for wake in found:
                items[wake.shard].append(
                    parked.ToRelease(
                        name,
                        wake.wake_ms,
                        shares[wake.shard],
                        release.next_wake_ms,
                        probe=release.probe,
                    )
                )
        results = await parked.unpark(self.index, dict(items), holds.SPREAD_MS, now_ms)
        released = sum(max(n, 0) for pairs in results.values() for n, _ in pairs)
        if released:
            metrics.RATE_RELEASED.inc(released)
            # Dispatchers sleep until the earliest due time they know of: tell them.
            with contextlib.suppress(*transient.ERRORS):
                await self.index.client.publish(self.index.keys.wake_channel, str(now))
        return released

    async def run(self, stopping: asyncio.Event) -> None:
        """Look at the registry every LOOK_S (at once after a nudge) until stopped."""
        while not stopping.is_set():
            try:
                await self.look()
            except transient.ERRORS as exc:
                log.warning(
                    "parked deliveries not looked at",
                    extra={
                        "action": "dependency_wait",
                        "operation": "unpark",
                        "error": transient.said(exc),
                    },
                )
            self._look_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._look_now.wait(), LOOK_S)

    async def drain(self) -> None:
        await self._park.drain()
