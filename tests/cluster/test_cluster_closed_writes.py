"""On a Redis Cluster (the layout whose failover stopped the services in CI), a write on a node
connection the server closed is retried as a ConnectionError, never leaked as uvloop's own
error: RedisCluster takes no connection_class, so its nodes' connections are set apart."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import uvloop
from redis.asyncio.cluster import RedisCluster

from shared.redis import connection
from shared.runtime.config import CommonSettings
from tests.support import cluster, services

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[cluster.Cluster]:
    with cluster.redis_cluster() as found:
        yield found


@pytest.mark.parametrize("pipeline", [False, True], ids=["command", "pipeline"])
def test_a_cluster_node_s_closed_connection_is_retried(
    redis_cluster: cluster.Cluster, pipeline: bool
) -> None:
    async def case() -> None:
        settings = CommonSettings(redis_url=redis_cluster.url, redis_cluster=True)
        client = connection.connect(settings)
        assert isinstance(client, RedisCluster)
        key = f"{services.unique('cw')}:{{1}}"
        try:
            await client.set(key, "1")
            node = client.get_node_from_key(key)
            assert node is not None
            for conn in node._free:
                assert conn._writer is not None
                conn._writer.transport.close()
            await asyncio.sleep(0.05)  # the loop tears the transports down
            if pipeline:
                async with client.pipeline(transaction=False) as pipe:
                    pipe.get(key)
                    assert await pipe.execute() == [b"1"]
            else:
                assert await client.get(key) == b"1"
        finally:
            await client.delete(key)
            await client.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(case())
