"""Errors that mean "a dependency is away for now": wait and try again, never give up work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aio_pika.exceptions
import aiormq.exceptions
import asyncpg
from redis import exceptions as redis_errors

from shared.contract import errors, urls
from shared.redis.errors import ClusterUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    # 53300: the server's or a role's connection limit is reached; others will let go.
    asyncpg.TooManyConnectionsError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    # A database removed while the service runs (3D000 on reconnecting) is waited for like a
    # server that is down; only at start is it a refusal (``refusal`` is asked first there).
    asyncpg.InvalidCatalogNameError,
    # A connection the server dropped in the middle of an operation (its database removed)
    # is left in a state asyncpg refuses to reuse; a fresh connection is the cure.
    asyncpg.InternalClientError,
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    # A cluster in failover: slots without a primary for a moment (ClusterDownError,
    # SlotNotCoveredError), redirects that outran their count ("TTL exhausted"). A refresh
    # of the layout that failed for an outage is raised as ClusterUnavailable
    # (shared.redis.connection).
    redis_errors.ClusterError,
    redis_errors.SlotNotCoveredError,
    ClusterUnavailable,
    redis_errors.TryAgainError,
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aio_pika.exceptions.ChannelClosed,
    aio_pika.exceptions.ConnectionClosed,
)


#: Redis refusing what this user may do (ACLs).
_REDIS_REFUSALS = (redis_errors.AuthorizationError, redis_errors.NoPermissionError)
_AMQP_LOGIN_REFUSALS = (
    aiormq.exceptions.ProbableAuthenticationError,
    aiormq.exceptions.AuthenticationError,
)
#: PostgreSQL refusing the login (SQLSTATE 28xxx: unknown role, wrong password, pg_hba).
_POSTGRES_LOGIN_REFUSALS = (asyncpg.InvalidAuthorizationSpecificationError,)
#: A database that does not exist (3D000), a right the role lacks (42501).
_POSTGRES_REFUSALS = (asyncpg.InvalidCatalogNameError, asyncpg.InsufficientPrivilegeError)


def said(exc: BaseException) -> str:
    """An error for the log, with its message: redis-py's own repr leaves the message out, and
    the operator needs it (which slots, which address)."""
    return urls.masked(f"{type(exc).__name__}: {exc}")[:500]


class Stopped(Exception):
    """The service is stopping; the operation was not completed."""


def refusal(exc: BaseException) -> str | None:
    """Why a dependency refused the connection for good (retrying cannot fix it), or None.

    Wrong credentials, a RabbitMQ vhost or a PostgreSQL database that does not exist: the
    operator has to change a setting. A refused or timed-out connection is not a refusal: the
    server may come back.
    """
    for error in _chain(exc):
        if isinstance(error, redis_errors.AuthenticationError):
            return f"Redis refused the login: {error}"
        if isinstance(error, _REDIS_REFUSALS):
            return f"Redis refused a command to this user: {error}"
        if isinstance(error, _AMQP_LOGIN_REFUSALS):
            return "RabbitMQ refused the login (ACCESS_REFUSED): wrong user name or password"
        if isinstance(error, aiormq.exceptions.ConnectionNotAllowed):
            return f"RabbitMQ refused the virtual host: {_reply_text(error)}"
        if isinstance(error, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in str(
            error
        ):
            # RabbitMQ answers Connection.Open with Connection.Close (NOT_ALLOWED); aiormq
            # keeps only the frame's type, not its text.
            return (
                "RabbitMQ closed the connection on opening the virtual host: "
                "it does not exist or the user may not use it"
            )
        if isinstance(error, _POSTGRES_REFUSALS):
            return f"PostgreSQL: {error}"
        if isinstance(error, _POSTGRES_LOGIN_REFUSALS):
            return f"PostgreSQL refused the login: {error}"
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and those it was raised from (drivers wrap one another)."""
    found: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in found and len(found) < 5:
        found.append(current)
        current = current.__cause__ or current.__context__
    return found


def _reply_text(error: aiormq.exceptions.AMQPError) -> str:
    texts = [str(arg) for arg in error.args if isinstance(arg, str)]
    return texts[-1] if texts else type(error).__name__


async def retry(
    operation: Callable[[], Awaitable[T]],
    *,
    what: str,
    stopping: asyncio.Event | None = None,
    max_delay_s: float = 5.0,
    setting: str | None = None,
) -> T:
    """Run ``operation`` until it succeeds, waiting out dependency outages with backoff.

    Raises Stopped if the service stops while waiting: the wait between attempts ends as soon
    as ``stopping`` is set. With ``setting`` (the CRONBUS_* variable the dependency comes
    from), a refusal that retrying cannot fix raises errors.DependencyRefused naming it.
    """
    delay = 0.1
    while True:
        try:
            return await operation()
        except Exception as exc:
            reason = refusal(exc) if setting is not None else None
            if setting is not None and reason is not None:
                raise errors.DependencyRefused(setting, reason) from exc
            if not isinstance(exc, ERRORS):
                raise
            if stopping is not None and stopping.is_set():
                raise Stopped(what) from exc
            log.warning(
                "waiting for a dependency",
                extra={"action": "dependency_wait", "operation": what, "error": said(exc)},
            )
            await pause(delay, stopping)
            delay = min(delay * 2, max_delay_s)


async def pause(seconds: float, stopping: asyncio.Event | None) -> None:
    """Sleep ``seconds``, or less when the service starts stopping meanwhile."""
    if stopping is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


async def every(
    interval_s: float, step: Callable[[], Awaitable[object]], *, what: str, stopping: asyncio.Event
) -> None:
    """Run ``step`` every ``interval_s`` until stopping; a dependency outage skips a round."""
    while not stopping.is_set():
        try:
            await step()
        except ERRORS as exc:
            log.warning(
                "waiting for a dependency",
                extra={"action": "dependency_wait", "operation": what, "error": said(exc)},
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), interval_s)
