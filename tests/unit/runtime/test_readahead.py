"""read_ahead: the same items in the same order, errors where they belong, nothing left running."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.runtime.readahead import read_ahead


class Source:
    """An async stream of ``items`` that may fail after some, and tells what it was asked."""

    def __init__(self, items: list[int], fail_after: int | None = None) -> None:
        self.items = items
        self.fail_after = fail_after
        self.fetched = 0
        self.closed = False

    async def stream(self) -> AsyncIterator[int]:
        try:
            for n, item in enumerate(self.items):
                if n == self.fail_after:
                    raise RuntimeError(f"failed at {n}")
                await asyncio.sleep(0)
                self.fetched += 1
                yield item
        finally:
            self.closed = True


@given(st.lists(st.integers(), max_size=50), st.integers(min_value=1, max_value=4))
def test_every_item_comes_once_in_order(items: list[int], depth: int) -> None:
    async def read() -> list[int]:
        return [item async for item in read_ahead(Source(items).stream(), depth)]

    assert asyncio.run(read()) == items


async def test_the_next_item_is_fetched_while_the_caller_works() -> None:
    source = Source(list(range(10)))
    stream = read_ahead(source.stream(), depth=1)
    assert await anext(stream) == 0
    for _ in range(5):
        await asyncio.sleep(0)
    # The caller holds item 0; item 1 is fetched and waits in the queue, item 2 is being put.
    assert source.fetched >= 2
    await stream.aclose()


async def test_an_error_of_the_source_is_raised_after_the_items_before_it() -> None:
    got: list[int] = []
    with pytest.raises(RuntimeError, match="failed at 3"):
        async for item in read_ahead(Source(list(range(10)), fail_after=3).stream(), 2):
            got.append(item)
    assert got == [0, 1, 2]


async def test_a_caller_that_stops_early_stops_the_fetching() -> None:
    source = Source(list(range(1000)))
    async for item in read_ahead(source.stream(), depth=2):
        if item == 5:
            break
    await asyncio.sleep(0.01)
    assert source.closed
    assert source.fetched <= 5 + 1 + 2 + 1
    assert not [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "").endswith("fetch")
    ]


async def test_a_caller_cancelled_while_the_fetching_stops_stays_cancelled() -> None:
    stopping = asyncio.Event()

    async def slow_to_stop() -> AsyncIterator[int]:
        yield 0
        try:
            await asyncio.sleep(3600)  # a page that takes long to come
        except asyncio.CancelledError:
            stopping.set()
            await asyncio.sleep(0.05)  # its connection takes a moment to hand back
            raise
        yield 1

    async def consume() -> str:
        async with contextlib.aclosing(read_ahead(slow_to_stop())) as items:
            async for _ in items:
                break
        return "went on"

    task = asyncio.create_task(consume())
    await asyncio.wait_for(stopping.wait(), 5)
    task.cancel()  # the service shuts down while the caller waits for the fetching to stop
    done, _ = await asyncio.wait([task], timeout=5)
    assert done and task.cancelled(), "the caller's cancellation was swallowed"
