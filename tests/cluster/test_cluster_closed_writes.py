"""On a Redis Cluster (the layout whose failover stopped the services in CI), a write on a node
connection the server closed is retried as a ConnectionError, never leaked as uvloop's own
error: RedisCluster takes no connection_class, so its nodes' connections are set apart."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from shared.redis import connection
from shared.redis.errors import ClusterUnavailable
from shared.runtime import transient
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


@pytest.mark.parametrize("pipeline", [False, True], ids=["command", "pipeline"])
def test_a_cluster_with_no_node_answering_is_an_outage_to_wait_out(
    pipeline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # redis-py raises RedisClusterException when it cannot refresh the layout (no node
    # answers, or slots without a primary in a failover): not an outage to the services,
    # so it stopped them. It comes out as ClusterUnavailable, waited out like any outage;
    # not as a ConnectionError, which redis-py retries around a pipeline's refresh ten
    # times over (minutes when the nodes do not answer at all).
    refreshes = 0
    refresh = connection._OutageAwareNodes.initialize

    async def counted(self: connection._OutageAwareNodes, *args: Any, **kwargs: Any) -> None:
        nonlocal refreshes
        refreshes += 1
        await refresh(self, *args, **kwargs)

    monkeypatch.setattr(connection._OutageAwareNodes, "initialize", counted)

    async def case(found: cluster.Cluster) -> None:
        settings = CommonSettings(redis_url=found.url, redis_cluster=True)
        client = connection.connect(settings)
        assert isinstance(client, RedisCluster)
        try:
            assert await client.ping()
            for process in found.processes:
                process.kill()
                process.wait()
            before = refreshes
            with pytest.raises(transient.ERRORS) as raised:
                if pipeline:
                    async with client.pipeline(transaction=False) as pipe:
                        pipe.get("{1}x")
                        await pipe.execute()
                else:
                    await client.ping()
            assert isinstance(raised.value, ClusterUnavailable), repr(raised.value)
            assert refreshes - before <= 2, refreshes - before
        finally:
            await client.aclose()

    with (
        cluster.redis_cluster() as found,
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        runner.run(case(found))


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (RedisClusterException("Redis Cluster cannot be connected."), True),
        (RedisClusterException("All slots are not covered after query all startup_nodes."), True),
        (RedisClusterException("startup_nodes could not agree on a valid slots cache"), True),
        (RedisClusterException("Cluster mode is not enabled on this node"), False),
    ],
    ids=["no node answers", "slots uncovered", "nodes disagree", "not a cluster"],
)
def test_which_layout_refresh_failures_are_outages(
    error: RedisClusterException, outage: bool
) -> None:
    if "cannot be connected" in str(error):
        error.__cause__ = RedisConnectionError("Connection refused")
    assert connection.cluster_outage(error) is outage
