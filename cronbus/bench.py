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

from cronbus import benchcpu, console_bench, procs
from cronbus.common import CliError
from cronbus.procs import ServiceProcess
from cronbus.sink import Received, Sink
from shared.contract import codec, keys, timefmt, validation
from shared.policy import netpolicy
from shared.postgres import bulk, db
from shared.postgres.store import Store
from shared.redis import index
from shared.runtime.config import CommonSettings

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
            await client.unlink(*batch[start : start + 1000])
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

    def pids(self, name: str) -> set[int]:
        return {p.pid for p in self.processes if p.name == name}


def _port(url: str, default: int) -> int:
    return urlsplit(url).port or default


@dataclass
class Meter:
    """Samples the CPU time of every component of a run, by PID (see ``cronbus.benchcpu``).

    The servers are found by the port they listen on, so private servers other work runs
    on the same machine are not counted; Redis and RabbitMQ are still shared with whatever
    else uses the same servers. PostgreSQL counts the postmaster, its own processes and the
    backends of the run's database only.
    """

    run: Run
    sink_port: int
    external_sink: bool

    def _sink_pids(self) -> set[int]:
        if not self.external_sink:
            return {os.getpid()}  # the in-process sink: the bench process itself
        holders = benchcpu.listening_pids(self.sink_port)
        return holders | benchcpu.children_of(holders)

    def sample(self) -> dict[str, dict[int, float]]:
        found = self.run.corner
        database = db.split_database_url(found.database_url)[1]
        pids = {
            "executors": self.run.pids("executor"),
            "dispatcher": self.run.pids("dispatcher"),
            "sweeper": self.run.pids("sweeper"),
            "redis": benchcpu.listening_pids(_port(found.redis_url, 6379)),
            "rabbitmq": benchcpu.listening_pids(_port(found.amqp_url, 5672)),
            "postgresql": benchcpu.postgres_pids(_port(found.database_url, 5432), database),
            "sink": self._sink_pids(),
        }
        sample = {name: benchcpu.times_of(group) for name, group in pids.items()}
        sample["machine"] = {0: benchcpu.host_cpu_seconds()}
        return sample


def cpu_figures(before: benchcpu.Sample, after: benchcpu.Sample, fires: int) -> dict[str, Any]:
    by_component = benchcpu.ms_per_fire(before, after, fires)
    machine = by_component.pop("machine", math.nan)
    return {
        "cpu_ms_per_fire": benchcpu.services_total(by_component),
        "cpu_ms_per_fire_by_component": by_component,
        "host_cpu_ms_per_fire": machine,
    }


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


async def _import(
    found: Corner, lines: Iterator[bytes], namespace: str = NAMESPACE
) -> tuple[int, float]:
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
            lines, namespace, store, idx, LOCAL_POLICY, app_id="cronbus-bench"
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


#: ``--features``: a rate limit no herd reaches, so its whole cost is paid and nothing waits.
UNREACHED_RATE_LIMIT = {"per_s": 100_000, "burst": 100_000}
#: ``--features``: a fire rate quota no herd reaches.
UNREACHED_QUOTA = {"max_fires_per_s": 1_000_000}
#: ``--features``: a Standard Webhooks signing secret (a fixed one: the bench signs, nobody checks).
BENCH_SIGNING_SECRET = "whsec_" + "Y3JvbmJ1cy1iZW5jaC1zaWduaW5nLWtleS0wMQ=="


def herd_lines(
    n: int, first_ms: int, url: str, rate_limit: dict[str, int] | None = None
) -> Iterator[bytes]:
    start = timefmt.format_ms(first_ms)
    target: dict[str, Any] = {"kind": "webhook", "url": url}
    if rate_limit is not None:
        target["rate_limit"] = rate_limit
    for i in range(n):
        yield codec.dumps(
            {
                "id": f"h{i:08d}",
                "spec": {"kind": "interval", "every_s": 3600, "start_at": start},
                "target": target,
            }
        )


def feature_env(directory: Path) -> dict[str, str]:
    """Signing secrets and a quota for the bench's namespace, in files of ``directory``."""
    secrets = directory / "signing-secrets.json"
    secrets.write_bytes(codec.dumps({NAMESPACE: [BENCH_SIGNING_SECRET]}))
    quotas = directory / "quotas.json"
    quotas.write_bytes(codec.dumps({NAMESPACE: UNREACHED_QUOTA}))
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
        "lateness_p50_ms": round(_percentile(late, 0.50), 1),
        "lateness_p99_ms": round(_percentile(late, 0.99), 1),
        "lateness_max_ms": round(max(late, default=math.nan), 1),
        "lost": n - len(occurrences),
        "duplicates": len(received) - len(occurrences),
        "redis_bytes_per_schedule": round(bytes_per, 1),
        "import_s": round(import_s, 2),
        **cpu,
    }


