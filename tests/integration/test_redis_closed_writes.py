"""A write on a Redis connection that was closed under it fails as a ConnectionError, the error
every service waits out, never as the event loop's own error.

On uvloop (the services' loop), redis-py 8 lets a write on a transport the peer closed raise
RuntimeError ("the handler is closed"); during a Redis Cluster failover in CI that stopped a
dispatcher's shard-lease task and an executor's unpark task, and with them both services. The
connection is closed here as a dead server leaves it: the transport closed, the connection
object still thinking it is connected."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis.asyncio as aioredis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.redis import connection
from shared.runtime.config import DispatcherSettings
from tests.support import services


def on_uvloop(case: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(case())


async def _closed_under_it(conn: aioredis.Connection) -> None:
    await conn.connect()  # type: ignore[no-untyped-call]
    assert conn._writer is not None
    conn._writer.transport.close()
    await asyncio.sleep(0.05)  # the loop tears the transport down


def test_redis_py_alone_leaks_the_loops_error(endpoints: services.Endpoints) -> None:
    # The upstream behaviour this guards against: without the guard, the loop's own error.
    async def case() -> None:
        conn = _plain(endpoints.redis_url)
        await _closed_under_it(conn)
        with pytest.raises(RuntimeError, match="closed"):
            await conn.send_command("PING")
        await conn.disconnect()

    on_uvloop(case)


@pytest.mark.parametrize(
    "make", [connection.SafeConnection, connection.FastConnection], ids=lambda c: c.__name__
)
def test_a_write_on_a_closed_connection_is_a_connection_error(
    endpoints: services.Endpoints, make: type[aioredis.Connection]
) -> None:
    async def case() -> None:
        conn = _plain(endpoints.redis_url, make)
        await _closed_under_it(conn)
        with pytest.raises(RedisConnectionError, match="closed"):
            await conn.send_command("PING")
        # The connection is dropped and connects again on its next use.
        await conn.send_command("PING")
        assert await conn.read_response() in (b"PONG", "PONG")
        await conn.disconnect()

    on_uvloop(case)


@pytest.mark.parametrize("node", [False, True], ids=["index client", "node client"])
def test_the_services_clients_come_back_from_a_closed_connection(
    endpoints: services.Endpoints, node: bool
) -> None:
    # What the services see when the server closed a pooled connection: the next call works,
    # or fails as an outage they wait out; the one after it works.
    async def case() -> None:
        settings = DispatcherSettings(redis_url=endpoints.redis_url)
        client = connection.connect_node(settings) if node else connection.connect(settings)
        assert isinstance(client, aioredis.Redis)
        try:
            assert await client.ping()
            pooled = client.connection_pool._available_connections
            assert pooled, "the ping's connection went back to the pool"
            for conn in pooled:
                assert conn._writer is not None
                conn._writer.transport.close()
            await asyncio.sleep(0.05)
            # Retried on a fresh connection (the index client), or an outage to wait out (the
            # node client: pub/sub, tools).
            with contextlib.suppress(RedisConnectionError):
                assert await client.ping()
            assert await client.ping()
        finally:
            await client.aclose()

    on_uvloop(case)


def _plain(
    redis_url: str, make: type[aioredis.Connection] = aioredis.Connection
) -> aioredis.Connection:
    pool = aioredis.ConnectionPool.from_url(redis_url, connection_class=make, socket_timeout=5)
    return make(**pool.connection_kwargs)
