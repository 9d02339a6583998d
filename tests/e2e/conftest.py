"""End-to-end fixtures: the services as processes, a local HTTP sink, a command client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest

from shared.policy import netpolicy
from tests.support import services
from tests.support.commands import CommandClient
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e


@pytest.fixture
def stack_env(
    endpoints: services.Endpoints, redis_prefix: str, amqp_url: str, database_url: str
) -> dict[str, str]:
    return {
        "CRONBUS_REDIS_URL": endpoints.redis_url,
        "CRONBUS_REDIS_PREFIX": redis_prefix,
        "CRONBUS_AMQP_URL": amqp_url,
        "CRONBUS_DATABASE_URL": database_url,
        "CRONBUS_SHARDS": "4",
        "CRONBUS_LOG_LEVEL": "INFO",
        "CRONBUS_SWEEP_INTERVAL_S": "1",
        "CRONBUS_SHUTDOWN_GRACE_S": "10",
        # The sinks the tests deliver to listen on loopback.
        "CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS,
    }


@pytest.fixture
def stack(
    stack_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Stack]:
    found = Stack(stack_env, tmp_path)
    yield found
    found.stop_all()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(found.tails())


@pytest.fixture
async def client(amqp_url: str) -> AsyncIterator[CommandClient]:
    async with CommandClient(amqp_url, app_id="e2e-tests") as found:
        yield found


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
