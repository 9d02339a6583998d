"""Settling attempts in Redis (completions and retries, each kind in one batched submission)
and recording them: counts, audit rows and checkpoints, events (a part of ``Executor``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from services.executor import tally, waves
from services.executor.audit import AuditWriter
from services.executor.autopause import AutoPause
from services.executor.events import Events
from services.executor.settle import Settlement
from shared.contract.delivery import Occurrence
from shared.contract.entries import Completion
from shared.redis.batcher import Batcher
from shared.runtime import metrics, transient


class Settling:
    audit: AuditWriter
    events: Events
    autopause: AutoPause
    stopping: asyncio.Event
    _complete: Batcher[tuple[int, Completion], int]
    _retry: Batcher[tuple[int, tuple[str, int, int]], int]
    #: Occurrences begun (lease held) and not settled yet: handed back if cut off.
    _holding: dict[tuple[int, str], int]

    async def _settle_many(
        self, settled: Sequence[tuple[Occurrence, Settlement]], later: waves.Later | None = None
    ) -> None:
        """Their completions in one submission, their retries in another, both at once: what
        one wrote is recorded (row, checkpoint) even when the other fails (a shutdown in an
        outage), the failure raised after. What follows is waited for, or left in ``later``."""
        if not settled:
            return
        completions = [(occ.shard, s.completion) for occ, s in settled if s.completion is not None]
        retries = [
            (occ.shard, (occ.member, occ.token, s.retry_delay_ms or 0))
            for occ, s in settled
            if s.completion is None
        ]
        try:
            results = await asyncio.gather(
                self._submitted(self._complete, completions, "complete"),
                self._submitted(self._retry, retries, "retry"),
                return_exceptions=True,
            )
            codes = [iter(r) if isinstance(r, list) else None for r in results]
            follow: list[Awaitable[None]] = []
            for occ, settlement in settled:
                found = codes[settlement.completion is None]
                if found is None:
                    continue  # its round trip failed: raised below
                code = next(found)
                if code and settlement.completion is None:
                    metrics.RETRIES.inc()
                self._settled(occ, settlement, code)
                if self.events.wanted(settlement.event):
                    follow.append(self.events.publish(settlement.event, settlement.row))
                if code and occ.plan.pause_after_failures is not None:
                    follow.append(self.autopause.record(occ, settlement.event))
            self.audit.update()
        finally:
            # What Redis acknowledged is in the audit buffer now, or never will be (the round
            # trip failed): a rebuild's barrier no longer waits for these.
            for occ, _ in settled:
                self.audit.barrier.end(id(occ))
            self.audit.barrier_may_answer()
        if follow and later is not None:
            later.append(asyncio.gather(*follow))
        elif follow:
            await asyncio.gather(*follow)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _submitted(
        self, batcher: Batcher[Any, int], items: list[Any], what: str
    ) -> list[int]:
        if not items:
            return []
        return await transient.retry(
            lambda: batcher.submit_many(items), what=what, stopping=self.stopping
        )

    def _settled(self, occ: Occurrence, settlement: Settlement, code: int) -> None:
        """What follows a settlement in Redis: counted, audited and logged (the audit
        buffer's limit is checked by the caller, once for many)."""
        self._holding.pop((occ.shard, occ.member), None)
        if not code:
            # Reclaimed or revoked while we delivered: another message carries it now.
            metrics.STALE.labels("complete").inc()
        if settlement.event == "dead":
            metrics.DEAD.inc()
        tally.count_outcome(occ.namespace, settlement)
        # A fire that Redis no longer knew of (Redis lost its data, a pause, a reset) still
        # counts towards max_fires: PostgreSQL takes its checkpoint unless a later fire or a
        # newer rotation is recorded there, and the rebuild's audit barrier waits for it.
        counted = bool(code) or (settlement.sent and occ.plan.max_fires is not None)
        self.audit.add(settlement.row, settlement.checkpoint if counted else None, update=False)
        if code and occ.is_backfill and settlement.completion is not None:
            self.audit.add_backfill(tally.backfill_progress(occ, settlement.completion, code))
        tally.log_settlement(occ, settlement)
