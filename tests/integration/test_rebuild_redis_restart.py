"""A rebuild across which Redis restarted from a snapshot: on a private Redis, since the test
restarts it (the machine's shared Redis is left alone)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.sweeper.sweeper import Sweeper
from shared.contract import keys
from shared.postgres.store import Store
from shared.redis import connection
from shared.redis.index import Index
from shared.runtime.config import SweeperSettings
from tests.conftest import SHARDS
from tests.integration.test_sweeper import every, load, members
from tests.support.private import PrivateRedis
from tests.support.services import quiet_ports


@pytest.fixture
async def private_redis() -> AsyncIterator[PrivateRedis]:
    with tempfile.TemporaryDirectory(prefix="cronbus-restart-") as directory:
        # Outside the ephemeral range: the server restarts on this port, which a client
        # socket of another test worker must not take meanwhile.
        server = PrivateRedis(quiet_ports(1), Path(directory))
        await asyncio.to_thread(server.start)
        try:
            yield server
        finally:
            await asyncio.to_thread(server.stop)


async def test_a_rebuild_across_a_redis_restart_from_a_snapshot_is_followed_by_another(
    private_redis: PrivateRedis, store: Store, database_url: str
) -> None:
    """Redis saved a snapshot while the rebuild ran (its witness already in it), then crashed
    and came back from that snapshot: the pages written after the snapshot are gone, and the
    client's own retries hide the restart from the rebuild."""
    settings = SweeperSettings(
        redis_url=private_redis.url,
        redis_prefix="restart",
        shards=SHARDS,
        database_url=database_url,
        rebuild_batch=1,
    )
    client = connection.connect(settings)
    index = Index(client, keys.RedisKeys("restart"), SHARDS)
    await index.load_scripts()
    try:
        await load(
            store,
            index,
            every("first", 60, priority=9),
            every("second", 60, priority=5),
            every("third", 60),
        )
        await client.flushall()  # Redis lost everything: the epoch is missing
        rebuilder = Sweeper(settings, index, store, asyncio.Event())
        real = rebuilder._write_entries
        saved, restarted = asyncio.Event(), asyncio.Event()
        pages = 0

        async def snapshot_then_crash(rows: Any, now: int) -> int:
            nonlocal pages
            pages += 1
            page = pages
            # Two pages are in flight at once: each waits here for its place in the story.
            if page == 2:
                await saved.wait()  # written after the snapshot
            elif page > 2:
                await restarted.wait()  # written to the restarted server
            written = await real(rows, now)
            if page == 1:
                await client.save()  # a snapshot: the witness and the first page
                saved.set()
            elif page == 2:
                # The server dies before the next snapshot and starts again from this one.
                await asyncio.to_thread(private_redis.stop)
                await asyncio.to_thread(private_redis.start)
                restarted.set()
            return written

        rebuilder._write_entries = snapshot_then_crash  # type: ignore[method-assign]
        await rebuilder.check_epoch()
        assert rebuilder.rebuilding is not None
        await rebuilder.rebuilding
        assert pages == 3 and restarted.is_set()
        rebuilder._write_entries = real  # type: ignore[method-assign]
        # The next check must not take the index for complete: "second" went with the crash.
        await rebuilder.check_epoch()
        if rebuilder.rebuilding is not None:
            await rebuilder.rebuilding
        assert await members(index) == {"sw/first", "sw/second", "sw/third"}
        assert await client.get(index.keys.epoch) is not None
    finally:
        await client.aclose()
