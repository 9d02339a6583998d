"""Every misfire policy keeps its promise on the real services: with jitter above the grace,
under an overload the executors cannot keep up with, and with targets slower than a lease."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Any

import pytest

from cronbus.cli.sink import Sink
from shared.contract import timefmt
from tests.support.commands import CommandClient
from tests.support.stack import Stack


def interval(schedule_id: str, url: str, every_s: int, **extra: Any) -> dict[str, Any]:
    return {
        "schedule": {
            "id": schedule_id,
            "spec": {"kind": "interval", "every_s": every_s},
            "target": {"kind": "webhook", "url": url, "timeout_s": 5},
            **extra,
        }
    }


async def test_jitter_above_the_grace_is_not_taken_for_lateness(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await stack.start_all(("dispatcher", "executor", "sweeper"))
    for i in range(3):
        reply = await client.send(
            "jit",
            "upsert",
            interval(f"j{i}", f"{sink.url}/j{i}", 4, jitter_s=3, misfire={"policy": "skip"}),
        )
        assert reply["ok"], reply
    started_ms = time.time() * 1000
    await asyncio.sleep(21)
    per_schedule = collections.Counter(r.path for r in sink.received)
    # About 5 fires each in 21 s (one every 4 s); before, 1-3 in 30 s were seen.
    assert all(per_schedule[f"/j{i}"] >= 4 for i in range(3)), per_schedule
    for request in sink.received:
        nominal = timefmt.parse_rfc3339_ms(request.fire_time)
        assert nominal % 4000 == 0  # the fire time stays the nominal time
        assert nominal >= started_ms - 4000
        assert request.at_ms >= nominal  # jitter only ever delays


@pytest.mark.parametrize("policy", ["skip", "fire_once", "fire_all"])
async def test_under_overload_every_policy_still_fires(
    policy: str, stack: Stack, stack_env: dict[str, str], sink: Sink, client: CommandClient
) -> None:
    # Two deliveries at a time, each taking 0.5 s: 4 per second for 12 due every second.
    stack_env["CRONBUS_CONCURRENCY"] = "2"
    sink.delay_s = 0.5
    await stack.start_all(("dispatcher", "executor", "sweeper"))
    misfire: dict[str, Any] = {"policy": policy}
    if policy == "fire_all":
        misfire.update(window_s=60, limit=3)
    for i in range(12):
        reply = await client.send(
            "load", "upsert", interval(f"o{i}", f"{sink.url}/o{i}", 1, misfire=misfire)
        )
        assert reply["ok"], reply
    await asyncio.sleep(25)
    per_schedule = collections.Counter(r.path for r in sink.received)
    # The executors stayed busy with what the policy wanted, and no schedule starved: each
    # fired again and again although every one of its occurrences came due late.
    assert len(sink.received) >= 60, len(sink.received)
    assert all(per_schedule[f"/o{i}"] >= 3 for i in range(12)), per_schedule
    keys = collections.Counter(r.key for r in sink.received)
    assert max(keys.values()) == 1


async def test_a_target_slower_than_the_lease_is_delivered_once_without_overlap(
    stack: Stack, stack_env: dict[str, str], sink: Sink, client: CommandClient
) -> None:
    # One delivery at a time, 1.5 s each, leases of 2 s, reclaims every half second: the
    # later occurrences wait in the executor far longer than a lease.
    stack_env.update(
        {"CRONBUS_CONCURRENCY": "1", "CRONBUS_LEASE_S": "2", "CRONBUS_SWEEP_INTERVAL_S": "0.5"}
    )
    sink.delay_s = 1.5
    await stack.start_all(("dispatcher", "executor", "sweeper"))
    at = timefmt.format_ms((int(time.time()) + 3) * 1000)
    for i in range(8):
        reply = await client.send(
            "slow",
            "upsert",
            {
                "schedule": {
                    "id": f"w{i}",
                    "spec": {"kind": "once", "at": at},
                    "target": {"kind": "webhook", "url": f"{sink.url}/w{i}", "timeout_s": 5},
                }
            },
        )
        assert reply["ok"], reply
    assert await sink.wait_for(lambda s: len({r.path for r in s.received}) == 8, 40), stack.tails()
    await asyncio.sleep(4)
    assert sorted(r.path for r in sink.received) == sorted(f"/w{i}" for i in range(8))
    # One at a time, as the concurrency says: no two deliveries overlapped.
    arrivals = sorted(r.at_ms for r in sink.received)
    assert all(b - a >= 1400 for a, b in itertools.pairwise(arrivals))
