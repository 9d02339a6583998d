"""``cronbus bench fairness``: how late a few schedules are while another namespace's herd drains.

The services run in a corner of their own (``cronbus.bench.harness``) with the in-process sink.
A herd of N schedules in namespace ``tenant-a`` and a few in ``tenant-b`` are seeded, all due
at the same whole second. Figures, from the first attempts the sink received: the herd's drain
time, the lateness of ``tenant-b``'s few (p50, p99, max), whether they were all done before the
herd was, and lost occurrences.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from typing import Any

from cronbus.bench import harness
from cronbus.bench.harness import AnySink, Corner, Kinds, Run
from cronbus.cli.common import CliError
from cronbus.cli.sink import Received, Sink

FAIR_HERD_NAMESPACE = "tenant-a"
FAIR_SMALL_NAMESPACE = "tenant-b"


def fairness_figures(n: int, small: int, due_ms: int, received: list[Received]) -> dict[str, Any]:
    """B's lateness while A's herd drains: every first attempt, split by namespace."""
    herd = [r for r in received if r.attempt == 1 and r.schedule.startswith("tenant-a/")]
    few = [r for r in received if r.attempt == 1 and r.schedule.startswith("tenant-b/")]
    late_b = [r.at_ms - due_ms for r in few]
    herd_last = max((r.at_ms for r in herd), default=due_ms)
    return {
        "herd_n": n,
        "small_n": small,
        "herd_drain_s": round((herd_last - due_ms) / 1000, 3),
        "small_p50_ms": round(harness.percentile(late_b, 0.50), 1),
        "small_p99_ms": round(harness.percentile(late_b, 0.99), 1),
        "small_max_ms": round(max(late_b, default=math.nan), 1),
        "small_done_before_herd": bool(few) and max(r.at_ms for r in few) < herd_last,
        "lost": n + small - len({(r.schedule, r.fire_time) for r in received}),
    }


async def _measured(
    args: argparse.Namespace, found: Corner, run: Run, sink: AnySink
) -> dict[str, Any]:
    if not isinstance(sink, Sink):
        raise CliError("bench fairness reads its figures from the in-process sink only")
    n, small = args.n, args.small
    lead_s = args.lead_s if args.lead_s is not None else 5 + n / 4000
    due_ms = (int((time.time() + lead_s) * 1000) // 1000 + 1) * 1000
    await harness.seed(found, harness.herd_lines(n, due_ms, f"{sink.url}/a"), FAIR_HERD_NAMESPACE)
    await harness.seed(
        found, harness.herd_lines(small, due_ms, f"{sink.url}/b"), FAIR_SMALL_NAMESPACE
    )
    if time.time() * 1000 >= due_ms:
        raise CliError("the import took past the due instant: raise --lead-s")
    await asyncio.sleep(max(due_ms / 1000 - time.time(), 0))
    await sink.wait_for(lambda s: len(s.received) >= n + small, timeout_s=args.timeout_s)
    await asyncio.sleep(args.settle_s)
    harness.require_arrivals(len(sink.received), "delivery", run, args.timeout_s)
    return fairness_figures(n, small, due_ms, list(sink.received))


def run(args: argparse.Namespace) -> int:
    return harness.report(args, harness.with_services(args, _measured))


def add_kind(kinds: Kinds) -> argparse.ArgumentParser:
    fairness = kinds.add_parser(
        "fairness",
        help="a herd of N due at once in one namespace and a few in another: "
        "how late the few are while the herd drains",
    )
    fairness.add_argument("--n", type=int, default=100_000, help="the herd (namespace tenant-a)")
    fairness.add_argument("--small", type=int, default=100, help="the few (namespace tenant-b)")
    fairness.add_argument("--timeout-s", type=float, default=300)
    fairness.set_defaults(handler=run)
    return fairness
