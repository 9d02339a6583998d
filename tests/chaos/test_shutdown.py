"""SIGTERM while a dependency is unreachable: every service still exits within
CRONBUS_SHUTDOWN_GRACE_S (plus 2 s for the process to start and end its interpreter).

Each scenario starts the three services against private servers (tests/support/private.py),
takes one dependency away (down, frozen, or its vhost or database removed), waits until the
services that need it report it on /readyz, sends SIGTERM to all three at once and times each
exit. The measured stop times are printed (``pytest -s``) for the record.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from cronbus.cli.procs import SERVICES
from cronbus.cli.sink import Sink
from shared.contract import codec
from shared.policy import netpolicy
from tests.support import private, services
from tests.support import stack as stack_support
from tests.support.commands import CommandClient
from tests.support.stack import Proc, Stack

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]

GRACE_S = 5
#: Starting Python and unwinding the interpreter are not the service's to bound.
SLACK_S = 2


@pytest.fixture(scope="module")
def servers() -> Iterator[private.PrivateServices]:
    reason = private.available()
    if reason:
        pytest.fail(f"shutdown tests need private servers: {reason}")
    with private.private_services() as found:
        yield found


@dataclass
class Corner:
    """This test's vhost, database and key prefix on the private servers."""

    vhost: str
    database: str
    env: dict[str, str]


@pytest.fixture
async def corner(servers: private.PrivateServices) -> AsyncIterator[Corner]:
    vhost = services.unique("stop-")
    servers.rabbit.add_vhost(vhost)
    database = services.unique("stop_")
    yield Corner(
        vhost,
        database,
        {
            "CRONBUS_REDIS_URL": servers.redis.url,
            "CRONBUS_REDIS_PREFIX": services.unique("stop"),
            "CRONBUS_AMQP_URL": services.with_vhost(servers.rabbit.url, vhost),
            "CRONBUS_DATABASE_URL": services.with_database(servers.postgres.url, database),
            "CRONBUS_SHARDS": "4",
            # A sweep step (it reads PostgreSQL) certainly runs while the dependency is away.
            "CRONBUS_SWEEP_INTERVAL_S": "1",
            "CRONBUS_SHUTDOWN_GRACE_S": str(GRACE_S),
            "CRONBUS_LOG_LEVEL": "INFO",
            "CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS,
        },
    )
    delete = [*servers.rabbit.ctl, "delete_vhost", vhost]
    await asyncio.to_thread(subprocess.run, delete, check=False, capture_output=True)


@pytest.fixture
def stack(corner: Corner, tmp_path: Path) -> Iterator[Stack]:
    found = Stack(corner.env, tmp_path)
    yield found
    found.stop_all()


Fault = Callable[[private.PrivateServices, Corner], Awaitable[None]]


async def _drop_database(servers: private.PrivateServices, corner: Corner) -> None:
    conn = await asyncpg.connect(servers.postgres.url)
    try:
        await conn.execute(f'DROP DATABASE "{corner.database}" WITH (FORCE)')
    finally:
        await conn.close()


async def _delete_vhost(servers: private.PrivateServices, corner: Corner) -> None:
    await asyncio.to_thread(
        subprocess.run,
        [*servers.rabbit.ctl, "delete_vhost", corner.vhost],
        check=True,
        capture_output=True,
    )


def _redis_process(servers: private.PrivateServices) -> subprocess.Popen[bytes]:
    assert servers.redis.process is not None
    return servers.redis.process


async def _freeze_redis(servers: private.PrivateServices, _: Corner) -> None:
    # SIGSTOP: the port stays open and every call hangs (a slow server, not a down one).
    _redis_process(servers).send_signal(signal.SIGSTOP)


async def _stop_redis(servers: private.PrivateServices, _: Corner) -> None:
    await asyncio.to_thread(servers.redis.stop)


async def _stop_rabbitmq(servers: private.PrivateServices, _: Corner) -> None:
    await asyncio.to_thread(servers.rabbit.stop_app)


async def _stop_postgres(servers: private.PrivateServices, _: Corner) -> None:
    await asyncio.to_thread(servers.postgres.stop)


def _heal(servers: private.PrivateServices, fault: str) -> None:
    """Bring the dependency back for the next scenario."""
    if fault == "redis-frozen":
        _redis_process(servers).send_signal(signal.SIGCONT)
    elif fault == "redis-down":
        servers.redis.start()
    elif fault == "rabbitmq-down":
        servers.rabbit.start_app()
    elif fault == "postgres-down":
        servers.postgres.start()


#: fault -> (what takes the dependency away, the /readyz key that shows it)
FAULTS: dict[str, tuple[Fault, str]] = {
    "redis-down": (_stop_redis, "redis"),
    "redis-frozen": (_freeze_redis, "redis"),
    "rabbitmq-down": (_stop_rabbitmq, "rabbitmq"),
    "vhost-removed": (_delete_vhost, "rabbitmq"),
    "postgres-down": (_stop_postgres, "postgres"),
    "database-removed": (_drop_database, "postgres"),
}


