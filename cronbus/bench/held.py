"""``cronbus bench held``: N occurrences held behind a dead target, and what holding them costs.

N interval schedules are all first due at one instant on a webhook target that fails every
time: the bench's sink answering 404 (``--target 404``), or a loopback port nobody listens on
(``--target refused``). The target's circuit breaker opens after the first failures, and from
then on the occurrences wait behind it. For ``--duration`` seconds from the due instant, the
figures are: the CPU of each executor as a percentage of one core (from ``/proc/<pid>/stat``,
utime + stime) over the whole run and over its second half (the first half includes the first
wave of claims), the dispatcher's and the sweeper's, the Redis server's (``INFO cpu`` delta:
the whole server, so anything else using it is counted too), the holds counted by the
executors (``cronbus_rate_held_total``), the deliveries that reached the target, and the load
average of the machine at the start, middle and end (a shared machine skews every figure).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time
from typing import Any

import redis.asyncio as aioredis

from cronbus.bench import cpu, harness
from cronbus.bench.harness import AnySink, Corner, Kinds, Run
from cronbus.cli.sink import Sink
from shared.contract import codec, timefmt


def held_lines(n: int, first_ms: int, url: str) -> Any:
    start = timefmt.format_ms(first_ms)
    for i in range(n):
        yield codec.dumps(
            {
                "id": f"held{i:08d}",
                "spec": {"kind": "interval", "every_s": 3600, "start_at": start},
                "target": {"kind": "webhook", "url": url},
            }
        )


def _refused_url() -> str:
    """A loopback URL whose port nobody listens on (bound then closed: refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/dead"


async def _redis_cpu_s(url: str) -> float:
    client = aioredis.Redis.from_url(url)
    try:
        info = await client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    finally:
        await client.aclose()


async def _holds(run: Run) -> float:
    total = 0.0
    for process in run.processes:
        if process.name != "executor":
            continue
        _, text = await asyncio.to_thread(process.get, "/metrics")
        for line in text.splitlines():
            if line.startswith("cronbus_rate_held_total{"):
                total += float(line.split()[-1])
    return total


def _sample(run: Run) -> dict[str, dict[int, float]]:
    return {name: cpu.times_of(run.pids(name)) for name in ("executor", "dispatcher", "sweeper")}


def _percent(before: dict[int, float], after: dict[int, float], seconds: float) -> list[float]:
    """Per pid (in pid order), CPU as % of one core between two samples."""
    return [
        round(max(0.0, after[pid] - before.get(pid, 0.0)) * 100 / seconds, 1)
        for pid in sorted(after)
    ]


def held_figures(
    samples: list[tuple[float, dict[str, dict[int, float]], float, float]],
) -> dict[str, Any]:
    """From three samples (start, middle, end) of (monotonic s, CPU by pid, Redis CPU s,
    holds): the CPU of each service over the run and its second half, Redis's, the holds."""
    (t0, s0, r0, h0), (t1, s1, r1, _), (t2, s2, r2, h2) = samples
    whole, half = t2 - t0, t2 - t1
    figures: dict[str, Any] = {}
    for name in ("executor", "dispatcher", "sweeper"):
        figures[f"{name}_cpu_pct"] = _percent(s0[name], s2[name], whole)
        figures[f"{name}_cpu_pct_second_half"] = _percent(s1[name], s2[name], half)
    figures["redis_cpu_pct"] = round((r2 - r0) * 100 / whole, 1)
    figures["redis_cpu_pct_second_half"] = round((r2 - r1) * 100 / half, 1)
    figures["holds"] = int(h2 - h0)
    figures["holds_per_s"] = round((h2 - h0) / whole, 1)
    return figures


async def _measured(
    args: argparse.Namespace, found: Corner, run: Run, sink: AnySink
) -> dict[str, Any]:
    n = args.n
    url = _refused_url() if args.target == "refused" else f"{sink.url}/held"
    lead_s = args.lead_s if args.lead_s is not None else 5 + n / 8_000
    due_ms = (int((time.time() + lead_s) * 1000) // 1000 + 1) * 1000
    _, import_s = await harness.seed(found, held_lines(n, due_ms, url))
    overlap = harness.check_import(args, int(time.time() * 1000), due_ms)
    await asyncio.sleep(max(due_ms / 1000 - time.time(), 0))
    samples = []
    loads = []
    for wait_s in (0.0, args.duration / 2, args.duration / 2):
        await asyncio.sleep(wait_s)
        sample = _sample(run)
        redis_s = await _redis_cpu_s(found.redis_url)
        holds = await _holds(run)
        samples.append((time.monotonic(), sample, redis_s, holds))
        loads.append([round(v, 2) for v in os.getloadavg()])
    received = len(sink.received) if isinstance(sink, Sink) else None
    return {
        "n": n,
        "duration_s": args.duration,
        "target": args.target,
        "executors": len(run.pids("executor")),
        **held_figures(samples),
        "deliveries_reaching_target": received,
        "load_avg_start_mid_end": loads,
        "import_s": round(import_s, 2),
        **overlap,
    }


def run(args: argparse.Namespace) -> int:
    if args.n < 1 or args.duration <= 0:
        raise SystemExit("cronbus bench held: --n must be >= 1 and --duration > 0")
    sink = Sink(respond=lambda _: 404, keep=True)
    return harness.report(args, harness.with_services(args, _measured, own_sink=sink))


def add_kind(kinds: Kinds) -> argparse.ArgumentParser:
    held = kinds.add_parser("held", help="N occurrences held behind a target that always fails")
    held.add_argument("--n", type=int, default=100_000)
    held.add_argument(
        "--duration", type=float, default=180, help="seconds measured from the due instant"
    )
    held.add_argument(
        "--target",
        choices=("404", "refused"),
        default="404",
        help="the target answers 404, or refuses the connection (nothing listens)",
    )
    held.add_argument(
        "--allow-overlap",
        action="store_true",
        help="report a run whose import ran into the measured window, flagged",
    )
    held.set_defaults(handler=run)
    return held
