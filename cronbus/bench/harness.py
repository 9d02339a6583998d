"""What the service benchmarks share: a corner of their own, the services, a sink, the seeding.

Each run gets its own corner: a Redis key prefix, a RabbitMQ vhost (made with rabbitmqctl when
it is on this machine) and a PostgreSQL database, all removed afterwards. Schedules are seeded
with the bulk importer; deliveries arrive at an in-process sink, or at one the user runs
(``--sink-url``), read back from the execution rows. The CPU of each component is sampled by
PID (``cronbus.bench.cpu``), and an import that ran into the measured window is refused or
flagged. One JSON line of figures is printed at the end (``--json``), or a short table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import redis.asyncio as aioredis

from cronbus.bench import cpu
from cronbus.cli import procs
from cronbus.cli.common import CliError
from cronbus.cli.procs import ServiceProcess
from cronbus.cli.sink import Received, Sink
from shared.contract import codec, keys, timefmt, validation
from shared.policy import netpolicy
from shared.postgres import bulk, db
from shared.postgres.store import Store
from shared.redis import connection, index
from shared.runtime.config import CommonSettings

NAMESPACE = "bench"
#: Seconds between looks at whether the run's services are still running.
WATCH_S = 0.5
#: CRONBUS_SHUTDOWN_GRACE_S of the bench's services: what they were doing when the run ends
#: is of no use to anyone (the corner is dropped), so a signal ends a run in seconds.
SERVICE_GRACE_S = 5
#: How long a stopped run's measurement may take to unwind before its services are stopped.
CANCEL_WAIT_S = 5.0
#: The longest the vhost's deletion may take when a run ends (rabbitmqctl can be slow on a
#: loaded machine), so that a stopped bench ends within a bound.
CTL_DROP_S = 30.0

T = TypeVar("T")
LOCAL_POLICY = validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK)

#: The ``KIND`` subcommands of ``cronbus bench``, each benchmark adds its own.
Kinds: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


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

    def redis_settings(self) -> CommonSettings:
        """The corner's Redis (Sentinel, cluster and CA settings from the environment)."""
        return CommonSettings(
            **{  # type: ignore[arg-type]
                "redis_url": self.redis_url,
                "redis_prefix": self.prefix,
            }
        )

    def redis_node(self) -> aioredis.Redis:
        """A plain client of the corner's Redis (the primary, with Sentinel)."""
        return connection.connect_node(self.redis_settings())


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
    client = found.redis_node()
    with contextlib.suppress(Exception):
        batch = []
        async for key in client.scan_iter(match=f"{found.prefix}:*", count=1000):
            batch.append(key)
        for start in range(0, len(batch), 1000):
            await client.unlink(*batch[start : start + 1000])
    await client.aclose()
    if ctl and found.vhost:
        try:
            await asyncio.to_thread(
                _rabbitmqctl, ctl, "delete_vhost", found.vhost, check=False, timeout_s=CTL_DROP_S
            )
        except subprocess.TimeoutExpired:
            # A stopped bench must end: the vhost is named for whoever deletes it later.
            print(
                f"cronbus bench: the vhost {found.vhost} was not deleted within {CTL_DROP_S:g} s;"
                f" delete it with: rabbitmqctl delete_vhost {found.vhost}",
                file=sys.stderr,
            )


