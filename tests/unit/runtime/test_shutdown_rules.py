"""What a stopping or starting service decides without I/O: which connection errors no
retry can fix, how the grace period is shared, and that retries give way to a stop."""

from __future__ import annotations

import asyncio
import time

import aiormq.exceptions
import asyncpg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis import exceptions as redis_errors

from shared.contract import errors
from shared.runtime import service, transient

VHOST_CLOSED = aiormq.exceptions.InvalidFrameError(
    "Expected one of ['Connection.OpenOk'], got <Connection.Close object at 0x7f5ee7b6b3b0>"
)


@pytest.mark.parametrize(
    ("error", "starts"),
    [
        (redis_errors.AuthenticationError("invalid username-password pair"), "Redis refused"),
        (redis_errors.AuthenticationError("NOAUTH Authentication required."), "Redis refused"),
        (redis_errors.NoPermissionError("NOPERM no permissions to run 'evalsha'"), "Redis refused"),
        (
            aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED - Login was refused"),
            "RabbitMQ refused the login",
        ),
        (VHOST_CLOSED, "RabbitMQ closed the connection on opening the virtual host"),
        (
            aiormq.exceptions.ConnectionNotAllowed(530, "NOT_ALLOWED - vhost x not found"),
            "RabbitMQ refused the virtual host: NOT_ALLOWED - vhost x not found",
        ),
        (asyncpg.InvalidCatalogNameError('database "x" does not exist'), "PostgreSQL: database"),
        (asyncpg.InvalidPasswordError("password authentication failed"), "PostgreSQL refused"),
        (
            # cronbus creates a missing database at start: a role that may not is told so.
            asyncpg.InsufficientPrivilegeError("permission denied to create database"),
            "PostgreSQL: permission denied",
        ),
        (
            asyncpg.InvalidAuthorizationSpecificationError('role "x" does not exist'),
            "PostgreSQL refused the login",
        ),
    ],
)
def test_refusals_that_no_retry_fixes_are_named(error: Exception, starts: str) -> None:
    reason = transient.refusal(error)
    assert reason is not None and reason.startswith(starts), reason


def test_a_refusal_wrapped_by_another_error_is_still_found() -> None:
    try:
        try:
            raise VHOST_CLOSED
        except aiormq.exceptions.InvalidFrameError as inner:
            raise ConnectionError("connect failed") from inner
    except ConnectionError as outer:
        assert transient.refusal(outer) is not None


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "Connect call failed"),
        TimeoutError(),
        redis_errors.ConnectionError("Error 111 connecting"),
        redis_errors.TimeoutError("Timeout reading from socket"),
        aiormq.exceptions.AMQPConnectionError(111, "Connect call failed"),
        aiormq.exceptions.InvalidFrameError("No frame length"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed"),
    ],
)
def test_an_outage_is_not_a_refusal(error: Exception) -> None:
    assert transient.refusal(error) is None


@given(st.integers(0, 200), st.text(max_size=50))
def test_no_socket_error_is_a_refusal(errno: int, message: str) -> None:
    assert transient.refusal(OSError(errno, message)) is None


@given(st.floats(0, 600, allow_nan=False))
def test_the_work_under_way_gets_at_most_the_grace_period_and_at_least_half(
    grace_s: float,
) -> None:
    budget = service.finish_budget_s(grace_s)
    assert grace_s / 2 <= budget <= grace_s
    if grace_s >= 2 * (service.HAND_BACK_RESERVE_S + service.CUT_OFF_RESERVE_S):
        # Long enough a period keeps the whole reserve for handing back and cutting off.
        assert budget == pytest.approx(
            grace_s - service.HAND_BACK_RESERVE_S - service.CUT_OFF_RESERVE_S
        )


async def test_a_refusal_at_start_is_not_retried() -> None:
    calls = 0

    async def connect() -> None:
        nonlocal calls
        calls += 1
        raise redis_errors.AuthenticationError("WRONGPASS invalid username-password pair")

    with pytest.raises(errors.DependencyRefused) as raised:
        await transient.retry(connect, what="redis", setting="CRONBUS_REDIS_URL")
    assert calls == 1
    assert raised.value.setting == "CRONBUS_REDIS_URL"
    assert "WRONGPASS" in raised.value.reason


async def test_a_retry_gives_way_as_soon_as_the_service_stops() -> None:
    stopping = asyncio.Event()
    calls = 0

    async def write() -> None:
        nonlocal calls
        calls += 1
        raise redis_errors.ConnectionError("Error 111 connecting")

    async def stop_soon() -> float:
        await asyncio.sleep(2.0)  # by then the backoff sleeps 1.6 s between attempts
        stopping.set()
        return time.monotonic()

    stopper = asyncio.create_task(stop_soon())
    with pytest.raises(transient.Stopped):
        await transient.retry(write, what="index write", stopping=stopping, max_delay_s=60)
    stopped_at = await stopper
    assert time.monotonic() - stopped_at < 0.5
    assert calls >= 4


async def test_a_pause_ends_when_the_service_stops() -> None:
    stopping = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stopping.set)
    started = time.monotonic()
    await transient.pause(60, stopping)
    assert time.monotonic() - started < 1


async def test_a_database_removed_while_running_is_waited_for_not_a_dead_loop() -> None:
    """Reconnecting to a database that was dropped raises 3D000: a periodic loop (the
    sweeper's) skips the round and goes on, as while PostgreSQL is down; the service stays
    up, reports PostgreSQL down on /readyz and stops cleanly on SIGTERM."""
    stopping = asyncio.Event()
    rounds = 0

    async def step() -> None:
        nonlocal rounds
        rounds += 1
        if rounds == 3:
            stopping.set()
        raise asyncpg.InvalidCatalogNameError('database "x" does not exist')

    await asyncio.wait_for(
        transient.every(0.01, step, what="sweep step", stopping=stopping), timeout=5
    )
    assert rounds == 3


async def test_a_database_missing_at_start_is_still_a_refusal() -> None:
    async def connect() -> None:
        raise asyncpg.InvalidCatalogNameError('database "x" does not exist')

    with pytest.raises(errors.DependencyRefused) as raised:
        await transient.retry(connect, what="postgres", setting="CRONBUS_DATABASE_URL")
    assert raised.value.setting == "CRONBUS_DATABASE_URL"
