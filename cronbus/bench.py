"""``cronbus bench herd | steady | rebuild | intake``: the real services, measured.

Each run gets its own corner: a Redis key prefix, a RabbitMQ vhost (made with rabbitmqctl when
it is on this machine) and a PostgreSQL database, all removed afterwards. Schedules are loaded
with the bulk importer; deliveries arrive at an in-process sink. One JSON line of figures is
printed at the end (``--json``), or a short table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import redis.asyncio as aioredis

from cronbus import console_bench, procs
from cronbus.common import CliError
from cronbus.procs import ServiceProcess
from cronbus.sink import Received, Sink
from shared import bulk, codec, db, index, keys, netpolicy, timefmt, validation
from shared.config import CommonSettings
from shared.store import Store

NAMESPACE = "bench"
LOCAL_POLICY = validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK)


@dataclass
class Corner:
    """The isolated Redis prefix, vhost and database of one run."""

    redis_url: str
    prefix: str
    amqp_url: str
    database_url: str
    vhost: str | None = None

    def env(self) -> dict[str, str]:
        return {
            "CRONBUS_REDIS_URL": self.redis_url,
            "CRONBUS_REDIS_PREFIX": self.prefix,
            "CRONBUS_AMQP_URL": self.amqp_url,
            "CRONBUS_DATABASE_URL": self.database_url,
        }


def _with_path(url: str, path: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


@contextlib.asynccontextmanager
async def corner(settings: CommonSettings) -> AsyncIterator[Corner]:
    run = uuid.uuid4().hex[:8]
    vhost = None
    amqp_url = settings.amqp_url
    ctl = shutil.which("rabbitmqctl")
    if ctl:
        vhost = f"cronbus-bench-{run}"
        await asyncio.to_thread(_rabbitmqctl, ctl, "add_vhost", vhost)
        await asyncio.to_thread(
            _rabbitmqctl,
            ctl,
            "set_permissions",
            "-p",
            vhost,
            urlsplit(amqp_url).username or "guest",
            ".*",
            ".*",
            ".*",
        )
        amqp_url = _with_path(amqp_url, "/" + quote(vhost, safe=""))
    database = f"cronbus_bench_{run}"
    found = Corner(
        settings.redis_url,
        f"bench{run}",
        amqp_url,
        _with_path(settings.database_url, "/" + database),
        vhost,
    )
    try:
        await db.migrate(found.database_url)
        yield found
    finally:
        await _drop_corner(found, settings, database, ctl)


async def _drop_corner(
    found: Corner, settings: CommonSettings, database: str, ctl: str | None
) -> None:
    with contextlib.suppress(Exception):
        conn = await asyncpg.connect(db.split_database_url(settings.database_url)[0])
        await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await conn.close()
    client = aioredis.Redis.from_url(found.redis_url)
    with contextlib.suppress(Exception):
        batch = []
        async for key in client.scan_iter(match=f"{found.prefix}:*", count=1000):
            batch.append(key)
        for start in range(0, len(batch), 1000):
            await client.delete(*batch[start : start + 1000])
    await client.aclose()
    if ctl and found.vhost:
        await asyncio.to_thread(_rabbitmqctl, ctl, "delete_vhost", found.vhost, check=False)


def _rabbitmqctl(ctl: str, *args: str, check: bool = True) -> None:
    subprocess.run([ctl, "-q", *args], check=check, capture_output=True)


@dataclass
class Run:
    corner: Corner
    logs: Path
    processes: list[ServiceProcess] = field(default_factory=list)

    def start(self, name: str, count: int, env: dict[str, str]) -> None:
        for i in range(count):
            port = _free_port()
            self.processes.append(
                procs.start(name, {**self.corner.env(), **env}, port, self.logs / f"{name}-{i}.log")
            )

    async def ready(self) -> None:
        for process in self.processes:
            await process.wait_ready(120)

    def cpu_seconds(self) -> float:
        return sum(p.cpu_seconds() for p in self.processes)


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def _redis_used_memory(url: str) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        info = await client.info("memory")
        return int(info["used_memory"])
    finally:
        await client.aclose()


async def _import(found: Corner, lines: Iterator[bytes]) -> tuple[int, float]:
    settings = CommonSettings(
        **{  # type: ignore[arg-type]
            "redis_url": found.redis_url,
            "redis_prefix": found.prefix,
        }
    )
    client = index.connect(settings)
    idx = index.Index(client, keys.RedisKeys(found.prefix), settings.shards)
    await idx.load_scripts()
    store = await Store.open(found.database_url, min_size=1, max_size=2)
    started = time.monotonic()
    try:
        result = await bulk.import_lines(
            lines, NAMESPACE, store, idx, LOCAL_POLICY, app_id="cronbus-bench"
        )
    finally:
        await store.close()
    elapsed = time.monotonic() - started
    if result.earliest_fire_ms is not None:
        await client.publish(idx.keys.wake_channel, str(result.earliest_fire_ms))
    await client.aclose()
    if result.refused:
        raise CliError(f"bench schedules refused: {bulk.refused_lines(result)[:3]}")
    return result.imported, elapsed


def _service_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "CRONBUS_LOG_LEVEL": "WARNING",
        "CRONBUS_EVENTS": args.events,
        "CRONBUS_MIGRATE_ON_START": "false",
        # The sink listens on loopback.
        "CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS,
    }


def _emit(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    if args.json:
        print(codec.dumps(figures).decode(), flush=True)
        return
    for name, value in figures.items():
        print(f"{name:28} {value}")


# --- herd -----------------------------------------------------------------------------------


def herd_lines(n: int, first_ms: int, url: str) -> Iterator[bytes]:
    start = timefmt.format_ms(first_ms)
    for i in range(n):
        yield codec.dumps(
            {
                "id": f"h{i:08d}",
                "spec": {"kind": "interval", "every_s": 3600, "start_at": start},
                "target": {"kind": "webhook", "url": url},
            }
        )


def herd_figures(
    n: int, due_ms: int, received: list[Received], bytes_per: float, import_s: float, cpu_s: float
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
        "lateness_p50_ms": round(_percentile(late, 0.50), 1),
        "lateness_p99_ms": round(_percentile(late, 0.99), 1),
        "lateness_max_ms": round(max(late, default=math.nan), 1),
        "lost": n - len(occurrences),
        "duplicates": len(received) - len(occurrences),
        "redis_bytes_per_schedule": round(bytes_per, 1),
        "import_s": round(import_s, 2),
        "cpu_ms_per_fire": round(cpu_s * 1000 / max(len(received), 1), 3),
    }


async def _herd(args: argparse.Namespace) -> dict[str, Any]:
    return await _with_services(args, _herd_measured)


Measure = Callable[[argparse.Namespace, Corner, "Run", Sink], Awaitable[dict[str, Any]]]


async def _with_services(args: argparse.Namespace, measure: Measure) -> dict[str, Any]:
    """A sink and the services running in a corner of their own, around ``measure``."""
    sink = Sink()
    await sink.start()
    try:
        async with corner(CommonSettings()) as found:
            with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
                run = Run(found, Path(logs))
                env = _service_env(args)
                run.start("dispatcher", args.dispatchers, env)
                run.start("executor", args.executors, env)
                run.start("sweeper", 1, env)
                try:
                    await run.ready()
                    return await measure(args, found, run, sink)
                finally:
                    procs.stop_all(run.processes)
    finally:
        await sink.stop()


async def _herd_measured(
    args: argparse.Namespace, found: Corner, run: Run, sink: Sink
) -> dict[str, Any]:
    n = args.n
    before = await _redis_used_memory(found.redis_url)
    lead_s = args.lead_s if args.lead_s is not None else 5 + n / 15_000
    due_ms = (int((time.time() + lead_s) * 1000) // 1000 + 1) * 1000
    imported, import_s = await _import(found, herd_lines(n, due_ms, f"{sink.url}/herd"))
    bytes_per = (await _redis_used_memory(found.redis_url) - before) / max(imported, 1)
    if time.time() * 1000 >= due_ms:
        raise CliError(f"the import took {import_s:.1f}s, past the due instant: raise --lead-s")
    await asyncio.sleep(max(due_ms / 1000 - time.time(), 0))
    cpu_before = run.cpu_seconds()
    await sink.wait_for(lambda s: len(s.received) >= n, timeout_s=args.timeout_s)
    cpu_s = run.cpu_seconds() - cpu_before
    await asyncio.sleep(args.settle_s)  # late duplicates, if any, arrive meanwhile
    return herd_figures(n, due_ms, list(sink.received), bytes_per, import_s, cpu_s)


# --- steady ---------------------------------------------------------------------------------


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
    return await _with_services(args, _steady_measured)


async def _steady_measured(
    args: argparse.Namespace, found: Corner, run: Run, sink: Sink
) -> dict[str, Any]:
    n = args.schedules
    every_ms = round(n * 1000 / args.rate)
    before = await _redis_used_memory(found.redis_url)
    lead_s = args.lead_s if args.lead_s is not None else 5 + n / 15_000
    first_ms = (int((time.time() + lead_s) * 1000) // 1000 + 1) * 1000
    imported, import_s = await _import(
        found, steady_lines(n, every_ms, first_ms, f"{sink.url}/steady")
    )
    bytes_per = (await _redis_used_memory(found.redis_url) - before) / max(imported, 1)
    start_ms = first_ms + args.warmup_s * 1000
    end_ms = start_ms + args.duration_s * 1000
    await asyncio.sleep(max(start_ms / 1000 - time.time(), 0))
    cpu_before, host_before = run.cpu_seconds(), _host_cpu_seconds()
    await asyncio.sleep(max(end_ms / 1000 - time.time(), 0))
    cpu_s, host_s = run.cpu_seconds() - cpu_before, _host_cpu_seconds() - host_before
    await asyncio.sleep(args.settle_s)
    window = [
        r for r in sink.received if start_ms <= timefmt.parse_rfc3339_ms(r.fire_time) < end_ms
    ]
    late = [r.at_ms - timefmt.parse_rfc3339_ms(r.fire_time) for r in window if r.attempt == 1]
    expected = _expected_fires(n, every_ms, first_ms, start_ms, end_ms)
    occurrences = {(r.schedule, r.fire_time) for r in window}
    return {
        "schedules": n,
        "rate_per_s": args.rate,
        "duration_s": args.duration_s,
        "fires": len(window),
        "expected_fires": expected,
        "lost": expected - len(occurrences),
        "duplicates": len(window) - len(occurrences),
        "lateness_p50_ms": round(_percentile(late, 0.50), 1),
        "lateness_p99_ms": round(_percentile(late, 0.99), 1),
        "lateness_max_ms": round(max(late, default=math.nan), 1),
        "cpu_ms_per_fire": round(cpu_s * 1000 / max(len(window), 1), 3),
        "host_cpu_ms_per_fire": round(host_s * 1000 / max(len(window), 1), 3),
        "redis_bytes_per_schedule": round(bytes_per, 1),
        "import_s": round(import_s, 2),
    }


def _expected_fires(n: int, every_ms: int, first_ms: int, start_ms: int, end_ms: int) -> int:
    count = 0
    for i in range(n):
        anchor = first_ms + i * every_ms // n
        low = max(0, math.ceil((start_ms - anchor) / every_ms))
        high = math.ceil((end_ms - anchor) / every_ms)
        count += max(0, high - low)
    return count


def _host_cpu_seconds() -> float:
    """CPU time the whole machine spent (all processes: Redis, RabbitMQ, PostgreSQL too)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4))  # not idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