async def _herd(args: argparse.Namespace) -> dict[str, Any]:
    return await _with_services(args, _herd_measured)


@dataclass
class ExternalSink:
    """A sink the bench did not start (``--sink-url``), so its CPU is not the bench's own.

    What arrived is read back from the execution rows (one per occurrence: duplicates are
    not visible this way; the time is the start of the attempt, not the arrival), and
    progress from the executors' ``cronbus_audit_rows_written_total``.
    """

    url: str

    async def stop(self) -> None:
        """Nothing to stop: someone else runs it."""


AnySink = Sink | ExternalSink


def parse_sink_url(url: str) -> str:
    """``--sink-url``: an http URL of a loopback host with a port, without a trailing slash."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise CliError(f"--sink-url: {url!r} is not an http URL of a loopback host")
    if parts.port is None:
        raise CliError(f"--sink-url: {url!r} names no port")
    return url.rstrip("/")


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


async def _received(sink: AnySink, found: Corner) -> list[Received]:
    """What arrived, as the in-process sink saw it or as the execution rows tell it."""
    if isinstance(sink, Sink):
        return list(sink.received)
    conn = await asyncpg.connect(found.database_url)
    try:
        rows = await conn.fetch(
            "SELECT namespace, id, nominal_at, attempts, lateness_ms FROM executions"
        )
    finally:
        await conn.close()
    fires = []
    for row in rows:
        nominal_ms = int(row["nominal_at"].timestamp() * 1000)
        headers = {
            "x-cronbus-schedule": f"{row['namespace']}/{row['id']}",
            "x-cronbus-fire-time": timefmt.format_ms(nominal_ms),
            "x-cronbus-attempt": str(row["attempts"]),
        }
        fires.append(Received(nominal_ms + row["lateness_ms"], "POST", "", headers, b""))
    return fires


Measure = Callable[[argparse.Namespace, Corner, "Run", AnySink], Awaitable[dict[str, Any]]]


async def _with_services(args: argparse.Namespace, measure: Measure) -> dict[str, Any]:
    """A sink and the services running in a corner of their own, around ``measure``."""
    sink_url = getattr(args, "sink_url", None)
    sink: AnySink
    if sink_url:
        sink = ExternalSink(parse_sink_url(sink_url))
    else:
        sink = Sink()
        await sink.start()
    try:
        async with corner(CommonSettings()) as found:
            with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
                run = Run(found, Path(logs))
                env = _service_env(args)
                if getattr(args, "features", False):
                    env |= feature_env(Path(logs))
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


def _meter(run: Run, sink: AnySink) -> Meter:
    return Meter(run, _port(sink.url, 80), isinstance(sink, ExternalSink))


def check_import(
    args: argparse.Namespace, import_end_ms: int, window_start_ms: int
) -> dict[str, Any]:
    """Refuse a run whose import ran into the measured window, or flag it (--allow-overlap)."""
    window = benchcpu.ImportWindow(import_end_ms, window_start_ms)
    refusal = window.refusal()
    if refusal is not None and not args.allow_overlap:
        raise CliError(refusal)
    figures: dict[str, Any] = {"import_margin_s": window.margin_s}
    if refusal is not None:
        figures["import_overlap_s"] = round(window.overlap_ms / 1000, 3)
        figures["flagged"] = "the import overlapped the measured window"
    return figures


async def _herd_measured(
    args: argparse.Namespace, found: Corner, run: Run, sink: AnySink
) -> dict[str, Any]:
    n = args.n
    before = await _redis_used_memory(found.redis_url)
    lead_s = args.lead_s if args.lead_s is not None else 5 + n / 8_000
    due_ms = (int((time.time() + lead_s) * 1000) // 1000 + 1) * 1000
    rate_limit = UNREACHED_RATE_LIMIT if args.features else None
    imported, import_s = await _import(found, herd_lines(n, due_ms, f"{sink.url}/herd", rate_limit))
    bytes_per = (await _redis_used_memory(found.redis_url) - before) / max(imported, 1)
    overlap = check_import(args, int(time.time() * 1000), due_ms)
    meter = _meter(run, sink)
    await asyncio.sleep(max(due_ms / 1000 - time.time(), 0))
    cpu_before = meter.sample()
    await _wait_delivered(sink, run, n, args.timeout_s)
    cpu_after = meter.sample()
    await asyncio.sleep(args.settle_s)  # late duplicates, if any, arrive meanwhile
    received = await _received(sink, found)
    figures = herd_figures(
        n, due_ms, received, bytes_per, import_s, cpu_figures(cpu_before, cpu_after, n)
    )
    if isinstance(sink, ExternalSink):
        figures["duplicates"] = None  # one row per occurrence: not visible from the rows
    return {**figures, **overlap, "sink": _sink_kind(sink)}


def _sink_kind(sink: AnySink) -> str:
    return f"external {sink.url}" if isinstance(sink, ExternalSink) else "in-process"


# --- fairness -------------------------------------------------------------------------------

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
        "small_p50_ms": round(_percentile(late_b, 0.50), 1),
        "small_p99_ms": round(_percentile(late_b, 0.99), 1),
        "small_max_ms": round(max(late_b, default=math.nan), 1),
        "small_done_before_herd": bool(few) and max(r.at_ms for r in few) < herd_last,
        "lost": n + small - len({(r.schedule, r.fire_time) for r in received}),
    }


async def _fairness(args: argparse.Namespace) -> dict[str, Any]:
    return await _with_services(args, _fairness_measured)


async def _fairness_measured(
    args: argparse.Namespace, found: Corner, run: Run, sink: AnySink
) -> dict[str, Any]:
    if not isinstance(sink, Sink):
        raise CliError("bench fairness reads its figures from the in-process sink only")
    n, small = args.n, args.small
    lead_s = args.lead_s if args.lead_s is not None else 5 + n / 4000
    due_ms = (int((time.time() + lead_s) * 1000) // 1000 + 1) * 1000
    await _import(found, herd_lines(n, due_ms, f"{sink.url}/a"), FAIR_HERD_NAMESPACE)
    await _import(found, herd_lines(small, due_ms, f"{sink.url}/b"), FAIR_SMALL_NAMESPACE)
    if time.time() * 1000 >= due_ms:
        raise CliError("the import took past the due instant: raise --lead-s")
    await asyncio.sleep(max(due_ms / 1000 - time.time(), 0))
    await sink.wait_for(lambda s: len(s.received) >= n + small, timeout_s=args.timeout_s)
    await asyncio.sleep(args.settle_s)
    return fairness_figures(n, small, due_ms, list(sink.received))


def run_fairness(args: argparse.Namespace) -> int:
    _emit(args, asyncio.run(_fairness(args)))
    return 0


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
    args: argparse.Namespace, found: Corner, run: Run, sink: AnySink
) -> dict[str, Any]:
    n = args.schedules
    every_ms = round(n * 1000 / args.rate)
    before = await _redis_used_memory(found.redis_url)
    lead_s = args.lead_s if args.lead_s is not None else 5 + n / 8_000
    first_ms = (int((time.time() + lead_s) * 1000) // 1000 + 1) * 1000
    imported, import_s = await _import(
        found, steady_lines(n, every_ms, first_ms, f"{sink.url}/steady")
    )
    bytes_per = (await _redis_used_memory(found.redis_url) - before) / max(imported, 1)
    start_ms = first_ms + args.warmup_s * 1000
    end_ms = start_ms + args.duration_s * 1000
    overlap = check_import(args, int(time.time() * 1000), start_ms)
    meter = _meter(run, sink)
    await asyncio.sleep(max(start_ms / 1000 - time.time(), 0))
    cpu_before = meter.sample()
    await asyncio.sleep(max(end_ms / 1000 - time.time(), 0))
    cpu_after = meter.sample()
    expected = _expected_fires(n, every_ms, first_ms, start_ms, end_ms)
    # Fires of the window still on their way are late, not lost: wait for them (bounded).
    drained_s = await _wait_window(sink, found, start_ms, end_ms, expected, args.timeout_s)
    await asyncio.sleep(args.settle_s)
    window = await _window(sink, found, start_ms, end_ms)
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
        "lateness_p50_ms": round(_percentile(late, 0.50), 1),
        "lateness_p99_ms": round(_percentile(late, 0.99), 1),
        "lateness_max_ms": round(max(late, default=math.nan), 1),
        **cpu_figures(cpu_before, cpu_after, len(window)),
        "redis_bytes_per_schedule": round(bytes_per, 1),
        "import_s": round(import_s, 2),
        **overlap,
        "sink": _sink_kind(sink),
    }


async def _window(sink: AnySink, found: Corner, start_ms: int, end_ms: int) -> list[Received]:
    """What arrived of the occurrences due inside the measured window."""
    return [
        r
        for r in await _received(sink, found)
        if start_ms <= timefmt.parse_rfc3339_ms(r.fire_time) < end_ms
    ]


async def _wait_window(
    sink: AnySink, found: Corner, start_ms: int, end_ms: int, expected: int, timeout_s: float
) -> float | None:
    """Seconds after the window's end until every occurrence due in it arrived; None when some
    had not after ``timeout_s`` (they are then counted as lost)."""
    deadline = time.monotonic() + timeout_s
    while True:
        arrived = {(r.schedule, r.fire_time) for r in await _window(sink, found, start_ms, end_ms)}
        if len(arrived) >= expected:
            return round(max(time.time() - end_ms / 1000, 0.0), 1)
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(1)  # reading rows or the sink's list: no event to wait on


def _expected_fires(n: int, every_ms: int, first_ms: int, start_ms: int, end_ms: int) -> int:
    count = 0
    for i in range(n):
        anchor = first_ms + i * every_ms // n
        low = max(0, math.ceil((start_ms - anchor) / every_ms))
        high = math.ceil((end_ms - anchor) / every_ms)
        count += max(0, high - low)
    return count


# --- rebuild and import ----------------------------------------------------------------------


async def _forget_index(found: Corner) -> None:
    """What Redis losing its data looks like to cronbus: every key of the corner gone."""
    client = aioredis.Redis.from_url(found.redis_url)
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
        async with corner(CommonSettings()) as found:
            return await _rebuild_in(args, found, sink)
    finally:
        await sink.stop()


#: Fires of the firing schedules are measured from this long after the rebuild started (its
#: first page, which holds them, is written by then) to its end.
REBUILD_FIRING_MARGIN_MS = 1000


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
        **_service_env(args),
        "CRONBUS_SWEEP_INTERVAL_S": "0.2",
        "CRONBUS_REBUILD_BATCH": str(args.rebuild_batch),
    }
    with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
        # As on a fresh install: a sweeper finds no index, builds the empty one, and stops
        # (so that neither it nor a rebuild of what is imported next competes with the import).
        first = Run(found, Path(logs))
        first.start("sweeper", 1, env)
        try:
            await _wait_for_rebuild(first.processes[0], args.timeout_s)
        finally:
            procs.stop_all(first.processes)
    before = await _redis_used_memory(found.redis_url)
    lines = herd_lines(args.n, int(time.time() * 1000) + 86_400_000, "http://127.0.0.1:9/x")
    imported, import_s = await _import(found, lines)
    bytes_per = (await _redis_used_memory(found.redis_url) - before) / max(imported, 1)
    with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
        run = Run(found, Path(logs))
        if args.firing:
            run.start("dispatcher", args.dispatchers, env)
            run.start("executor", args.executors, env)
        run.start("sweeper", 1, env)
        try:
            await run.ready()
            if args.firing:
                # Firing before Redis loses its data, as in production.
                first_ms = (int(time.time()) + 3) * 1000
                await _import(found, firing_lines(args.firing, first_ms, f"{sink.url}/f"))
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
                await _wait_window(sink, found, *window, expected, args.timeout_s)
            await asyncio.sleep(args.settle_s)
        finally:
            procs.stop_all(run.processes)
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
        "firing_p50_ms": round(_percentile(late, 0.50), 1),
        "firing_p99_ms": round(_percentile(late, 0.99), 1),
        "firing_max_ms": round(max(late, default=math.nan), 1),
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
    herd.add_argument(
        "--features",
        action="store_true",
        help="with the features a herd may use and not be slowed by: a rate limit and a "
        "fire rate quota it never reaches, and signed webhooks",
    )
    herd.set_defaults(handler=run_herd)
    fairness = kinds.add_parser(
        "fairness",
        help="a herd of N due at once in one namespace and a few in another: "
        "how late the few are while the herd drains",
    )
    fairness.add_argument("--n", type=int, default=100_000, help="the herd (namespace tenant-a)")
    fairness.add_argument("--small", type=int, default=100, help="the few (namespace tenant-b)")
    fairness.add_argument("--timeout-s", type=float, default=300)
    fairness.set_defaults(handler=run_fairness)
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
    steady.set_defaults(handler=run_steady)
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
    rebuild.set_defaults(handler=run_rebuild)
    console_bench.add_parser(kinds)
    from cronbus import bench_intake  # noqa: PLC0415 - it builds on this module

    intake = bench_intake.add_kind(kinds)
    from cronbus import bench_drift  # noqa: PLC0415 - it builds on this module

    drift = bench_drift.add_kind(kinds)
    for kind in (herd, steady):
        kind.add_argument(
            "--sink-url",
            help="deliver to this sink (http, loopback, e.g. an nginx answering 200) instead "
            "of the bench's in-process one, so the sink's CPU is not the bench's",
        )
        kind.add_argument(
            "--allow-overlap",
            action="store_true",
            help="report a run whose import ran into the measured window, flagged, "
            "instead of refusing it",
        )
    drift.add_argument("--json", action="store_true", help="one JSON line of figures")
    for kind in (herd, fairness, steady, rebuild, intake):
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
