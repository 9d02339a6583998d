"""Coalescing many small requests into one batched round trip.

Callers ``submit`` one item and await its own result; a background flush sends everything
submitted in the last few milliseconds (or as soon as ``max_items`` are waiting) in one call.
This is how per-occurrence work (begin, complete, retry) becomes one script call per shard.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

Flush = Callable[[Sequence[Item]], Awaitable[Sequence[Result]]]


class _Group(Generic[Result]):
    """The results of several items submitted together, awaited as one future."""

    __slots__ = ("future", "left", "results")

    def __init__(self, future: asyncio.Future[list[Result]], size: int) -> None:
        self.future = future
        self.results: list[Result | None] = [None] * size
        self.left = size

    def set(self, index: int, result: Result) -> None:
        self.results[index] = result
        self.left -= 1
        if not self.left and not self.future.done():
            self.future.set_result(self.results)  # type: ignore[arg-type]

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class Batcher(Generic[Item, Result]):
    def __init__(
        self, flush: Flush[Item, Result], *, max_delay_ms: float, max_items: int, name: str
    ) -> None:
        self._flush = flush
        self._max_delay_s = max_delay_ms / 1000
        self._max_items = max_items
        self._name = name
        self._items: list[Item] = []
        #: Per item, its own future, or the group it was submitted with and its place there.
        self._futures: list[asyncio.Future[Result] | tuple[_Group[Result], int]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task[None]] = set()

    async def submit(self, item: Item) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._items.append(item)
        self._futures.append(future)
        if len(self._items) >= self._max_items:
            self._start_flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(
                self._max_delay_s, self._start_flush
            )
        return await future

    async def submit_many(self, items: Sequence[Item]) -> list[Result]:
        """Several items, one waiter: they join the same flush (or flushes, past
        ``max_items``) as what others submit meanwhile, at the cost of one future.

        Items that fit in one flush are kept in one (what others submitted is flushed first
        when they would not fit beside it): the group fails or succeeds as a whole, and a
        flush that failed must not throw away the results of one that went through (a
        completion done twice reads as stale the second time, its checkpoint lost)."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        if len(self._items) + len(items) > self._max_items >= len(items):
            self._start_flush()
        group: _Group[Result] = _Group(loop.create_future(), len(items))
        for index, item in enumerate(items):
            self._items.append(item)
            self._futures.append((group, index))
            if len(self._items) >= self._max_items:
                self._start_flush()
        if self._items and self._timer is None:
            self._timer = loop.call_later(self._max_delay_s, self._start_flush)
        return await group.future

    def _start_flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._items:
            return
        items, futures = self._items, self._futures
        self._items, self._futures = [], []
        task = asyncio.create_task(self._run(items, futures), name=f"{self._name}-flush")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(
        self,
        items: list[Item],
        futures: list[asyncio.Future[Result] | tuple[_Group[Result], int]],
    ) -> None:
        try:
            results = await self._flush(items)
        except Exception as exc:  # noqa: BLE001 - every waiter gets the failure
            for future in futures:
                if isinstance(future, tuple):
                    future[0].fail(exc)
                elif not future.done():
                    future.set_exception(exc)
            return
        for future, result in zip(futures, results, strict=True):
            if isinstance(future, tuple):
                future[0].set(future[1], result)
            elif not future.done():
                future.set_result(result)

    async def drain(self) -> None:
        """Flush what is waiting and wait for every flush in progress."""
        self._start_flush()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._running, return_exceptions=True)


class GroupCommit(Generic[Item, Result]):
    """Items submitted while a commit is under way share the next one.

    Unlike ``Batcher`` nothing waits for a timer: under light load an item is committed at once,
    alone; under heavy load each commit takes everything that came meanwhile (up to
    ``max_items``), so commits grow exactly as much as the load needs. ``workers`` commits run
    at once, so one is being prepared while another waits for its round trips.
    """

    def __init__(
        self, flush: Flush[Item, Result], *, max_items: int, workers: int, name: str
    ) -> None:
        self._flush = flush
        self._max_items = max_items
        self._workers = workers
        self._name = name
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._running: set[asyncio.Task[None]] = set()

    async def submit(self, item: Item) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if len(self._running) < self._workers:
            task = asyncio.create_task(self._work(), name=f"{self._name}-{len(self._running)}")
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        return await future

    async def _work(self) -> None:
        await asyncio.sleep(0)  # the items that arrived in this same turn join the first commit
        while self._pending:
            taken = self._pending[: self._max_items]
            del self._pending[: self._max_items]
            try:
                results = await self._flush([item for item, _ in taken])
            except Exception as exc:  # noqa: BLE001 - every waiter gets the failure
                for _, future in taken:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(taken, results, strict=True):
                if not future.done():
                    future.set_result(result)
