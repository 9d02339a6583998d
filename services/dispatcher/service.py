"""The dispatcher service: command intake plus the claim loop, with health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import redis.asyncio as aioredis
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from services.dispatcher.dispatcher import Dispatcher
from services.dispatcher.intake import Intake
from shared import amqp, db, index, keys, transient
from shared.config import DispatcherSettings
from shared.service import Dependencies, Tasks
from shared.store import Store

log = logging.getLogger(__name__)


class DispatcherService:
    name = "dispatcher"

    def __init__(self, settings: DispatcherSettings) -> None:
        self.settings = settings
        self.deps: Dependencies | None = None
        self.tasks: Tasks | None = None
        self.consuming = False
        self._commands: set[asyncio.Task[None]] = set()

    def readiness(self) -> dict[str, bool]:
        status = dict(self.deps.status) if self.deps else {}
        status["consuming"] = self.consuming
        return status

    def alive(self) -> bool:
        return self.tasks is None or self.tasks.alive()

    async def run(self, stopping: asyncio.Event) -> None:
        settings = self.settings
        tasks = self.tasks = Tasks(stopping)
        if settings.migrate_on_start:
            await transient.retry(
                lambda: db.migrate(settings.database_url), what="migrate", stopping=stopping
            )
        redis = index.connect(settings)
        idx = index.Index(redis, keys.RedisKeys(settings.redis_prefix), settings.shards)
        await transient.retry(idx.load_scripts, what="redis", stopping=stopping)
        store = await transient.retry(
            lambda: Store.open(settings.database_url), what="postgres", stopping=stopping
        )
        connection = await transient.retry(
            lambda: amqp.connect(settings.amqp_url, "cronbus-dispatcher"),
            what="rabbitmq",
            stopping=stopping,
        )
        pubsub_client = aioredis.Redis.from_url(settings.redis_url)
        try:
            await self._serve(stopping, tasks, idx, store, connection, pubsub_client)
        finally:
            await connection.close()
            await store.close()
            await pubsub_client.aclose()
            await redis.aclose()

    async def _serve(
        self,
        stopping: asyncio.Event,
        tasks: Tasks,
        idx: index.Index,
        store: Store,
        connection: AbstractRobustConnection,
        pubsub_client: aioredis.Redis,
    ) -> None:
        settings = self.settings
        publish_channel = await connection.channel(publisher_confirms=True)
        await amqp.declare_topology(publish_channel)
        dispatcher = Dispatcher(settings, idx, publish_channel, stopping)
        wake_channel = idx.keys.wake_channel

        async def wake(shard: int, fire_ms: int) -> None:
            dispatcher.wake(fire_ms)
            with contextlib.suppress(*transient.ERRORS):
                await pubsub_client.publish(wake_channel, str(fire_ms))

        command_channel = await connection.channel(publisher_confirms=True)
        await command_channel.set_qos(prefetch_count=settings.commands_prefetch)
        intake = Intake(settings, store, idx, command_channel, wake, stopping)
        self.deps = Dependencies(
            {
                "redis": idx.client.ping,
                "postgres": store.ping,
                "rabbitmq": lambda: _amqp_open(connection),
            }
        )
        tasks.start("dependencies", self.deps.watch(stopping))
        tasks.start("claim-loop", dispatcher.run())
        tasks.start(
            "wake-listener", _listen_for_wakes(pubsub_client, wake_channel, dispatcher, stopping)
        )
        tasks.start("backlog-report", dispatcher.report_backlog())
        queue = await command_channel.get_queue(keys.COMMANDS_QUEUE, ensure=False)

        async def on_command(message: AbstractIncomingMessage) -> None:
            task = asyncio.create_task(intake.handle(message), name="command")
            self._commands.add(task)
            task.add_done_callback(self._commands.discard)

        consumer_tag = await queue.consume(on_command)
        self.consuming = True
        log.info("dispatcher ready", extra={"action": "ready", "shards": settings.shards})
        await stopping.wait()
        self.consuming = False
        with contextlib.suppress(*transient.ERRORS):
            await queue.cancel(consumer_tag)
        if self._commands:
            await asyncio.wait(self._commands, timeout=settings.shutdown_grace_s)
        await tasks.wait_all(settings.shutdown_grace_s)


async def _amqp_open(connection: AbstractRobustConnection) -> None:
    if connection.is_closed:
        raise ConnectionError("RabbitMQ connection is closed")


async def _listen_for_wakes(
    client: aioredis.Redis, channel: str, dispatcher: Dispatcher, stopping: asyncio.Event
) -> None:
    """Wake-ups published by intakes in other dispatcher processes."""
    while not stopping.is_set():
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(channel)
                while not stopping.is_set():
                    message: Any = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=1.0
                    )
                    if message and message.get("type") == "message":
                        with contextlib.suppress(ValueError):
                            dispatcher.wake(int(message["data"]))
        except transient.ERRORS:
            await asyncio.sleep(1.0)
