"""The positions a dispatcher fences its claims with (invariant 9).

A shard's ``answered`` position is the highest one a reply said ok for. A shard of the index
whose own position is below it lacks a command already answered (Redis failed over to a
lagging replica, or came back from an older snapshot): claim.lua takes nothing from it until
the sweeper has replayed what it lacks. This dispatcher's own intake raises the positions as it
answers; those of the other dispatchers' intakes arrive by a notification sent at the commit
that marks them answered (milliseconds: a dispatcher holding a shard learns of a command
another one answered before any failover could undo it), and are read again from PostgreSQL
every ``position_check_s`` (a notification lost while the listening connection was down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

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

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: object) -> None:
        self.raise_to(positions.parse_answered(str(payload)))

    async def follow(self, pool: asyncpg.Pool, every_s: float, stopping: asyncio.Event) -> None:
        """Listen for answered positions, and read every shard's from PostgreSQL again and
        again (listening again first whenever the connection was lost)."""
        listener: Any = None

        async def read() -> None:
            nonlocal listener
            if listener is None or _lost(listener):
                if listener is not None:
                    await _release(pool, listener, self._notified)
                listener = None
                taken = await pool.acquire()
                try:
                    await taken.add_listener(positions.ANSWERED_CHANNEL, self._notified)
                except BaseException:
                    await _release(pool, taken, self._notified)
                    raise
                listener = taken
            # Listening before reading: an answer between the two is in one or the other.
            found = await positions.read(pool)
            self.raise_to({shard: p.answered for shard, p in found.items()})
            self.known.set()

        try:
            await transient.every(every_s, read, what="answered positions", stopping=stopping)
        finally:
            if listener is not None:
                await _release(pool, listener, self._notified)


def _lost(conn: Any) -> bool:
    """Whether the listening connection is gone (the pool takes back one that broke)."""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True


async def _release(pool: asyncpg.Pool, conn: Any, notified: Any) -> None:
    """Give the listening connection back, listening no more (a broken one is closed by
    the pool)."""
    with contextlib.suppress(*transient.ERRORS):
        await conn.remove_listener(positions.ANSWERED_CHANNEL, notified)
    with contextlib.suppress(*transient.ERRORS):
        await pool.release(conn, timeout=1)
