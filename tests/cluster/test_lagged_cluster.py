"""Invariant 9 on a Redis Cluster with replicas (3 primaries, a replica each): the replica of
the primary holding the most shards held back by a controlled lag while 80 commands are
answered, then that primary killed and its lagging replica promoted by the cluster. No
deleted or paused schedule fires after its reply, no moved schedule is called at its old URL,
every created schedule fires, no ``fire_all`` occurrence is lost; duplicates are counted.

Lags: 0.1 s, and 3 s (longer than the sweep interval of 2 s set here, and than the cluster's
node timeout: the replica is promoted all the same, see tests/support/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cronbus.cli.sink import Sink
from tests.support import cluster, failover, services
from tests.support.failover import run_lag_case

pytestmark = [pytest.mark.cluster, pytest.mark.failover, pytest.mark.timeout(180)]

SWEEP_INTERVAL_S = 2


@pytest.fixture
def replicated() -> Iterator[cluster.Cluster]:
    with cluster.redis_cluster(replicas=1) as found:
        yield found


@pytest.mark.parametrize("lag_s", [0.1, SWEEP_INTERVAL_S + 1.0], ids=lambda s: f"lag-{s:g}s")
async def test_a_lagging_cluster_replica_promoted_undoes_no_answered_command(
    lag_s: float,
    replicated: cluster.Cluster,
    sink: Sink,
    amqp_url: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    env = failover.services_env(
        replicated.settings,
        services.unique("lagc"),
        amqp_url,
        database_url,
        shards=16,
        sweep_interval_s=SWEEP_INTERVAL_S,
    )
    namespace = services.unique("ns").lower()
    figures = await run_lag_case(replicated, env, amqp_url, sink, tmp_path, lag_s, namespace)
    print(figures.line("cluster"))
    figures.assert_nothing_undone("cluster")
