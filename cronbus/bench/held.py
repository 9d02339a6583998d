"""``cronbus bench held``: N occurrences held behind a dead target, and what holding them costs.

N interval schedules are all first due at one instant on a webhook target that fails every
time: the bench's sink answering 503 (``--target 503``), or a loopback port nobody listens on
(``--target refused``). The target's circuit breaker opens after the first failures, and from
then on the occurrences wait behind it. For ``--duration`` seconds from the due instant, the
figures are: the CPU of each executor as a percentage of one core (from ``/proc/<pid>/stat``,
utime + stime) over the whole run and over its second half (the first half includes the first
wave of claims), the dispatcher's and the sweeper's, the Redis server's (``INFO cpu`` delta:
the whole server, so anything else using it is counted too), the holds counted by the
executors (``cronbus_rate_held_total``), the deliveries that reached the target, and the load
average of the machine at the start, middle and end (a shared machine skews every figure).

The holds are also read every second: the most in any one second over the run and over its
second half (``holds_peak_per_s``). Parked occurrences come back by themselves at their safety
deadline (``CRONBUS_PARK_SAFETY_S``, which the services take from the environment: shorten it
to see one within the run), and are held again then: the peak shows whether they came back
spread out or all at once. At the middle of the run the bench also reads the parked
occurrences' deadlines from Redis, and reports the most due in any one second
(``parked_due_peak_per_s``) and how many seconds they span.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import time
from typing import Any

import redis.asyncio as aioredis

from cronbus.bench import cpu, harness
from cronbus.bench.harness import AnySink, Corner, Kinds, Run
from cronbus.cli.sink import Sink
from shared.contract import codec, keys, timefmt


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


def peak_per_s(series: list[tuple[float, float]]) -> float:
    """The largest increase per second between consecutive samples of a counter (monotonic
    s, value); 0 with fewer than two samples."""
    rates = [(v1 - v0) / (t1 - t0) for (t0, v0), (t1, v1) in itertools.pairwise(series) if t1 > t0]
    return round(max(rates, default=0.0), 1)


def deadline_spread(deadlines_ms: list[float]) -> dict[str, Any]:
    """The most parked deadlines falling in any one second, and the seconds they span."""
    if not deadlines_ms:
        return {"parked": 0, "parked_due_peak_per_s": 0, "parked_due_span_s": 0.0}
    per_second: dict[int, int] = {}
    for ms in deadlines_ms:
        second = int(ms // 1000)
        per_second[second] = per_second.get(second, 0) + 1
    return {
        "parked": len(deadlines_ms),
        "parked_due_peak_per_s": max(per_second.values()),
        "parked_due_span_s": round((max(deadlines_ms) - min(deadlines_ms)) / 1000, 1),
    }


async def _parked_deadlines(found: Corner) -> list[float]:
    """The deadlines in due of every occurrence parked now, over every shard."""
    settings = found.redis_settings()
    names = keys.RedisKeys(found.prefix)
    client = found.redis_node()
    deadlines: list[float] = []
    try:
        for shard in range(settings.shards):
            for rate_key in await client.zrange(names.parked(shard), 0, -1):
                name = rate_key.decode() if isinstance(rate_key, bytes) else str(rate_key)
                pairs: list[Any] = await client.zrange(
                    names.parked_on(shard, name), 0, -1, withscores=True
                )
                deadlines += [float(pair[1]) for pair in pairs]
    finally:
        await client.aclose()
    return deadlines


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
    series: list[tuple[float, float]] = []
    spread: dict[str, Any] = {}
    start = time.monotonic()
    for at_s in (0.0, args.duration / 2, args.duration):
        # Every second until the next CPU sample: the holds, for their peak per second.
        while time.monotonic() - start < at_s - 1:
            series.append((time.monotonic(), await _holds(run)))
            await asyncio.sleep(max(0.0, 1 - (time.monotonic() - series[-1][0])))
        await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
        sample = _sample(run)
        redis_s = await _redis_cpu_s(found.redis_url)
        holds = await _holds(run)
        samples.append((time.monotonic(), sample, redis_s, holds))
        series.append((samples[-1][0], holds))
        loads.append([round(v, 2) for v in os.getloadavg()])
        if at_s == args.duration / 2:
            spread = deadline_spread(await _parked_deadlines(found))
    middle = samples[1][0]
    received = len(sink.received) if isinstance(sink, Sink) else None
    return {
        "n": n,
        "duration_s": args.duration,
        "target": args.target,
        "executors": len(run.pids("executor")),
        **held_figures(samples),
        "holds_peak_per_s": peak_per_s(series),
        "holds_peak_per_s_second_half": peak_per_s([p for p in series if p[0] >= middle]),
        **spread,
        "park_safety_s": os.environ.get("CRONBUS_PARK_SAFETY_S", "900"),
        "deliveries_reaching_target": received,
        "load_avg_start_mid_end": loads,
        "import_s": round(import_s, 2),
        **overlap,
    }


def run(args: argparse.Namespace) -> int:
    if args.n < 1 or args.duration <= 0:
        raise SystemExit("cronbus bench held: --n must be >= 1 and --duration > 0")
    sink = Sink(respond=lambda _: 503, keep=True)
    return harness.report(args, harness.with_services(args, _measured, own_sink=sink))


def add_kind(kinds: Kinds) -> argparse.ArgumentParser:
    held = kinds.add_parser("held", help="N occurrences held behind a target that always fails")
    held.add_argument("--n", type=int, default=100_000)
    held.add_argument(
        "--duration", type=float, default=180, help="seconds measured from the due instant"
    )
    held.add_argument(
        "--target",
        choices=("503", "refused"),
        default="503",
        # A 4xx says nothing about the host's health and no longer opens the breaker (issue 26).
        help="the target answers 503, or refuses the connection (nothing listens)",
    )
    held.add_argument(
        "--allow-overlap",
        action="store_true",
        help="report a run whose import ran into the measured window, flagged",
    )
    held.set_defaults(handler=run)
    return held
