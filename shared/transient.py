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

log = logging.getLogger(__name__)

T = TypeVar("T")

ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aio_pika.exceptions.ChannelClosed,
    aio_pika.exceptions.ConnectionClosed,
)


class Stopped(Exception):
    """The service is stopping; the operation was not completed."""


async def retry(
    operation: Callable[[], Awaitable[T]],
    *,
    what: str,
    stopping: asyncio.Event | None = None,
    max_delay_s: float = 5.0,
) -> T:
    """Run ``operation`` until it succeeds, waiting out dependency outages with backoff.

    Raises Stopped if the service stops while waiting.
    """
    delay = 0.1
    while True:
        try:
            return await operation()
        except ERRORS as exc:
            if stopping is not None and stopping.is_set():
                raise Stopped(what) from exc
            log.warning(
                "waiting for a dependency",
                extra={"action": "dependency_wait", "operation": what, "error": repr(exc)},
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)


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
                extra={"action": "dependency_wait", "operation": what, "error": repr(exc)},
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), interval_s)