async def _wait_reported(procs: list[Proc], dependency: str, timeout_s: float = 20) -> None:
    """Until each service that checks ``dependency`` reports it missing on /readyz: by then
    its reconnect loops and retries are running."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        while True:
            status, body = await asyncio.to_thread(proc.get, "/readyz")
            report = codec.loads(body) if status in (200, 503) else {}
            if report.get(dependency, False) is False:
                break
            assert time.monotonic() < deadline, f"{proc.name} never noticed: {body}"
            await asyncio.sleep(0.2)


def _last_stop_line(proc: Proc) -> dict[str, object]:
    for line in reversed(proc.log.read_text(errors="replace").splitlines()):
        if line.startswith("{") and '"service_stopped"' in line:
            found: dict[str, object] = codec.loads(line)
            return found
    raise AssertionError(f"{proc.name} logged no service_stopped line:\n{proc.tail()}")


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_sigterm_stops_every_service_within_the_grace_period(
    fault: str, servers: private.PrivateServices, corner: Corner, stack: Stack
) -> None:
    procs = [stack.start(name) for name in SERVICES]
    for proc in procs:
        await stack.wait_ready(proc)
    take_away, dependency = FAULTS[fault]
    try:
        await take_away(servers, corner)
        await _wait_reported(procs, dependency)
        await asyncio.sleep(1)  # a reconnect or retry is under way when the signal comes
        exits = await stack_support.time_exits(procs, GRACE_S + SLACK_S + 10)
    finally:
        await asyncio.to_thread(_heal, servers, fault)
    print(
        f"\nSIGTERM with {fault}: "
        + ", ".join(f"{name} {exits.get(name, float('inf')):.2f}s" for name in SERVICES)
        + f" (grace {GRACE_S}s)"
    )
    for proc in procs:
        took = exits.get(proc.name)
        assert took is not None and took <= GRACE_S + SLACK_S, (
            f"{proc.name} took {took}s to stop with {fault}:\n{proc.tail()}"
        )
        assert proc.popen.returncode == 0, proc.tail()
        stopped = _last_stop_line(proc)
        assert isinstance(stopped["left_behind"], dict), stopped


async def test_what_cannot_be_handed_back_is_logged_and_delivered_again_later(
    servers: private.PrivateServices, corner: Corner, stack: Stack
) -> None:
    """An executor stopped with deliveries in flight while Redis hangs cannot release its
    leases: it still exits in time, its last line counts what it left, and those
    occurrences are delivered again (same key) once Redis answers, as after a crash."""
    corner.env.update({"CRONBUS_LEASE_S": "3", "CRONBUS_SWEEP_INTERVAL_S": "1"})
    sink = Sink(delay_s=GRACE_S + 2)  # longer than the executor may wait for it
    await sink.start()
    try:
        for name in SERVICES:
            await stack.wait_ready(stack.start(name))
        async with CommandClient(corner.env["CRONBUS_AMQP_URL"]) as client:
            reply = await client.send(
                "left",
                "upsert",
                {
                    "schedule": {
                        "id": "slow",
                        "spec": {"kind": "interval", "every_s": 1},
                        "target": {"kind": "webhook", "url": f"{sink.url}/slow", "timeout_s": 30},
                        # Delivered late, not skipped: the test looks for it again.
                        "misfire": {"policy": "fire_all", "window_s": 3600, "limit": 100},
                    }
                },
            )
        assert reply["ok"], reply
        assert await sink.wait_for(lambda s: len(s.received) >= 1, 20), stack.tails()
        in_flight = {r.key for r in sink.received}
        executor = stack.running("executor")[0]
        _redis_process(servers).send_signal(signal.SIGSTOP)
        try:
            exits = await stack_support.time_exits([executor], GRACE_S + SLACK_S + 10)
        finally:
            _redis_process(servers).send_signal(signal.SIGCONT)
        took = exits.get("executor")
        print(f"\nSIGTERM executor holding deliveries, Redis frozen: {took}s")
        assert took is not None and took <= GRACE_S + SLACK_S, executor.tail()
        stopped = _last_stop_line(executor)
        left = stopped["left_behind"]
        assert isinstance(left, dict) and left.get("leased_occurrences", 0) >= 1, stopped
        assert stopped["cut_off"] is True, stopped
        sink.delay_s = 0
        await stack.wait_ready(stack.start("executor"))

        def delivered_again(s: Sink) -> bool:
            keys = [r.key for r in s.received]
            return all(keys.count(key) >= 2 for key in in_flight)

        assert await sink.wait_for(delivered_again, 30), stack.tails()
    finally:
        await sink.stop()
