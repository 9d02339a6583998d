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