def _rabbitmqctl(ctl: str, *args: str, check: bool = True, timeout_s: float | None = None) -> None:
    # On timeout, subprocess.run kills rabbitmqctl: nothing the bench started is left.
    subprocess.run([ctl, "-q", *args], check=check, capture_output=True, timeout=timeout_s)


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
        # Said on stderr (stdout holds the figures): progress, and the PIDs the bench owns.
        pids = " ".join(f"{p.name}={p.pid}" for p in self.processes)
        print(f"cronbus bench: services ready: {pids}", file=sys.stderr, flush=True)

    def exited(self) -> str | None:
        """Why the run's figures cannot be the services': one of them exited, and how."""
        for process in self.processes:
            code = process.popen.poll()
            if code is not None:
                return (
                    f"{process.name} (pid {process.pid}) exited with status {code} during the "
                    f"run; no figures. Its log ends:\n{process.tail(20)}"
                )
        return None

    def states(self) -> str:
        """Each service's state, for a reason given instead of figures."""
        return ", ".join(
            f"{p.name} {'running' if p.alive() else f'exited ({p.popen.returncode})'}"
            for p in self.processes
        )

    def cpu_seconds(self) -> float:
        return sum(p.cpu_seconds() for p in self.processes)

    def pids(self, name: str) -> set[int]:
        return {p.pid for p in self.processes if p.name == name}

    def stop(self) -> None:
        """Every service of the run: SIGTERM to its group, then SIGKILL after their grace."""
        procs.stop_all(self.processes, SERVICE_GRACE_S + 5)


def _port(url: str, default: int) -> int:
    return urlsplit(url).port or default


