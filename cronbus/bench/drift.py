"""``cronbus bench drift``: the sweeper's full drift comparison, CPU per schedule.

The comparison runs all the time, a slice per drift check, a full pass every
``CRONBUS_DRIFT_FULL_INTERVAL_S``; its cost is what the sweeper spends when nothing else
happens. Measured in this process (the sweeper's own code, not a service around it), over N
schedules seeded in a corner of their own (``cronbus.bench.harness``): the CPU time of one
full pass, and what that is as a share of a core at the default interval for a given number
of schedules.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from cronbus.bench import harness
from cronbus.bench.harness import Kinds
from services.sweeper.sweeper import Sweeper
from shared.contract import keys
from shared.postgres.store import Store
from shared.redis import connection, index
from shared.runtime.config import CommonSettings, SweeperSettings


async def _drift(args: argparse.Namespace) -> dict[str, Any]:
    async with harness.corner(CommonSettings()) as found:
        lines = harness.herd_lines(
            args.n, int(time.time() * 1000) + 86_400_000, "http://127.0.0.1:9/x"
        )
        imported, _ = await harness.seed(found, lines)
        settings = SweeperSettings(
            redis_url=found.redis_url, redis_prefix=found.prefix, database_url=found.database_url
        )
        client = connection.connect(settings)
        idx = index.Index(client, keys.RedisKeys(found.prefix), settings.shards)
        await idx.load_scripts()
        store = await Store.open(found.database_url, min_size=1, max_size=2)
        try:
            sweeper = Sweeper(settings, idx, store, asyncio.Event())
            return await _passes(args, sweeper, imported, settings)
        finally:
            await store.close()
            await client.aclose()


async def _passes(
    args: argparse.Namespace, sweeper: Sweeper, n: int, settings: SweeperSettings
) -> dict[str, Any]:
    """Slices until ``args.passes`` full passes are done, timed by this process's CPU."""
    slices = repaired = 0
    cpu_started, wall_started = time.process_time(), time.monotonic()
    for _ in range(args.passes):
        # The two sides of a pass (rows, index entries) end near one slice, not always the same.
        rows_ended = entries_ended = False
        while not (rows_ended and entries_ended):
            repaired += await sweeper.drift_slice()
            slices += 1
            rows_at_start, entries_at_start = sweeper.drift_sides_at_start()
            rows_ended |= rows_at_start
            entries_ended |= entries_at_start
    cpu_s = time.process_time() - cpu_started
    wall_s = time.monotonic() - wall_started
    us_per_schedule = cpu_s / (n * args.passes) * 1e6
    share = args.at * us_per_schedule / 1e6 / settings.drift_full_interval_s
    return {
        "n": n,
        "passes": args.passes,
        "slices": slices,
        "repaired": repaired,
        "cpu_s": round(cpu_s, 2),
        "wall_s": round(wall_s, 2),
        "cpu_us_per_schedule": round(us_per_schedule, 2),
        "full_interval_s": settings.drift_full_interval_s,
        "at_schedules": args.at,
        "core_share_pct": round(share * 100, 2),
    }


def run(args: argparse.Namespace) -> int:
    return harness.report(args, _drift(args))


def add_kind(kinds: Kinds) -> argparse.ArgumentParser:
    drift = kinds.add_parser(
        "drift",
        help="the sweeper's full drift comparison over N schedules: CPU per schedule, and its "
        "share of a core at --at schedules with the configured full interval",
    )
    drift.add_argument("--n", type=int, default=100_000)
    drift.add_argument("--passes", type=int, default=2)
    drift.add_argument("--at", type=int, default=1_000_000, help="schedules the share is for")
    drift.set_defaults(handler=run)
    return drift
