"""Commands on one schedule run in the order they arrived, however many run at once.

Commands are handled concurrently (up to the queue's prefetch): without a line per schedule, a
command that arrived last could be applied first and then be overwritten by an earlier one. A
command on several schedules (an upsert_many) takes its place on each at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

Member = tuple[str, str]


class ArrivalOrder:
    """Per schedule, the last command in its line (done when that command is)."""

    def __init__(self) -> None:
        self._tails: dict[Member, asyncio.Future[None]] = {}

    @contextlib.asynccontextmanager
    async def turn(self, namespace: str, schedule_ids: list[str]) -> AsyncIterator[None]:
        """Wait for every earlier command on any of these schedules, then run.

        The command's place in the line of each schedule is taken at once, before any wait: a
        command waiting for one of its schedules already holds its place on the others, so a
        later command on those cannot overtake it (commands on one schedule run in arrival
        order). It waits only for earlier commands: no deadlock.
        """
        members = [(namespace, schedule_id) for schedule_id in set(schedule_ids)]
        earlier = {self._tails[m] for m in members if m in self._tails}
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for member in members:
            self._tails[member] = mine
        try:
            if earlier:
                await asyncio.wait(earlier)  # never cancels them
            yield
        finally:
            self._release(mine, members, earlier)

    def _release(
        self,
        mine: asyncio.Future[None],
        members: list[Member],
        earlier: set[asyncio.Future[None]],
    ) -> None:
        """Let the next commands go; a command cancelled while waiting lets them go only once
        the commands before it are done."""

        def done(_: object = None) -> None:
            if not mine.done():
                mine.set_result(None)
            for member in members:
                if self._tails.get(member) is mine:
                    del self._tails[member]

        waiting = [future for future in earlier if not future.done()]
        if waiting:
            asyncio.gather(*waiting).add_done_callback(done)
        else:
            done()
