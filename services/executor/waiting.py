"""Occurrences waiting for a delivery slot: their leases held as a message arrives and kept
alive while they wait, so a long wait never lets the sweeper hand them out again (a part of
``Executor``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.executor import tally
from shared.contract.delivery import Occurrence
from shared.redis.index import Index
from shared.runtime import metrics, transient

#: Most items of one batched Redis call.
BATCH_ITEMS = 2000


class WaitingLeases:
    index: Index
    stopping: asyncio.Event
    lease_ms: int
    #: Occurrences received and waiting for a delivery slot: (shard, member) -> token.
    _waiting: dict[tuple[int, str], int]

    async def _hold_leases(self, items: Sequence[tuple[int, tuple[str, int, int]]]) -> list[bool]:
        """Per item waiting for a slot, whether its lease is held (False: it is stale)."""
        _, codes = await self.index.begin(tally.by_shard(items), delivering=False)
        return [bool(code) for code in tally.in_order(items, codes)]

    def _stop_waiting(self, occurrences: Sequence[Occurrence]) -> None:
        """A message given up (handed back, or parked as a bug): its leases are no longer
        kept alive here, so the sweeper or a redelivery takes its occurrences over."""
        for occ in occurrences:
            if self._waiting.get((occ.shard, occ.member)) == occ.token:
                del self._waiting[(occ.shard, occ.member)]

    async def hold(self, occurrences: Sequence[Occurrence]) -> list[Occurrence]:
        """Fence a message's occurrences as it arrives, in one round trip: those whose token
        is current have their lease held while they wait for a delivery slot; the others are
        stale (another copy took care of them) and are dropped."""
        items = [(occ.shard, (occ.member, occ.token, self.lease_ms)) for occ in occurrences]
        results = await transient.retry(
            lambda: self._hold_leases(items), what="hold", stopping=self.stopping
        )
        live = []
        for occ, held in zip(occurrences, results, strict=True):
            if not held:
                metrics.STALE.labels("begin").inc()
            else:
                self._waiting[(occ.shard, occ.member)] = occ.token
                live.append(occ)
        return live

    async def keep_waiting_leases(self) -> None:
        """Extend the leases of occurrences still waiting for a slot (one round trip for
        all); those found stale meanwhile are left to whichever copy is current."""
        waiting = list(self._waiting.items())
        for start in range(0, len(waiting), BATCH_ITEMS):
            chunk = waiting[start : start + BATCH_ITEMS]
            items = [(shard, (member, token, self.lease_ms)) for (shard, member), token in chunk]
            results = await self._hold_leases(items)
            for ((shard, member), token), held in zip(chunk, results, strict=True):
                if not held and self._waiting.get((shard, member)) == token:
                    del self._waiting[(shard, member)]

    async def run_lease_keeper(self, stopping: asyncio.Event) -> None:
        await transient.every(
            max(self.lease_ms / 3000, 0.1),
            self.keep_waiting_leases,
            what="lease keeper",
            stopping=stopping,
        )
