"""Fixtures: real Redis, RabbitMQ and PostgreSQL, each test in its own corner of them."""

from __future__ import annotations

import os

# A developer's own CRONBUS_* settings must not leak into the tests (CRONBUS_TEST_* are ours).
for _name in list(os.environ):
    if _name.startswith("CRONBUS_") and not _name.startswith("CRONBUS_TEST_"):
        del os.environ[_name]

from collections.abc import AsyncIterator, Iterator  # noqa: E402

import asyncpg  # noqa: E402
import pytest  # noqa: E402
import redis  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from hypothesis import settings  # noqa: E402

from cronbus.cli.sink import Sink  # noqa: E402
from shared.contract import keys  # noqa: E402
from shared.postgres import db  # noqa: E402
from shared.redis.index import Index  # noqa: E402
from tests.support import services  # noqa: E402

SHARDS = 4

# No time limit per hypothesis example (its default is 200 ms): three pytest workers share two
# cores with the services and the rabbitmqctl calls, and an example that waited for a core is
# then reported as a flaky test. Where time matters, the tests bound it themselves.
settings.register_profile("cronbus", deadline=None)
settings.load_profile("cronbus")

# The ledger goes first. Each worker takes whole files in collection order, so its three and a
# half minutes, collected near the end, left the other workers idle for most of them. (The chaos,
# failover and cluster files first as well ran those heavy files side by side: slower.)
LONGEST_FIRST = ("tests/ledger/",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next(
            (i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
            len(LONGEST_FIRST),
        )

    items.sort(key=rank)  # stable: within a rank, files and tests keep their order


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    """A local HTTP sink that records every delivery."""
    found = Sink()
    await found.start()
    yield found
    await found.stop()


@pytest.fixture(scope="session")
def endpoints() -> Iterator[services.Endpoints]:
    with services.endpoints() as found:
        yield found


@pytest.fixture
def redis_prefix(endpoints: services.Endpoints) -> Iterator[str]:
    """A key prefix of this test's own; whatever the test (or its services) wrote under it is
    deleted afterwards."""
    prefix = services.unique("cbt")
    yield prefix
    client = redis.Redis.from_url(endpoints.redis_url)
    try:
        doomed = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(doomed), 500):
            client.delete(*doomed[start : start + 500])
    finally:
        client.close()


@pytest.fixture
async def redis_client(
    endpoints: services.Endpoints, redis_prefix: str
) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(endpoints.redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def index(redis_client: aioredis.Redis, redis_prefix: str) -> Index:
    found = Index(redis_client, keys.RedisKeys(redis_prefix), SHARDS)
    await found.load_scripts()
    return found


@pytest.fixture(scope="session")
async def template_database(endpoints: services.Endpoints) -> AsyncIterator[str]:
    """A migrated database that each test's database is copied from (fast: no migrations)."""
    name = services.unique("cronbus_tpl_")
    url = services.with_database(endpoints.database_url, name)
    await db.migrate(url)
    yield name
    await _drop_database(endpoints.database_url, name)


@pytest.fixture
async def database_url(endpoints: services.Endpoints, template_database: str) -> AsyncIterator[str]:
    name = services.unique("cronbus_t_")
    conn = await asyncpg.connect(endpoints.database_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    finally:
        await conn.close()
    yield services.with_database(endpoints.database_url, name)
    await _drop_database(endpoints.database_url, name)


async def _drop_database(maintenance_url: str, name: str) -> None:
    conn = await asyncpg.connect(maintenance_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def vhosts(endpoints: services.Endpoints) -> Iterator[services.VhostPool]:
    pool = services.VhostPool(endpoints.rabbitmqctl)
    yield pool
    pool.close()


@pytest.fixture
def amqp_url(endpoints: services.Endpoints, vhosts: services.VhostPool) -> Iterator[str]:
    """A new vhost of this test's own (made ahead, deleted afterwards: see VhostPool)."""
    vhost = vhosts.take()
    yield services.with_vhost(endpoints.amqp_url, vhost)
    vhosts.give_back(vhost)
