"""The dispatcher's wake-up listener outlives Redis: killed and started again, several times,
the listener subscribes again and hears the next wake-up (a dead listener once stopped the
whole dispatcher). On a private Redis, since the test kills it."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvloop

from services.dispatcher.service import _listen_for_wakes
from shared.redis import connection
from shared.runtime.config import DispatcherSettings
from tests.support.private import PrivateRedis
from tests.support.services import quiet_ports

CHANNEL = "wakes"


class Woken:
    """Stands in for the dispatcher: only its ``wake`` is called by the listener."""

    def __init__(self) -> None:
        self.at: list[int] = []
        self.heard = asyncio.Event()

    def wake(self, at_ms: int) -> None:
        self.at.append(at_ms)
        self.heard.set()


@pytest.fixture
async def private_redis() -> AsyncIterator[PrivateRedis]:
    with tempfile.TemporaryDirectory(prefix="cronbus-wakes-") as directory:
        # Outside the ephemeral range: the server restarts on this port.
        server = PrivateRedis(quiet_ports(1), Path(directory))
        await asyncio.to_thread(server.start)
        try:
            yield server
        finally:
            await asyncio.to_thread(server.stop)


async def _heard(woken: Woken, publisher_url: str, value: int, timeout_s: float) -> bool:
    """Publish ``value`` until the listener hears it (it may be resubscribing)."""
    publisher = connection.connect(DispatcherSettings(redis_url=publisher_url))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while loop.time() < deadline:
            woken.heard.clear()
            try:
                await publisher.publish(CHANNEL, str(value))
            except Exception:  # noqa: BLE001 - the server is coming back
                await asyncio.sleep(0.2)
                continue
            try:
                await asyncio.wait_for(woken.heard.wait(), 0.5)
            except TimeoutError:
                continue
            if value in woken.at:
                return True
        return False
    finally:
        await publisher.aclose()


async def _dropping_connections(port: int, seconds: float) -> None:
    """Accept on ``port`` for ``seconds``, closing every connection as soon as it opens."""

    def drop(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    server = await asyncio.start_server(drop, "127.0.0.1", port, reuse_address=True)
    try:
        await asyncio.sleep(seconds)
    finally:
        server.close()
        await server.wait_closed()


def test_the_wake_listener_hears_again_after_redis_is_killed(
    private_redis: PrivateRedis,
) -> None:
    # The services run on uvloop, where the failure was seen: so does this test.
    async def scenario() -> None:
        settings = DispatcherSettings(redis_url=private_redis.url)
        client = connection.connect(settings)
        woken = Woken()
        stopping = asyncio.Event()
        listener = asyncio.create_task(
            _listen_for_wakes(client, CHANNEL, woken, stopping)  # type: ignore[arg-type]
        )
        try:
            assert await _heard(woken, private_redis.url, 1, 10)
            for round_ in range(2, 5):
                await asyncio.to_thread(private_redis.stop)
                # While the server is away its port accepts and drops each connection at once,
                # as a dying server does: the listener's reconnect then writes to a closed
                # transport (uvloop raises RuntimeError for that, not a connection error).
                await _dropping_connections(private_redis.port, 1.5)
                await asyncio.to_thread(private_redis.start)
                assert await _heard(woken, private_redis.url, round_, 20), (
                    f"no wake-up heard after restart {round_ - 1}"
                )
                assert not listener.done(), listener
        finally:
            stopping.set()
            await asyncio.wait_for(listener, 5)
            await client.aclose()

    uvloop.run(scenario())
