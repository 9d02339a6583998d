"""Parked deliveries in Redis: park.lua, wakes.lua and unpark.lua, batched per shard and
pipelined over shards, and the gates of the rate keys they wait on (one pipeline)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.policy.holds import Gate, safety_ms_of
from shared.redis.index import Index

#: park.lua's code for an occurrence not parked but due now: its schedule was written since
#: its claim.
DUE_NOW = 2


@dataclass(frozen=True, slots=True)
class ToPark:
    member: str
    token: int
    rate_key: str
    wake_ms: int
    #: ``interval_ms|burst`` (``shared.policy.holds.format_limit``).
    limit: str
    #: The version of the schedule the executor holds (None: not checked): one written since
    #: is not parked but due now (park.lua).
    version: int | None = None


@dataclass(frozen=True, slots=True)
class Wake:
    """A rate key of a shard whose parked occurrences are due to be looked at."""

    shard: int
    rate_key: str
    wake_ms: int
    limit: str


@dataclass(frozen=True, slots=True)
class ToRelease:
    rate_key: str
    seen_wake_ms: int
    count: int
    next_wake_ms: int
    #: The one released is the half-open breaker's probe: unpark.lua takes it from a schedule
    #: that has not been the key's probe for longest.
    probe: bool = False


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def park(
    index: Index, items: dict[int, list[ToPark]], safety_ms: int, now_ms: int | None = None
) -> dict[int, list[int]]:
    """Per shard, 1 parked, 0 stale or 2 due now (its schedule was written since its claim)
    for each item. Each comes due by itself about ``safety_ms`` past its wake, spread by its
    member (``safety_ms_of``)."""
    calls = []
    for shard, batch in items.items():
        keys = [
            index.keys.due(shard),
            index.keys.lease(shard),
            index.keys.occ(shard),
            index.keys.parked(shard),
            index.keys.parked_rates(shard),
            index.keys.parked_marks(shard),
            index.keys.sched(shard),
            *[index.keys.parked_on(shard, p.rate_key) for p in batch],
        ]
        args: list[Any] = ["" if now_ms is None else now_ms]
        for p in batch:
            safety = safety_ms_of(p.member, safety_ms)
            version = "" if p.version is None else p.version
            args += [p.member, p.token, p.rate_key, p.wake_ms, p.limit, safety, version]
        calls.append(("park", keys, args))
    replies = await index.run(calls)
    return {s: [int(c) for c in r] for s, r in zip(items, replies, strict=True)}


async def wakes(index: Index, limit: int, now_ms: int | None = None) -> tuple[int, list[Wake]]:
    """The Redis clock, and the rate keys whose wake has come in any shard."""
    calls = [
        (
            "wakes",
            [index.keys.parked(s), index.keys.parked_rates(s)],
            [limit, "" if now_ms is None else now_ms],
        )
        for s in range(index.shards)
    ]
    replies = await index.run(calls)
    now = max(int(r[0]) for r in replies)
    found = [
        Wake(shard, _text(r[i]), int(float(r[i + 1])), _text(r[i + 2]))
        for shard, r in enumerate(replies)
        for i in range(1, len(r), 3)
    ]
    return now, found


async def gates(index: Index, rate_keys: Sequence[str]) -> list[Gate]:
    """The gate of each rate key (breaker, Retry-After hold, GCRA slot), one round trip."""
    return (await gates_at(index, rate_keys))[1]


async def gates_at(index: Index, rate_keys: Sequence[str]) -> tuple[int, list[Gate]]:
    """The Redis clock (ms) and the gate of each rate key, read together in one round trip."""
    pipe = index.client.pipeline(transaction=False)
    pipe.time()
    for rate_key in rate_keys:
        tat, hold, breaker = index.keys.rate(rate_key)
        pipe.hmget(breaker, ["fails", "open_until", "probe_until", "probes"])
        pipe.get(hold)
        pipe.get(tat)
    clock, *replies = await pipe.execute()
    now = int(clock[0]) * 1000 + int(clock[1]) // 1000
    found = []
    for i in range(0, len(replies), 3):
        (fails, open_until, probe_until, probes), held, tat = replies[i : i + 3]
        found.append(
            Gate(
                int(fails or 0),
                int(float(open_until or 0)),
                int(float(probe_until or 0)),
                int(float(held or 0)),
                float(tat or 0),
                int(probes or 0),
            )
        )
    return now, found


async def unpark(
    index: Index,
    items: dict[int, list[ToRelease]],
    spread_ms: int,
    now_ms: int | None = None,
) -> dict[int, list[tuple[int, int]]]:
    """Per shard, (released or -1 fenced off, still parked) for each rate key."""
    calls = []
    for shard, batch in items.items():
        keys = [
            index.keys.due(shard),
            index.keys.occ(shard),
            index.keys.parked(shard),
            index.keys.parked_rates(shard),
            index.keys.parked_marks(shard),
        ]
        args: list[Any] = ["" if now_ms is None else now_ms, spread_ms]
        for r in batch:
            keys += [index.keys.parked_on(shard, r.rate_key), index.keys.probed(shard, r.rate_key)]
            args += [r.rate_key, r.seen_wake_ms, r.count, r.next_wake_ms, int(r.probe)]
        calls.append(("unpark", keys, args))
    replies = await index.run(calls)
    return {
        s: [(int(r[i]), int(r[i + 1])) for i in range(0, len(r), 2)]
        for s, r in zip(items, replies, strict=True)
    }


async def nudge(index: Index, rate_keys: Sequence[str]) -> None:
    """Look at rate keys' parked occurrences at once (a breaker closed, or a park landed after
    it did), in every shard that parks some: each wake is lowered to a value never read before
    (nudge.lua), which fences off a look that read the gate before; never added where it is
    not parked."""
    if rate_keys:
        await index.run(
            [("nudge", [index.keys.parked(s)], list(rate_keys)) for s in range(index.shards)]
        )


async def parked_count(index: Index, shard: int, rate_key: str) -> int:
    return int(await index.client.zcard(index.keys.parked_on(shard, rate_key)))
