"""``cronbus bench steady``: N schedules firing R times a second in total, measured in a window.

The services run in a corner of their own (``cronbus.bench.harness``); N interval schedules,
their first fires spread evenly over one interval, are seeded so that together they fire
``--rate`` times a second. After ``--warmup-s``, a window of ``--duration`` seconds is measured:
the CPU of every component is sampled by PID at its ends, and every occurrence due inside it is
waited for (bounded by ``--timeout-s``) before any is counted lost. Figures: fires, expected
fires, lost and duplicated ones, lateness of first attempts (p50, p99, max), CPU milliseconds
per fire, and Redis bytes per schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Iterator
from typing import Any

from cronbus.bench import harness
from cronbus.bench.harness import AnySink, Corner, Kinds, Run
from cronbus.cli.common import CliError
from cronbus.cli.sink import Sink
from shared.contract import codec, timefmt


def steady_lines(n: int, every_ms: int, first_ms: int, url: str) -> Iterator[bytes]:
    for i in range(n):
        start = timefmt.format_ms(first_ms + i * every_ms // n)
        yield codec.dumps(
            {
                "id": f"s{i:08d}",
                "spec": {"kind": "interval", "every_s": every_ms / 1000, "start_at": start},
                "target": {"kind": "webhook", "url": url},
            }
        )


async def _steady(args: argparse.Namespace) -> dict[str, Any]:
    if args.schedules * 1000 / args.rate < 1000:
        raise CliError("--schedules / --rate must be at least 1 second per schedule")
    return await harness.with_services(args, _measured)


async def _measured(
    args: argparse.Namespace, found: Corner, run: Run, sink: AnySink
) -> dict[str, Any]:
    n = args.schedules
    every_ms = round(n * 1000 / args.rate)
    before = await harness.redis_used_memory(found)
    lead_s = args.lead_s if args.lead_s is not None else 5 + n / 8_000
    first_ms = (int((time.time() + lead_s) * 1000) // 1000 + 1) * 1000
    imported, import_s = await harness.seed(
        found, steady_lines(n, every_ms, first_ms, f"{sink.url}/steady")
    )
    bytes_per = (await harness.redis_used_memory(found) - before) / max(imported, 1)
    start_ms = first_ms + args.warmup_s * 1000
    end_ms = start_ms + args.duration_s * 1000
    overlap = harness.check_import(args, int(time.time() * 1000), start_ms)
    meter = harness.meter_of(run, sink)
    await asyncio.sleep(max(start_ms / 1000 - time.time(), 0))
    cpu_before = meter.sample()
    await asyncio.sleep(max(end_ms / 1000 - time.time(), 0))
    cpu_after = meter.sample()
    expected = _expected_fires(n, every_ms, first_ms, start_ms, end_ms)
    # Fires of the window still on their way are late, not lost: wait for them (bounded).
    drained_s = await harness.wait_window(sink, found, start_ms, end_ms, expected, args.timeout_s)
    await asyncio.sleep(args.settle_s)
    window = await harness.arrived_in(sink, found, start_ms, end_ms)
    # A flagged run (--allow-overlap) may have lost its window to the import: it says so itself.
    if expected and "flagged" not in overlap:
        harness.require_arrivals(len(window), "fire of the measured window", run, args.timeout_s)
    late = [r.at_ms - timefmt.parse_rfc3339_ms(r.fire_time) for r in window if r.attempt == 1]
    occurrences = {(r.schedule, r.fire_time) for r in window}
    return {
        "schedules": n,
        "rate_per_s": args.rate,
        "duration_s": args.duration_s,
        "fires": len(window),
        "expected_fires": expected,
        "lost": expected - len(occurrences),
        "duplicates": len(window) - len(occurrences) if isinstance(sink, Sink) else None,
        "window_drained_after_s": drained_s,
        "lateness_p50_ms": round(harness.percentile(late, 0.50), 1),
        "lateness_p99_ms": round(harness.percentile(late, 0.99), 1),
        "lateness_max_ms": round(max(late, default=math.nan), 1),
        **harness.cpu_figures(cpu_before, cpu_after, len(window)),
        "redis_bytes_per_schedule": round(bytes_per, 1),
        "import_s": round(import_s, 2),
        **overlap,
        "sink": harness.sink_kind(sink),
    }


def _expected_fires(n: int, every_ms: int, first_ms: int, start_ms: int, end_ms: int) -> int:
    count = 0
    for i in range(n):
        anchor = first_ms + i * every_ms // n
        low = max(0, math.ceil((start_ms - anchor) / every_ms))
        high = math.ceil((end_ms - anchor) / every_ms)
        count += max(0, high - low)
    return count


def run(args: argparse.Namespace) -> int:
    return harness.report(args, _steady(args))


def add_kind(kinds: Kinds) -> argparse.ArgumentParser:
    steady = kinds.add_parser("steady", help="N schedules firing R times a second in total")
    steady.add_argument("--schedules", type=int, default=1000)
    steady.add_argument("--rate", type=float, default=1000, help="fires per second in total")
    steady.add_argument(
        "--duration", dest="duration_s", type=int, default=30, help="seconds measured"
    )
    steady.add_argument("--warmup-s", type=int, default=5)
    steady.add_argument(
        "--timeout-s",
        type=float,
        default=120,
        help="seconds after the window to wait for its late fires before counting them lost",
    )
    steady.set_defaults(handler=run)
    return steady