@dataclass
class Meter:
    """Samples the CPU time of every component of a run, by PID (see ``cronbus.bench.cpu``).

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
        holders = cpu.listening_pids(self.sink_port)
        return holders | cpu.children_of(holders)

    def sample(self) -> dict[str, dict[int, float]]:
        found = self.run.corner
        database = db.split_database_url(found.database_url)[1]
        pids = {
            "executors": self.run.pids("executor"),
            "dispatcher": self.run.pids("dispatcher"),
            "sweeper": self.run.pids("sweeper"),
            "redis": cpu.listening_pids(_port(found.redis_url, 6379)),
            "rabbitmq": cpu.listening_pids(_port(found.amqp_url, 5672)),
            "postgresql": cpu.postgres_pids(_port(found.database_url, 5432), database),
            "sink": self._sink_pids(),
        }
        sample = {name: cpu.times_of(group) for name, group in pids.items()}
        sample["machine"] = {0: cpu.host_cpu_seconds()}
        return sample


def cpu_figures(before: cpu.Sample, after: cpu.Sample, fires: int) -> dict[str, Any]:
    by_component = cpu.ms_per_fire(before, after, fires)
    machine = by_component.pop("machine", math.nan)
    return {
        "cpu_ms_per_fire": cpu.services_total(by_component),
        "cpu_ms_per_fire_by_component": by_component,
        "host_cpu_ms_per_fire": machine,
    }


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def redis_used_memory(found: Corner) -> int:
    client = found.redis_node()
    try:
        info = await client.info("memory")
        return int(info["used_memory"])
    finally:
        await client.aclose()


# --- seeding --------------------------------------------------------------------------------


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


async def seed(
    found: Corner, lines: Iterator[bytes], namespace: str = NAMESPACE
) -> tuple[int, float]:
    settings = found.redis_settings()
    client = connection.connect(settings)
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


# --- the services and the sink --------------------------------------------------------------


def service_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "CRONBUS_LOG_LEVEL": "WARNING",
        "CRONBUS_EVENTS": args.events,
        "CRONBUS_MIGRATE_ON_START": "false",
        "CRONBUS_SHUTDOWN_GRACE_S": str(SERVICE_GRACE_S),
        # The sink listens on loopback.
        "CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS,
    }


def emit(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    if args.json:
        print(codec.dumps(figures).decode(), flush=True)
        return
    for name, value in figures.items():
        print(f"{name:28} {value}")


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


def sink_kind(sink: AnySink) -> str:
    return f"external {sink.url}" if isinstance(sink, ExternalSink) else "in-process"


async def arrived(sink: AnySink, found: Corner) -> list[Received]:
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


async def arrived_in(sink: AnySink, found: Corner, start_ms: int, end_ms: int) -> list[Received]:
    """What arrived of the occurrences due inside the measured window."""
    return [
        r
        for r in await arrived(sink, found)
        if start_ms <= timefmt.parse_rfc3339_ms(r.fire_time) < end_ms
    ]


async def wait_window(
    sink: AnySink, found: Corner, start_ms: int, end_ms: int, expected: int, timeout_s: float
) -> float | None:
    """Seconds after the window's end until every occurrence due in it arrived; None when some
    had not after ``timeout_s`` (they are then counted as lost)."""
    deadline = time.monotonic() + timeout_s
    while True:
        window = await arrived_in(sink, found, start_ms, end_ms)
        if len({(r.schedule, r.fire_time) for r in window}) >= expected:
            return round(max(time.time() - end_ms / 1000, 0.0), 1)
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(1)  # reading rows or the sink's list: no event to wait on


Measure = Callable[[argparse.Namespace, Corner, Run, AnySink], Awaitable[dict[str, Any]]]
#: Environment a benchmark adds for its services, from files it writes in the run's directory.
ExtraEnv = Callable[[Path], dict[str, str]]


async def with_services(
    args: argparse.Namespace,
    measure: Measure,
    extra_env: ExtraEnv | None = None,
    own_sink: Sink | None = None,
) -> dict[str, Any]:
    """A sink and the services running in a corner of their own, around ``measure``. The
    in-process sink answers 200 unless the benchmark passes its own (``own_sink``)."""
    sink_url = getattr(args, "sink_url", None)
    sink: AnySink
    if sink_url:
        sink = ExternalSink(parse_sink_url(sink_url))
    else:
        sink = own_sink if own_sink is not None else Sink()
        await sink.start()
    try:
        async with corner(CommonSettings()) as found:
            with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
                run = Run(found, Path(logs))
                env = service_env(args)
                if extra_env is not None:
                    env |= extra_env(Path(logs))
                try:
                    run.start("dispatcher", args.dispatchers, env)
                    run.start("executor", args.executors, env)
                    run.start("sweeper", 1, env)
                    await run.ready()
                    return await watched(run, measure(args, found, run, sink))
                finally:
                    run.stop()
    finally:
        await sink.stop()


async def watched(run: Run, work: Awaitable[T]) -> T:
    """``work``, failed at once with the reason when a service of ``run`` exits meanwhile
    (its figures could no longer be the services', and waiting for them would be silent)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_S)
            if done:
                return task.result()
            reason = run.exited()
            if reason is not None:
                raise CliError(reason)
    finally:
        if not task.done():
            task.cancel()
            # Its own failure, if any, is not the reason this run ends; nor may its clean-up
            # (a database pool closing gracefully on a loaded machine) hold the services'
            # stop, which comes next: it gets a few seconds, then the run goes on stopping.
            await asyncio.wait({task}, timeout=CANCEL_WAIT_S)


def report(args: argparse.Namespace, measure: Coroutine[Any, Any, dict[str, Any]]) -> int:
    """A benchmark's handler: its figures printed, or none and the reason (``CliError``, exit
    status 2) or the signal that stopped it (``procs.Interrupted``), never nothing and 0."""
    figures = procs.run_until_signal(measure)
    emit(args, figures)
    return 0


def require_arrivals(arrived: int, what: str, run: Run, timeout_s: float) -> None:
    """Nothing arrived: there are no figures to give, only the reason."""
    if arrived == 0:
        raise CliError(
            f"no {what} arrived within {timeout_s:g}s ({run.states()}); no figures: "
            "is the sink reachable from the executors, and the machine not overloaded?"
        )


def meter_of(run: Run, sink: AnySink) -> Meter:
    return Meter(run, _port(sink.url, 80), isinstance(sink, ExternalSink))


def check_import(
    args: argparse.Namespace, import_end_ms: int, window_start_ms: int
) -> dict[str, Any]:
    """Refuse a run whose import ran into the measured window, or flag it (--allow-overlap)."""
    window = cpu.ImportWindow(import_end_ms, window_start_ms)
    refusal = window.refusal()
    if refusal is not None and not args.allow_overlap:
        raise CliError(refusal)
    figures: dict[str, Any] = {"import_margin_s": window.margin_s}
    if refusal is not None:
        figures["import_overlap_s"] = round(window.overlap_ms / 1000, 3)
        figures["flagged"] = "the import overlapped the measured window"
    return figures
