"""cronbus on a real 3-master Redis Cluster: the scripts, the pipeline, and a rebuild."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cronbus.cli.sink import Sink
from services.sweeper.sweeper import Sweeper
from shared.contract import keys
from shared.contract.entries import Completion, Upsert
from shared.policy import netpolicy
from shared.redis import connection
from shared.redis.index import Index
from shared.rules import compact
from shared.rules.plan import IntervalRule, Plan, WebhookPlan
from shared.runtime.config import CommonSettings, SweeperSettings
from tests.support import cluster, services
from tests.support.commands import CommandClient
from tests.support.stack import Stack

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[cluster.Cluster]:
    with cluster.redis_cluster() as found:
        yield found


@pytest.fixture
async def cluster_index(redis_cluster: cluster.Cluster) -> AsyncIterator[Index]:
    settings = CommonSettings(
        redis_url=redis_cluster.url,
        redis_cluster=True,
        redis_prefix=services.unique("cl"),
        shards=16,
    )
    client = connection.connect(settings)
    found = Index(client, keys.RedisKeys(settings.redis_prefix), settings.shards)
    await found.load_scripts()
    yield found
    await client.aclose()


async def test_each_shard_script_runs_on_its_node(cluster_index: Index) -> None:
    plan = compact.encode(Plan(1, IntervalRule(60_000), WebhookPlan("http://127.0.0.1:9/x")))
    now = int(time.time() * 1000)
    upserts: dict[int, list[Upsert]] = {}
    for i in range(200):
        shard = cluster_index.shard_of("ns", f"s{i}")
        upserts.setdefault(shard, []).append(Upsert(f"ns/s{i}", 1, plan, "keep", now - 5, ""))
    written = await cluster_index.upsert(upserts)
    assert sum(sum(codes) for codes in written.values()) == 200
    assert len(written) == 16  # every shard, spread over three nodes
    results = await cluster_index.claim(range(16), 1000, 30_000)
    claimed = [c for r in results for c in r.claimed]
    assert sorted(c.member for c in claimed) == sorted(f"ns/s{i}" for i in range(200))
    completions: dict[int, list[Completion]] = {}
    for c in claimed:
        completions.setdefault(c.shard, []).append(Completion(c.member, c.token, now + 60_000))
    done = await cluster_index.complete(completions)
    assert sum(sum(codes) for codes in done.values()) == 200
    again = await cluster_index.complete(completions)
    assert sum(sum(codes) for codes in again.values()) == 0  # stale tokens change nothing
    await cluster_index.client.script_flush()  # on every node: NOSCRIPT is recovered
    assert sum(len(r.claimed) for r in await cluster_index.claim(range(16), 10, 1000)) == 0


async def test_a_rebuild_knows_every_primary_s_run_id(
    redis_cluster: cluster.Cluster, cluster_index: Index
) -> None:
    # A restart of any node while a rebuild runs must be seen (its pages there may be gone).
    sweeper = Sweeper(
        SweeperSettings(redis_url=redis_cluster.url, redis_cluster=True, shards=16),
        cluster_index,
        None,  # type: ignore[arg-type]  # the run ids come from Redis alone
        asyncio.Event(),
    )
    found = await sweeper._redis_servers()
    assert found is not None and len(found) == len(redis_cluster.ports), found
    assert all(len(run_id) == 40 for run_id in found), found


@pytest.fixture
def cluster_env(redis_cluster: cluster.Cluster, amqp_url: str, database_url: str) -> dict[str, str]:
    return {
        "CRONBUS_REDIS_URL": redis_cluster.url,
        "CRONBUS_REDIS_CLUSTER": "true",
        "CRONBUS_REDIS_PREFIX": services.unique("clt"),
        "CRONBUS_AMQP_URL": amqp_url,
        "CRONBUS_DATABASE_URL": database_url,
        "CRONBUS_SWEEP_INTERVAL_S": "1",
        "CRONBUS_LEASE_S": "5",
        "CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS,
    }


async def test_the_pipeline_and_a_rebuild_on_a_cluster(
    redis_cluster: cluster.Cluster, cluster_env: dict[str, str], tmp_path: Path
) -> None:
    sink = Sink()
    await sink.start()
    stack = Stack(cluster_env, tmp_path)
    try:
        await stack.start_all(("dispatcher", "executor", "sweeper"))
        async with CommandClient(cluster_env["CRONBUS_AMQP_URL"]) as client:
            for i in range(20):
                reply = await client.send(
                    "cl",
                    "upsert",
                    {
                        "schedule": {
                            "id": f"c{i}",
                            "spec": {"kind": "interval", "every_s": 1},
                            "target": {"kind": "webhook", "url": f"{sink.url}/c{i}"},
                        }
                    },
                )
                assert reply["ok"], reply
        assert await sink.wait_for(lambda s: len({r.path for r in s.received}) == 20, 15), (
            stack.tails()
        )
        # The cluster loses everything: the sweeper rebuilds it from PostgreSQL.
        redis_cluster.flushall()
        flushed_at = time.time() * 1000
        assert await sink.wait_for(
            lambda s: len({r.path for r in s.received if r.at_ms > flushed_at + 2500}) == 20, 20
        ), stack.tails()
        assert any("index rebuilt" in p.tail(200) for p in stack.procs["sweeper"])
    finally:
        stack.stop_all()
        await sink.stop()
