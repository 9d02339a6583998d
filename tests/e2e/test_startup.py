"""Start-up against a dependency that refuses the service for good (wrong credentials, a
vhost or database that does not exist): one line naming the setting and the reason, a
non-zero exit, within seconds. One that is only away (connection refused) is waited for."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from cronbus.cli.procs import SERVICES
from tests.support import services
from tests.support.stack import Stack, time_exits

GRACE_S = 5
#: Starting Python and unwinding the interpreter are not the service's to bound.
SLACK_S = 2
#: A refusal is reported at once; a few seconds cover starting Python on a busy machine.
REFUSED_WITHIN_S = 10


def _with_login(url: str, login: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{login}@{host}", parts.path, parts.query, ""))


@pytest.fixture(scope="module")
async def good_database(
    endpoints: services.Endpoints, template_database: str
) -> AsyncIterator[str]:
    """One migrated database for the module: the dependencies reached before the refused
    one must work (no test writes to it)."""
    name = services.unique("cronbus_start_")
    conn = await asyncpg.connect(endpoints.database_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
        yield services.with_database(endpoints.database_url, name)
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


def _refusals(
    endpoints: services.Endpoints, database_url: str
) -> dict[str, tuple[str, dict[str, str]]]:
    """case -> (the setting the line must name, the environment that provokes it).

    Services connect to PostgreSQL, Redis, then RabbitMQ: a refused broker is reached with
    the others working, and the broker is never logged in to (no vhost of the test's own).
    """
    amqp_url = endpoints.amqp_url
    good = {
        "CRONBUS_REDIS_URL": endpoints.redis_url,
        "CRONBUS_REDIS_PREFIX": services.unique("cbt"),
        "CRONBUS_AMQP_URL": amqp_url,
        "CRONBUS_DATABASE_URL": database_url,
    }
    return {
        "amqp-wrong-password": (
            "CRONBUS_AMQP_URL",
            {**good, "CRONBUS_AMQP_URL": _with_login(amqp_url, "guest:not-the-password")},
        ),
        "amqp-missing-vhost": (
            "CRONBUS_AMQP_URL",
            {**good, "CRONBUS_AMQP_URL": services.with_vhost(amqp_url, "no-such-vhost-cbt")},
        ),
        "postgres-missing-database": (
            "CRONBUS_DATABASE_URL",
            {
                **good,
                "CRONBUS_DATABASE_URL": services.with_database(database_url, "no_such_db_cbt"),
                "CRONBUS_MIGRATE_ON_START": "false",
            },
        ),
        "postgres-unknown-role": (
            "CRONBUS_DATABASE_URL",
            {**good, "CRONBUS_DATABASE_URL": _with_login(database_url, "no_such_role_cbt")},
        ),
        "redis-wrong-password": (
            "CRONBUS_REDIS_URL",
            {**good, "CRONBUS_REDIS_URL": _with_login(endpoints.redis_url, "nobody:secret")},
        ),
    }


CASES = [
    (service, case)
    for case in (
        "amqp-wrong-password",
        "amqp-missing-vhost",
        "postgres-missing-database",
        "postgres-unknown-role",
        "redis-wrong-password",
    )
    for service in SERVICES
    if not (case.startswith("amqp") and service == "sweeper")  # the sweeper needs no broker
]


@pytest.mark.parametrize(("service", "case"), CASES)
def test_a_refused_connection_stops_the_start_with_one_line(
    service: str, case: str, endpoints: services.Endpoints, good_database: str
) -> None:
    setting, env = _refusals(endpoints, good_database)[case]
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", f"services.{service}"],
        env={**os.environ, **env, "CRONBUS_METRICS_PORT": "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    took = time.monotonic() - started
    naming = [line for line in result.stderr.splitlines() if setting in line]
    assert result.returncode == 2, result.stderr
    assert naming == [naming[0]] and naming[0].startswith(f"cronbus {service}: {setting}: "), (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert "secret" not in result.stderr and "not-the-password" not in result.stderr
    assert took < REFUSED_WITHIN_S, (took, result.stderr)
    print(f"\n{service} {case}: {naming[0]} ({took:.1f}s)")


@pytest.fixture
def closed() -> Iterator[int]:
    """A port nothing listens on during the test (a free one could be taken meanwhile by a
    server of the other pytest worker's, which the services would then reach)."""
    with services.closed_port() as port:
        yield port


async def test_a_dependency_that_is_only_away_is_waited_for(tmp_path: Path, closed: int) -> None:
    """Connection refused is not a refusal: each service waits, says so on /readyz, and
    still stops on SIGTERM within the grace period."""
    stack = Stack(
        {
            "CRONBUS_REDIS_URL": f"redis://127.0.0.1:{closed}/0",
            "CRONBUS_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{closed}/x",
            "CRONBUS_AMQP_URL": f"amqp://guest:guest@127.0.0.1:{closed}/",
            "CRONBUS_SHUTDOWN_GRACE_S": str(GRACE_S),
        },
        tmp_path,
    )
    try:
        procs = [stack.start(name) for name in SERVICES]
        deadline = time.monotonic() + 30
        for proc in procs:
            while (await asyncio.to_thread(proc.get, "/readyz"))[0] != 503:
                assert proc.alive(), proc.tail()
                assert time.monotonic() < deadline, proc.tail()
                await asyncio.sleep(0.2)
        await asyncio.sleep(2)
        assert all(proc.alive() for proc in procs), stack.tails()
        exits = await time_exits(procs, GRACE_S + SLACK_S + 10)
    finally:
        stack.stop_all()
    for proc in procs:
        assert exits.get(proc.name, float("inf")) <= GRACE_S + SLACK_S, proc.tail()
        assert proc.popen.returncode == 0, proc.tail()


#: Seconds after the interpreter is up at which SIGTERM comes: while the service imports its
#: libraries, reads its settings, connects, and once it runs.
SIGTERM_DELAYS_S = (0.05, 0.2, 0.5, 1.0, 2.5)


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux /proc: SigCgt)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.parametrize("service", SERVICES)
async def test_sigterm_at_any_moment_of_the_start_is_a_clean_stop(
    service: str, stack_env: dict[str, str], tmp_path: Path
) -> None:
    """A pod may be deleted while its service is still starting: SIGTERM at any moment ends
    in exit status 0 within the grace period, never in death by the signal (-15)."""
    stack = Stack({**stack_env, "CRONBUS_SHUTDOWN_GRACE_S": str(GRACE_S)}, tmp_path)
    try:
        for delay_s in SIGTERM_DELAYS_S:
            proc = stack.start(service)
            deadline = time.monotonic() + 20
            # The service's first line catches SIGTERM (stopsignal.catch); before it only the
            # interpreter's own start runs (site, .pth files), which no code of ours can guard.
            # Waiting for SIGINT instead raced that start on a busy machine.
            while not _catches(proc.pid, signal.SIGTERM):
                assert proc.alive() and time.monotonic() < deadline, proc.tail()
                await asyncio.sleep(0.005)
            await asyncio.sleep(delay_s)
            exits = await time_exits([proc], GRACE_S + SLACK_S + 10)
            took = exits.get(service, float("inf"))
            assert proc.popen.returncode == 0, (delay_s, proc.popen.returncode, proc.tail())
            assert took <= GRACE_S + SLACK_S, (delay_s, took, proc.tail())
    finally:
        stack.stop_all()


@pytest.mark.parametrize("service", SERVICES)
def test_sigterm_while_a_refused_service_exits_keeps_its_exit_status(
    service: str, endpoints: services.Endpoints, good_database: str
) -> None:
    """A service that refused to start and is exiting is still told to stop (a supervisor
    giving up on it): its exit status stays 2, naming the refusal, not death by the signal."""
    _, env = _refusals(endpoints, good_database)["postgres-missing-database"]
    proc = subprocess.Popen(
        [sys.executable, "-m", f"services.{service}"],
        env={**os.environ, **env, "CRONBUS_METRICS_PORT": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if b"CRONBUS_DATABASE_URL" in line:
                break
        # From the refusal line on, SIGTERM every few milliseconds until the process is gone.
        deadline = time.monotonic() + REFUSED_WITHIN_S
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            time.sleep(0.002)
        assert proc.wait(REFUSED_WITHIN_S) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
