"""Shard leases: several dispatchers split the shards so each shard has one active claimer.

Every dispatcher announces itself in a registry with a heartbeat, computes its fair share
(shards / live dispatchers, rounded up), renews the leases it holds, gives back any beyond
its share and takes free ones up to it. A dead dispatcher's leases expire and the others
take its shards over. Leases only spread the work: claim.lua is atomic, so even two owners
of one shard (a lease that expired mid-claim) never double a fire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Literal

from prometheus_client import Gauge

from shared.redis.index import Index
from shared.runtime import metrics, transient

log = logging.getLogger(__name__)


def fair_share(shards: int, dispatchers: int) -> int:
    return math.ceil(shards / max(dispatchers, 1))


def search_order(shards: int, dispatcher_id: str) -> list[int]:
    """Shards in the order this dispatcher tries to take them: each starts somewhere else,
    so dispatchers starting together do not all race for shard 0."""
    start = zlib.crc32(dispatcher_id.encode()) % shards
    return [(start + i) % shards for i in range(shards)]


def moves(owned: set[int], order: list[int], share: int) -> tuple[list[int], list[int]]:
    """(shards to give back, shards to try to take) to bring ``owned`` to ``share``."""
    if len(owned) > share:
        extra = sorted(owned, key=order.index)[share:]
        return extra, []
    return [], [s for s in order if s not in owned]


class ShardLeases:
    def __init__(
        self,
        index: Index,
        shards: int,
        ttl_s: float,
        on_change: Callable[[list[int]], None],
        dispatcher_id: str | None = None,
        owner_key: Callable[[int], str] | None = None,
        what: str = "shard",
        gauge: Gauge = metrics.SHARDS_OWNED,
    ) -> None:
        """Leases on ``shards`` things (shards by default; commands partitions with the
        partition's ``owner_key``), named ``what`` in the logs and counted in ``gauge``."""
        self.index = index
        self.owner_key = owner_key
        self.what = what
        self.gauge = gauge
        self.shards = shards
        self.ttl_ms = round(ttl_s * 1000)
        self.on_change = on_change
        self.id = dispatcher_id or uuid.uuid4().hex
        self.owned: set[int] = set()
        self.order = search_order(shards, self.id)

    async def live_dispatchers(self) -> int:
        """Heartbeat in the registry; drop the ones silent for longer than a lease."""
        now = int(time.time() * 1000)
        pipe = self.index.client.pipeline(transaction=False)
        pipe.zadd(self.index.keys.dispatchers, {self.id: now})
        pipe.zremrangebyscore(self.index.keys.dispatchers, "-inf", now - self.ttl_ms)
        pipe.zcard(self.index.keys.dispatchers)
        results = await pipe.execute()
        return int(results[-1])

    async def balance(self) -> list[int]:
        """One round: renew, give back or take, and return the shards held now."""
        share = fair_share(self.shards, await self.live_dispatchers())
        renewed = await self._own(sorted(self.owned), "renew")
        owned = {s for s, mine in renewed.items() if mine}
        give_back, candidates = moves(owned, self.order, share)
        if give_back:
            await self._own(give_back, "release")
            owned -= set(give_back)
        for shard in candidates:
            if len(owned) >= share:
                break
            taken = await self._own([shard], "acquire")
            if taken[shard]:
                owned.add(shard)
        self._update(owned)
        return sorted(owned)

    async def _own(
        self, items: list[int], mode: Literal["acquire", "renew", "release"]
    ) -> dict[int, bool]:
        return await self.index.own(items, self.id, self.ttl_ms, mode, self.owner_key)

    def _update(self, owned: set[int]) -> None:
        if owned != self.owned:
            log.info(
                f"{self.what} leases changed",
                extra={
                    "action": f"{self.what}s_owned",
                    f"{self.what}s": sorted(owned),
                    "dispatcher": self.id,
                },
            )
            self.owned = owned
            self.on_change(sorted(owned))
        self.gauge.set(len(owned))

    async def run(self, stopping: asyncio.Event) -> None:
        """Balance a few times per lease period until stopping, then hand the shards back."""
        await transient.every(
            self.ttl_ms / 1000 / 4, self.balance, what=f"{self.what} leases", stopping=stopping
        )
        await self.release_all()

    async def release_all(self) -> None:
        with contextlib.suppress(*transient.ERRORS):
            await self._own(sorted(self.owned), "release")
            await self.index.client.zrem(self.index.keys.dispatchers, self.id)
        self._update(set())
