"""Shard leases against the real Redis: dispatchers split the shards and take over a dead one's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.dispatcher.leases import ShardLeases
from shared.redis.index import Index
from tests.conftest import SHARDS


async def test_dispatchers_split_the_shards_and_take_over_a_dead_ones(index: Index) -> None:
    index.shards = SHARDS
    held: dict[str, list[int]] = {}

    def recorder(name: str) -> Callable[[list[int]], None]:
        return lambda owned: held.__setitem__(name, owned)

    leases = [
        ShardLeases(index, 12, ttl_s=0.6, dispatcher_id=f"d{i}", on_change=recorder(f"d{i}"))
        for i in range(3)
    ]
    for _ in range(4):  # a few rounds, as their loops would run them
        for lease in leases:
            await lease.balance()
    shares = sorted(len(held[f"d{i}"]) for i in range(3))
    assert shares == [4, 4, 4]
    assert sorted(s for owned in held.values() for s in owned) == list(range(12))

    # d2 dies (stops renewing); after its leases expire the others split its shards.
    await asyncio.sleep(0.7)
    for _ in range(3):
        for lease in leases[:2]:
            await lease.balance()
    assert sorted(len(held[f"d{i}"]) for i in range(2)) == [6, 6]
    assert sorted(held["d0"] + held["d1"]) == list(range(12))

    # A clean stop hands the shards back at once.
    await leases[0].release_all()
    await leases[1].balance()
    assert held["d1"] == list(range(12))
