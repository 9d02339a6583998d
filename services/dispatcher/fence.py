"""The positions a dispatcher fences its claims with (invariant 9).

A shard's ``answered`` position is the highest one a reply said ok for. A shard of the index
whose own position is below it lacks a command already answered (Redis failed over to a
lagging replica, or came back from an older snapshot): claim.lua takes nothing from it until
the sweeper has replayed what it lacks. This dispatcher's own intake raises the positions as it
answers; those of the other dispatchers' intakes are read from PostgreSQL every
``position_check_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import asyncpg

from shared.postgres import positions
from shared.runtime import transient

log = logging.getLogger(__name__)


class Fence:
    """Per shard, the highest position answered ok that this dispatcher knows of."""

    def __init__(self) -> None:
        self.answered: dict[int, int] = {}
        #: Set once PostgreSQL has been read: claims wait for it (after a restart, the index
        #: may be the one that went back).
        self.known = asyncio.Event()

    def raise_to(self, answered: Mapping[int, int]) -> None:
        """Positions only go up: a read older than the intake's own answer changes nothing."""
        for shard, position in answered.items():
            if position > self.answered.get(shard, 0):
                self.answered[shard] = position

    async def follow(self, pool: asyncpg.Pool, every_s: float, stopping: asyncio.Event) -> None:
        """Read every shard's answered position from PostgreSQL, again and again."""

        async def read() -> None:
            found = await positions.read(pool)
            self.raise_to({shard: p.answered for shard, p in found.items()})
            self.known.set()

        await transient.every(every_s, read, what="answered positions", stopping=stopping)
