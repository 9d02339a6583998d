"""Invariant 9 on a Redis Cluster with replicas (3 primaries, a replica each): the replica of
the primary holding the most shards held back by a controlled lag while 80 commands are
answered, then that primary killed and its lagging replica promoted by the cluster. No
deleted or paused schedule fires after its reply, no moved schedule is called at its old URL,
every created schedule fires, no ``fire_all`` occurrence is lost; duplicates are counted.

Lags: 0.1 s, and 3 s (longer than the sweep interval of 2 s set here, and than the cluster's
node timeout: the replica is promoted all the same, see tests/support/cluster.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cronbus.cli.sink import Sink
from shared.policy import netpolicy
from tests.support import cluster, services
from tests.support.failover import run_lag_case

pytestmark = [pytest.mark.cluster, pytest.mark.failover, pytest.mark.timeout(180)]

SWEEP_INTERVAL_S = 2


@pytest.fixture
def replicated() -> Iterator[cluster.Cluster]:
    with cluster.redis_cluster(replicas=1) as found:
        yield found


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    found = Sink()
    await found.start()
    yield found
    await found.stop()


@pytest.mark.parametrize("lag_s", [0.1, SWEEP_INTERVAL_S + 1.0], ids=lambda s: f"lag-{s:g}s")
async def test_a_lagging_cluster_replica_promoted_undoes_no_answered_command(
    lag_s: float,
    replicated: cluster.Cluster,
    sink: Sink,
    amqp_url: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    env = {
        "CRONBUS_REDIS_URL": replicated.url,
        "CRONBUS_REDIS_CLUSTER": "true",
        "CRONBUS_REDIS_PREFIX": services.unique("lagc"),
        "CRONBUS_AMQP_URL": amqp_url,
        "CRONBUS_DATABASE_URL": database_url,
        "CRONBUS_SHARDS": "16",
        "CRONBUS_LEASE_S": "3",
        "CRONBUS_SWEEP_INTERVAL_S": str(SWEEP_INTERVAL_S),
        "CRONBUS_SHUTDOWN_GRACE_S": "5",
        "CRONBUS_EVENTS": "none",
        "CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS,
    }
    namespace = services.unique("ns").lower()
    figures = await run_lag_case(replicated, env, amqp_url, sink, tmp_path, lag_s, namespace)
    print(figures.line("cluster"))
    figures.assert_nothing_undone("cluster")
