"""The intake's writes to the Redis index, made after PostgreSQL has committed.

PostgreSQL is the record and the index follows it: once a command has committed, only its index
write is retried while Redis is away, and a write that cannot be made is left to the sweeper's
drift repair. Raising instead would make the caller apply the command a second time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from shared.contract import keys
from shared.redis.index import Index
from shared.rules import compact, rotation
from shared.rules.plan import Plan
from shared.runtime import transient

# The package's logger: the intake's log lines keep one logger name whatever module writes them.
log = logging.getLogger("services.dispatcher.intake")

#: The claim loop's wake-up: a shard has an occurrence due at a time (ms).
Wake = Callable[[int, int], Awaitable[None]]


class IndexWrites:
    """Index writes that outlive an outage of Redis, and the wake-up of the claim loop after."""

    def __init__(self, index: Index, wake: Wake, stopping: asyncio.Event) -> None:
        self.index = index
        self.wake = wake
        self.stopping = stopping

    async def place(
        self, namespace: str, schedule_id: str, plan: Plan, placement: rotation.Placement
    ) -> bool:
        """Write the placement to Redis (after PostgreSQL committed it); whether it was made."""
        shard = self.index.shard_of(namespace, schedule_id)
        upsert = rotation.index_write(namespace, schedule_id, plan, compact.encode(plan), placement)
        if upsert is None:
            member = keys.member(namespace, schedule_id)
            return await self.write(lambda: self.index.remove({shard: [(member, plan.version)]}))
        made = await self.write(lambda: self.index.upsert({shard: [upsert]}))
        if upsert.next_fire_ms is not None:
            await self.wake(shard, upsert.next_fire_ms)
        return made

    async def write(self, write: Callable[[], Awaitable[object]]) -> bool:
        """PostgreSQL has committed: only the index write is repeated while Redis is away.
        If the service stops first, the sweeper's drift repair finishes the job. Returns
        whether the write was made."""
        try:
            await transient.retry(write, what="index write", stopping=self.stopping)
        except transient.Stopped:
            log.warning("index write left to drift repair", extra={"action": "index_deferred"})
            return False
        except Exception:  # committed: raising would make callers apply it again
            log.exception(
                "index write refused; left to drift repair", extra={"action": "index_deferred"}
            )
            return False
        return True
