"""Invariant 9 on Redis Sentinel: the replica held back by a controlled lag (it receives
nothing from the primary for that long) while 80 commands are answered, then the primary
killed and the lagging replica promoted. No deleted or paused schedule fires after its reply,
no moved schedule is called at its old URL, every created schedule fires, no ``fire_all``
occurrence is lost; duplicates are counted and printed with the failover's figures.

Lags: 0.1 s, 1 s, and 3 s (longer than the sweep interval of 2 s set here)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cronbus.cli.sink import Sink
from tests.support import failover, sentinel, services
from tests.support.failover import run_lag_case

pytestmark = [pytest.mark.failover, pytest.mark.timeout(150)]

SWEEP_INTERVAL_S = 2


@pytest.fixture
def group() -> Iterator[sentinel.SentinelGroup]:
    with sentinel.sentinel_group() as found:
        yield found


@pytest.mark.parametrize("lag_s", [0.1, 1.0, SWEEP_INTERVAL_S + 1.0], ids=lambda s: f"lag-{s:g}s")
async def test_a_lagging_replica_promoted_undoes_no_answered_command(
    lag_s: float,
    group: sentinel.SentinelGroup,
    sink: Sink,
    amqp_url: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    env = failover.services_env(
        group.settings,
        services.unique("lag"),
        amqp_url,
        database_url,
        shards=4,
        sweep_interval_s=SWEEP_INTERVAL_S,
    )
    namespace = services.unique("ns").lower()
    figures = await run_lag_case(group, env, amqp_url, sink, tmp_path, lag_s, namespace)
    print(figures.line("sentinel"))
    figures.assert_nothing_undone("sentinel")
