"""Delivery slots shared fairly between namespaces.

The executor holds many occurrences at once (its prefetched messages) and delivers a bounded
number concurrently. A plain semaphore serves waiters in arrival order, so a herd in one
namespace that arrived first would make every other namespace wait until it drained. Here a
freed slot goes to the namespaces with waiters in turn (round robin), and within a namespace in
arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator


class FairSlots:
    def __init__(self, capacity: int) -> None:
        self.free = capacity
        #: Namespaces with waiters, in the order they get the next freed slots.
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @contextlib.asynccontextmanager
    async def slot(self, namespace: str) -> AsyncIterator[None]:
        await self.acquire(namespace)
        try:
            yield
        finally:
            self.release()

    def take_now(self, count: int) -> int:
        """Take up to ``count`` of the free slots at once when nobody waits (each is given
        back with ``release``); how many were taken."""
        if self._waiting:
            return 0
        taken = min(count, self.free)
        self.free -= taken
        return taken

    def claim(self, namespace: str) -> asyncio.Future[None]:
        """A slot for ``namespace``, as a future: done at once when one is free, or when one
        is handed over. A granted slot is given back with ``release``; a claim no longer
        needed is dropped with ``withdraw``."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.free > 0 and not self._waiting:
            self.free -= 1
            future.set_result(None)
        else:
            self._waiting.setdefault(namespace, deque()).append(future)
        return future

    def withdraw(self, namespace: str, future: asyncio.Future[None]) -> None:
        if future.done() and not future.cancelled():
            self.release()  # granted and not used: passed on
        else:
            future.cancel()
            self._forget(namespace, future)

    async def acquire(self, namespace: str) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(namespace, deque()).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # the slot was handed over as we were cancelled: pass it on
            else:
                self._forget(namespace, future)
            raise

    def release(self) -> None:
        while self._waiting:
            namespace, waiters = next(iter(self._waiting.items()))
            future = waiters.popleft()
            # This namespace goes to the back of the turn; gone when it has no more waiters.
            del self._waiting[namespace]
            if waiters:
                self._waiting[namespace] = waiters
            if not future.done():
                future.set_result(None)
                return
        self.free += 1

    def _forget(self, namespace: str, future: asyncio.Future[None]) -> None:
        waiters = self._waiting.get(namespace)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(future)
        if not waiters:
            del self._waiting[namespace]
