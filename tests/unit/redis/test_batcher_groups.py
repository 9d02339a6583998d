"""Items submitted together share one waiter and the flushes of others (no I/O)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from shared.redis.batcher import Batcher


async def test_submit_many_joins_others_flush_and_keeps_its_order() -> None:
    flushed: list[list[int]] = []

    async def flush(items: Sequence[int]) -> list[int]:
        flushed.append(list(items))
        return [item * 10 for item in items]

    batcher: Batcher[int, int] = Batcher(flush, max_delay_ms=1, max_items=3, name="t")
    one = asyncio.ensure_future(batcher.submit(1))
    many = asyncio.ensure_future(batcher.submit_many([2, 3, 4, 5]))
    assert await asyncio.wait_for(one, 1) == 10
    assert await asyncio.wait_for(many, 1) == [20, 30, 40, 50]
    assert flushed == [[1, 2, 3], [4, 5]]
    assert await batcher.submit_many([]) == []


async def test_submit_many_fails_as_its_flush_fails() -> None:
    async def flush(items: Sequence[int]) -> list[int]:
        raise ConnectionError("away")

    batcher: Batcher[int, int] = Batcher(flush, max_delay_ms=1, max_items=10, name="t")
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(batcher.submit_many([1, 2]), 1)


async def test_a_group_that_fits_one_flush_is_not_split_by_others_items() -> None:
    """Split over two flushes, a group whose second flush failed is submitted again whole:
    what the first flush did (completions) would then read as stale, its results lost."""
    flushed: list[list[int]] = []

    async def flush(items: Sequence[int]) -> list[int]:
        flushed.append(list(items))
        if 4 in items:
            raise ConnectionError("away")
        return [item * 10 for item in items]

    batcher: Batcher[int, int] = Batcher(flush, max_delay_ms=1, max_items=3, name="t")
    others = [asyncio.ensure_future(batcher.submit(item)) for item in (1, 2)]
    await asyncio.sleep(0)
    many = asyncio.ensure_future(batcher.submit_many([3, 4]))
    assert await asyncio.wait_for(asyncio.gather(*others), 1) == [10, 20]
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(many, 1)
    assert flushed == [[1, 2], [3, 4]]
