"""Invariant 9: the sweeper's position check outlives a failed round. A shard fenced behind an
answered command fires nothing until the check replays it, so a check that stopped for good
after one error Redis gave (out of memory, say) would keep the shard silent until a restart."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import redis.exceptions

from services.sweeper.sweeper import Sweeper
from shared.postgres import positions
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.runtime.config import SweeperSettings
from tests.conftest import SHARDS


async def test_the_position_check_goes_on_after_a_round_redis_refused(
    index: Index, store: Store, redis_prefix: str, database_url: str
) -> None:
    settings = SweeperSettings(
        redis_prefix=redis_prefix,
        shards=SHARDS,
        database_url=database_url,
        position_check_s=0.1,
        sweep_interval_s=3600,
    )
    stopping = asyncio.Event()
    sweeper = Sweeper(settings, index, store, stopping)
    shard = 2
    async with store.transaction() as conn:  # a committed change the index lacks
        committed = (await positions.take(conn, [("ns", "nothing", shard)]))[shard]
    await index.client.set(index.keys.position(shard), "0")
    real_advance = index.advance
    refusals = [redis.exceptions.ResponseError("OOM command not allowed")]

    async def advance_refused_once(found: Any, mode: Any, *args: Any, **kwargs: Any) -> Any:
        if mode == "floor" and refusals:
            raise refusals.pop()
        return await real_advance(found, mode, *args, **kwargs)

    index.advance = advance_refused_once  # type: ignore[method-assign,assignment]
    running = asyncio.create_task(sweeper.run())
    try:
        deadline = time.monotonic() + 10
        while (await index.positions())[shard] < committed:
            assert time.monotonic() < deadline, (
                f"shard {shard} still behind ({(await index.positions())[shard]} < {committed}) "
                f"after the check failed once (refusal used: {not refusals})"
            )
            await asyncio.sleep(0.05)
        assert not refusals, "the refused round never happened"
    finally:
        stopping.set()
        index.advance = real_advance  # type: ignore[method-assign]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 20)
