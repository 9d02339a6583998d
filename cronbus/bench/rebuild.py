"""``cronbus bench rebuild``: how long the sweeper takes to rebuild a lost Redis index.

In a corner of its own (``cronbus.bench.harness``), a first sweeper builds the empty index and
stops; N schedules are then seeded (due a day later: none fires). With the services running
and ``--firing`` schedules firing every second, every Redis key of the corner is removed, and
the sweeper's own measure of its rebuild (``cronbus_rebuild_duration_seconds``) is read from
its metrics. Figures: import and rebuild time and rate, schedules restored, Redis bytes per
schedule, and how the firing schedules (rebuilt first) fared while the rest streamed in:
their fires due in the rebuild's window, lost ones, and lateness (p50, p99, max).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cronbus.bench import harness
from cronbus.bench.harness import Corner, Kinds, Run
from cronbus.cli.common import CliError
from cronbus.cli.procs import ServiceProcess
from cronbus.cli.sink import Received, Sink
from shared.contract import codec, keys, timefmt
from shared.runtime.config import CommonSettings

#: Fires of the firing schedules are measured from this long after the rebuild started (its
#: first page, which holds them, is written by then) to its end.
REBUILD_FIRING_MARGIN_MS = 1000


async def _forget_index(found: Corner) -> None:
    """What Redis losing its data looks like to cronbus: every key of the corner gone."""
    client = found.redis_node()
    try:
        doomed = [key async for key in client.scan_iter(match=f"{found.prefix}:*", count=5000)]
        for start in range(0, len(doomed), 5000):
            # UNLINK frees in the background: a DEL of a shard's keys at 10M schedules blocks
            # Redis for longer than a client's read timeout.
            await client.unlink(*doomed[start : start + 5000])
    finally:
        await client.aclose()


async def _rebuild(args: argparse.Namespace) -> dict[str, Any]:
    sink = Sink()
    await sink.start()
    try:
        async with harness.corner(CommonSettings()) as found:
            return await _rebuild_in(args, found, sink)
    finally:
        await sink.stop()


def firing_lines(k: int, first_ms: int, url: str) -> Iterator[bytes]:
    """``k`` schedules firing every second, at a higher priority than the herd: a rebuild
    restores them first, and they fire while the rest streams in."""
    start = timefmt.format_ms(first_ms)
    for i in range(k):
        yield codec.dumps(
            {
                "id": f"f{i:06d}",
                "spec": {"kind": "interval", "every_s": 1, "start_at": start},
                "target": {"kind": "webhook", "url": url},
                "priority": 1,
            }
        )


async def _rebuild_in(args: argparse.Namespace, found: Corner, sink: Sink) -> dict[str, Any]:
    env = {
        **harness.service_env(args),
        "CRONBUS_SWEEP_INTERVAL_S": "0.2",
        "CRONBUS_REBUILD_BATCH": str(args.rebuild_batch),
    }
    with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
        # As on a fresh install: a sweeper finds no index, builds the empty one, and stops
        # (so that neither it nor a rebuild of what is imported next competes with the import).
        first = Run(found, Path(logs))
        try:
            first.start("sweeper", 1, env)
            await _wait_for_rebuild(first.processes[0], args.timeout_s)
        finally:
            first.stop()
    before = await harness.redis_used_memory(found)
    lines = harness.herd_lines(args.n, int(time.time() * 1000) + 86_400_000, "http://127.0.0.1:9/x")
    imported, import_s = await harness.seed(found, lines)
    bytes_per = (await harness.redis_used_memory(found) - before) / max(imported, 1)
    with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
        run = Run(found, Path(logs))
        try:
            if args.firing:
                run.start("dispatcher", args.dispatchers, env)
                run.start("executor", args.executors, env)
            run.start("sweeper", 1, env)
            await run.ready()
            if args.firing:
                # Firing before Redis loses its data, as in production.
                first_ms = (int(time.time()) + 3) * 1000
                await harness.seed(found, firing_lines(args.firing, first_ms, f"{sink.url}/f"))
                await asyncio.sleep(max(first_ms / 1000 - time.time(), 0) + 2)
            lost_at_ms = int(time.time() * 1000)
            await _forget_index(found)
            sweeper = next(p for p in run.processes if p.name == "sweeper")
            rebuild_s = await _wait_for_rebuild(sweeper, args.timeout_s)
            ended_ms = int(time.time() * 1000)
            # The rebuild ended at most one poll (500 ms) before it was seen done, so it
            # started no later than this: the window starts the margin after that.
            started_ms = max(ended_ms - round(rebuild_s * 1000), lost_at_ms)
            window = (started_ms + REBUILD_FIRING_MARGIN_MS, ended_ms - 500)
            if args.firing:
                # Fires of the window still on their way are late, not lost: wait for them.
                expected = _firing_expected(args.firing, window)
                await harness.wait_window(sink, found, *window, expected, args.timeout_s)
            await asyncio.sleep(args.settle_s)
        finally:
            run.stop()
    figures: dict[str, Any] = {
        "n": args.n,
        "imported": imported,
        "import_s": round(import_s, 2),
        "import_per_s": round(imported / import_s, 1) if import_s else None,
        "rebuild_s": rebuild_s,
        "rebuild_per_s": round((args.n + args.firing) / rebuild_s, 1),
        "restored": await _count_index(found),
        "redis_bytes_per_schedule": round(bytes_per, 1),
    }
    if args.firing:
        figures |= firing_figures(args.firing, window, list(sink.received))
    return figures


def _firing_expected(k: int, window: tuple[int, int]) -> int:
    """Fires of ``k`` every-second schedules due in ``window`` (whole seconds inside it)."""
    start_ms, end_ms = window
    return k * max(0, math.ceil(end_ms / 1000) - math.ceil(start_ms / 1000))


def firing_figures(k: int, window: tuple[int, int], received: list[Received]) -> dict[str, Any]:
    """How the firing schedules fared while the rebuild ran: their fires due in ``window``."""
    start_ms, end_ms = window
    inside = [
        r
        for r in received
        if r.schedule.rsplit("/", 1)[-1].startswith("f")
        and start_ms <= timefmt.parse_rfc3339_ms(r.fire_time) < end_ms
    ]
    late = [r.at_ms - timefmt.parse_rfc3339_ms(r.fire_time) for r in inside if r.attempt == 1]
    expected = _firing_expected(k, window)
    return {
        "firing": k,
        "firing_window_s": round(max(end_ms - start_ms, 0) / 1000, 1),
        "firing_expected": expected,
        "firing_lost": expected - len({(r.schedule, r.fire_time) for r in inside}),
        "firing_p50_ms": round(harness.percentile(late, 0.50), 1),
        "firing_p99_ms": round(harness.percentile(late, 0.99), 1),
        "firing_max_ms": round(max(late, default=math.nan), 1),
    }


async def _wait_for_rebuild(sweeper: ServiceProcess, timeout_s: float) -> float:
    """The sweeper's own measure of the rebuild (cronbus_rebuild_duration_seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sweeper.alive():
            raise CliError(
                f"the sweeper exited with status {sweeper.popen.returncode} before its rebuild "
                f"ended; no figures. Its log ends:\n{sweeper.tail(20)}"
            )
        _, text = await asyncio.to_thread(sweeper.get, "/metrics")
        for line in text.splitlines():
            if line.startswith("cronbus_rebuilds_total ") and float(line.split()[1]) >= 1:
                duration = [
                    row
                    for row in text.splitlines()
                    if row.startswith("cronbus_rebuild_duration_seconds ")
                ]
                return round(float(duration[0].split()[1]), 2)
        await asyncio.sleep(0.5)
    raise CliError(f"no rebuild finished within {timeout_s:g}s:\n{sweeper.tail()}")


async def _count_index(found: Corner) -> int:
    client = found.redis_node()
    try:
        counts = [
            await client.hlen(keys.RedisKeys(found.prefix).sched(shard))
            for shard in range(CommonSettings().shards)
        ]
        return sum(counts)
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    return harness.report(args, _rebuild(args))


def add_kind(kinds: Kinds) -> argparse.ArgumentParser:
    rebuild = kinds.add_parser(
        "rebuild", help="import N schedules, lose the Redis index, time the sweeper's rebuild"
    )
    rebuild.add_argument("--n", type=int, default=100_000)
    rebuild.add_argument("--timeout-s", type=float, default=600)
    rebuild.add_argument(
        "--firing",
        type=int,
        default=1000,
        help="schedules firing every second while the rebuild runs (rebuilt first), "
        "whose lateness is measured; 0: the sweeper alone",
    )
    rebuild.add_argument(
        "--rebuild-batch", type=int, default=2000, help="CRONBUS_REBUILD_BATCH for the sweeper"
    )
    rebuild.set_defaults(handler=run)
    return rebuild
