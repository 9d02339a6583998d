"""Fixtures the integration tests share: a store, a broker connection with the topology, a sink;
and ``no_wake``, the claim-loop wake-up of an intake in a test that runs no claim loop."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection

from shared.postgres.store import Store
from shared.rabbitmq import amqp


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    found = await Store.open(database_url)
    yield found
    await found.close()


@pytest.fixture
async def connection(amqp_url: str) -> AsyncIterator[AbstractRobustConnection]:
    found = await aio_pika.connect_robust(amqp_url)
    channel = await found.channel()
    await amqp.declare_topology(channel)
    yield found
    await found.close()


async def no_wake(shard: int, fire_ms: int) -> None:
    return None
