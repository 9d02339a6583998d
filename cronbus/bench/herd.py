"""``cronbus bench herd``: N schedules all due at one instant, and how the services drain them.

The services run in a corner of their own (``cronbus.bench.harness``); N interval schedules,
all first due at the same whole second, are seeded far enough ahead for the import to end
before it. From that instant until the N-th delivery, the CPU of every component is sampled by
PID. Figures: the drain time and throughput, lateness of first attempts (p50, p99, max), lost
and duplicated occurrences, Redis bytes per schedule, and CPU milliseconds per fire.
``--features`` adds a rate limit and a quota the herd never reaches and signs every webhook,
so that their whole cost is paid and nothing waits.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path
from typing import Any

from cronbus.bench import harness
from cronbus.bench.harness import AnySink, Corner, ExternalSink, Kinds, Run
from cronbus.cli.common import CliError
from cronbus.cli.sink import Received, Sink
from shared.contract import codec

#: ``--features``: a rate limit no herd reaches, so its whole cost is paid and nothing waits.
UNREACHED_RATE_LIMIT = {"per_s": 100_000, "burst": 100_000}
#: ``--features``: a fire rate quota no herd reaches.
UNREACHED_QUOTA = {"max_fires_per_s": 1_000_000}
#: ``--features``: a Standard Webhooks signing secret (a fixed one: the bench signs, nobody checks).
BENCH_SIGNING_SECRET = "whsec_" + "Y3JvbmJ1cy1iZW5jaC1zaWduaW5nLWtleS0wMQ=="


def feature_env(directory: Path) -> dict[str, str]:
    """Signing secrets and a quota for the bench's namespace, in files of ``directory``."""
    secrets = directory / "signing-secrets.json"
    secrets.write_bytes(codec.dumps({harness.NAMESPACE: [BENCH_SIGNING_SECRET]}))
    quotas = directory / "quotas.json"
    quotas.write_bytes(codec.dumps({harness.NAMESPACE: UNREACHED_QUOTA}))
    return {"CRONBUS_SIGNING_SECRETS_FILE": str(secrets), "CRONBUS_QUOTAS_FILE": str(quotas)}


def herd_figures(
    n: int,
    due_ms: int,
    received: list[Received],
    bytes_per: float,
    import_s: float,
    cpu: dict[str, Any],
) -> dict[str, Any]:
    first = [r for r in received if r.attempt == 1]
    occurrences = {(r.schedule, r.fire_time) for r in received}
    late = [r.at_ms - due_ms for r in first]
    last = max((r.at_ms for r in received), default=due_ms)
    drain_s = (last - due_ms) / 1000
    return {
        "n": n,
        "drain_s": round(drain_s, 3),
        "throughput_per_s": round(n / drain_s, 1) if drain_s > 0 else None,
        "lateness_p50_ms": round(harness.percentile(late, 0.50), 1),
        "lateness_p99_ms": round(harness.percentile(late, 0.99), 1),
        "lateness_max_ms": round(max(late, default=math.nan), 1),
        "lost": n - len(occurrences),
        "duplicates": len(received) - len(occurrences),
        "redis_bytes_per_schedule": round(bytes_per, 1),
        "import_s": round(import_s, 2),
        **cpu,
    }


async def _rows_written(run: Run) -> float:
    total = 0.0
    for process in run.processes:
        if process.name != "executor":
            continue
        _, text = await asyncio.to_thread(process.get, "/metrics")
        for line in text.splitlines():
            if line.startswith("cronbus_audit_rows_written_total "):
                total += float(line.split()[1])
    return total


async def _wait_delivered(sink: AnySink, run: Run, n: int, timeout_s: float) -> None:
    """Until ``n`` deliveries arrived (in-process sink) or ``n`` rows were written (external)."""
    if isinstance(sink, Sink):
        await sink.wait_for(lambda s: len(s.received) >= n, timeout_s=timeout_s)
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await _rows_written(run) >= n:
            return
        await asyncio.sleep(0.5)  # polling another process's metrics: no event to wait on


async def _measured(
    args: argparse.Namespace, found: Corner, run: Run, sink: AnySink
) -> dict[str, Any]:
    n = args.n
    before = await harness.redis_used_memory(found)
    lead_s = args.lead_s if args.lead_s is not None else 5 + n / 8_000
    due_ms = (int((time.time() + lead_s) * 1000) // 1000 + 1) * 1000
    rate_limit = UNREACHED_RATE_LIMIT if args.features else None
    imported, import_s = await harness.seed(
        found, harness.herd_lines(n, due_ms, f"{sink.url}/herd", rate_limit)
    )
    bytes_per = (await harness.redis_used_memory(found) - before) / max(imported, 1)
    overlap = harness.check_import(args, int(time.time() * 1000), due_ms)
    meter = harness.meter_of(run, sink)
    await asyncio.sleep(max(due_ms / 1000 - time.time(), 0))
    cpu_before = meter.sample()
    await _wait_delivered(sink, run, n, args.timeout_s)
    cpu_after = meter.sample()
    await asyncio.sleep(args.settle_s)  # late duplicates, if any, arrive meanwhile
    received = await harness.arrived(sink, found)
    harness.require_arrivals(len(received), "delivery", run, args.timeout_s)
    figures = herd_figures(
        n, due_ms, received, bytes_per, import_s, harness.cpu_figures(cpu_before, cpu_after, n)
    )
    if isinstance(sink, ExternalSink):
        figures["duplicates"] = None  # one row per occurrence: not visible from the rows
    return {**figures, **overlap, "sink": harness.sink_kind(sink)}


def run(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise CliError("--n: at least 1 schedule")
    extra_env = feature_env if args.features else None
    return harness.report(args, harness.with_services(args, _measured, extra_env))


def add_kind(kinds: Kinds) -> argparse.ArgumentParser:
    herd = kinds.add_parser("herd", help="N schedules all due at one instant")
    herd.add_argument("--n", type=int, default=10_000)
    herd.add_argument("--timeout-s", type=float, default=300)
    herd.add_argument(
        "--features",
        action="store_true",
        help="with the features a herd may use and not be slowed by: a rate limit and a "
        "fire rate quota it never reaches, and signed webhooks",
    )
    herd.set_defaults(handler=run)
    return herd