# --- rebuild and import ----------------------------------------------------------------------


async def _forget_index(found: Corner) -> None:
    """What Redis losing its data looks like to cronbus: every key of the corner gone."""
    client = aioredis.Redis.from_url(found.redis_url)
    try:
        doomed = [key async for key in client.scan_iter(match=f"{found.prefix}:*", count=5000)]
        for start in range(0, len(doomed), 5000):
            await client.delete(*doomed[start : start + 5000])
    finally:
        await client.aclose()


async def _rebuild(args: argparse.Namespace) -> dict[str, Any]:
    settings = CommonSettings()
    async with corner(settings) as found:
        before = await _redis_used_memory(found.redis_url)
        lines = herd_lines(args.n, int(time.time() * 1000) + 86_400_000, "http://127.0.0.1:9/x")
        imported, import_s = await _import(found, lines)
        bytes_per = (await _redis_used_memory(found.redis_url) - before) / max(imported, 1)
        await _forget_index(found)
        with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
            run = Run(found, Path(logs))
            run.start("sweeper", 1, {**_service_env(args), "CRONBUS_SWEEP_INTERVAL_S": "0.2"})
            try:
                rebuild_s = await _wait_for_rebuild(run.processes[0], args.timeout_s)
            finally:
                procs.stop_all(run.processes)
        restored = await _count_index(found)
    return {
        "n": args.n,
        "imported": imported,
        "import_s": round(import_s, 2),
        "import_per_s": round(imported / import_s, 1) if import_s else None,
        "rebuild_s": rebuild_s,
        "rebuild_per_s": round(args.n / rebuild_s, 1),
        "restored": restored,
        "redis_bytes_per_schedule": round(bytes_per, 1),
    }


async def _wait_for_rebuild(sweeper: ServiceProcess, timeout_s: float) -> float:
    """The sweeper's own measure of the rebuild (cronbus_rebuild_duration_seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
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
    client = aioredis.Redis.from_url(found.redis_url)
    try:
        counts = [
            await client.hlen(keys.RedisKeys(found.prefix).sched(shard))
            for shard in range(CommonSettings().shards)
        ]
        return sum(counts)
    finally:
        await client.aclose()


def run_rebuild(args: argparse.Namespace) -> int:
    _emit(args, asyncio.run(_rebuild(args)))
    return 0


def run_herd(args: argparse.Namespace) -> int:
    _emit(args, asyncio.run(_herd(args)))
    return 0


def run_steady(args: argparse.Namespace) -> int:
    _emit(args, asyncio.run(_steady(args)))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure cronbus on this machine (herd, steady, rebuild)")
    kinds = p.add_subparsers(dest="bench", required=True, metavar="KIND")
    herd = kinds.add_parser("herd", help="N schedules all due at one instant")
    herd.add_argument("--n", type=int, default=10_000)
    herd.add_argument("--timeout-s", type=float, default=300)
    herd.set_defaults(handler=run_herd)
    steady = kinds.add_parser("steady", help="N schedules firing R times a second in total")
    steady.add_argument("--schedules", type=int, default=1000)
    steady.add_argument("--rate", type=float, default=1000, help="fires per second in total")
    steady.add_argument(
        "--duration", dest="duration_s", type=int, default=30, help="seconds measured"
    )
    steady.add_argument("--warmup-s", type=int, default=5)
    steady.set_defaults(handler=run_steady)
    rebuild = kinds.add_parser(
        "rebuild", help="import N schedules, lose the Redis index, time the sweeper's rebuild"
    )
    rebuild.add_argument("--n", type=int, default=100_000)
    rebuild.add_argument("--timeout-s", type=float, default=600)
    rebuild.set_defaults(handler=run_rebuild)
    console_bench.add_parser(kinds)
    from cronbus import bench_intake  # noqa: PLC0415 - it builds on this module

    intake = bench_intake.add_kind(kinds)
    for kind in (herd, steady, rebuild, intake):
        kind.add_argument("--json", action="store_true", help="one JSON line of figures")
        kind.add_argument(
            "--executors",
            type=int,
            default=os.cpu_count() or 1,
            help="executor processes (default: one per core)",
        )
        kind.add_argument("--dispatchers", type=int, default=1)
        kind.add_argument(
            "--events",
            default="failures",
            choices=("all", "failures", "none"),
            help="CRONBUS_EVENTS for the run (default failures)",
        )
        kind.add_argument(
            "--lead-s",
            type=float,
            default=None,
            help="seconds between the start of the import and the first fire",
        )
        kind.add_argument(
            "--settle-s",
            type=float,
            default=2.0,
            help="seconds to wait for late duplicates after the last delivery",
        )
