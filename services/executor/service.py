"""The executor service: consumes cronbus.deliveries, with health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from services.executor.audit import AuditWriter
from services.executor.events import Events
from services.executor.executor import Executor
from services.executor.targets import AmqpTargets, Webhooks
from shared import amqp, db, index, keys, transient
from shared.config import ExecutorSettings
from shared.service import Dependencies, Tasks
from shared.store import Store

log = logging.getLogger(__name__)


class ExecutorService:
    name = "executor"

    def __init__(self, settings: ExecutorSettings) -> None:
        self.settings = settings
        self.deps: Dependencies | None = None
        self.tasks: Tasks | None = None
        self.consuming = False
        self._messages: set[asyncio.Task[None]] = set()

    def readiness(self) -> dict[str, bool]:
        status = dict(self.deps.status) if self.deps else {}
        status["consuming"] = self.consuming
        # Deliveries go on while PostgreSQL is away (rows wait in memory): not a reason to
        # take this executor out of service.
        status.pop("postgres", None)
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
            lambda: amqp.connect(settings.amqp_url, "cronbus-executor"),
            what="rabbitmq",
            stopping=stopping,
        )
        webhooks = Webhooks(settings.http_connections_per_host)
        audit = AuditWriter(store, settings.audit_flush_ms, settings.audit_buffer_max)
        try:
            executor = Executor(
                settings,
                idx,
                webhooks,
                AmqpTargets(connection),
                audit,
                Events(connection, settings.events),
                stopping,
            )
            await self._serve(stopping, tasks, executor, idx, store, connection, audit)
        finally:
            left = await audit.close(timeout_s=5)
            if left:
                log.error("execution rows not written", extra={"rows": left})
            await webhooks.close()
            await connection.close()
            await store.close()
            await redis.aclose()

    async def _serve(
        self,
        stopping: asyncio.Event,
        tasks: Tasks,
        executor: Executor,
        idx: index.Index,
        store: Store,
        connection: AbstractRobustConnection,
        audit: AuditWriter,
    ) -> None:
        settings = self.settings
        channel = await connection.channel(publisher_confirms=True)
        await amqp.declare_topology(channel)
        await channel.set_qos(prefetch_count=settings.prefetch)
        self.deps = Dependencies(
            {
                "redis": idx.client.ping,
                "postgres": store.ping,
                "rabbitmq": lambda: _amqp_open(connection),
            }
        )
        tasks.start("dependencies", self.deps.watch(stopping))
        tasks.start("audit-writer", audit.run(stopping))
        queue = await channel.get_queue(keys.DELIVERIES_QUEUE, ensure=False)

        async def on_delivery(message: AbstractIncomingMessage) -> None:
            task = asyncio.create_task(executor.handle(message), name="delivery")
            self._messages.add(task)
            task.add_done_callback(self._messages.discard)

        consumer_tag = await queue.consume(on_delivery)
        self.consuming = True
        log.info("executor ready", extra={"action": "ready"})
        await stopping.wait()
        await self._shut_down(queue, consumer_tag, executor)
        await tasks.wait_all(5)

    async def _shut_down(self, queue: object, consumer_tag: str, executor: Executor) -> None:
        """Stop consuming, finish in-flight deliveries within the grace period, and hand the
        rest back to the broker (their leases are revoked by the redelivery's fencing)."""
        self.consuming = False
        with contextlib.suppress(*transient.ERRORS):
            await queue.cancel(consumer_tag)  # type: ignore[attr-defined]
        if self._messages:
            log.info(
                "finishing deliveries in flight",
                extra={"action": "draining", "messages": len(self._messages)},
            )
            _, pending = await asyncio.wait(self._messages, timeout=self.settings.shutdown_grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
        await executor.drain()


async def _amqp_open(connection: AbstractRobustConnection) -> None:
    if connection.is_closed:
        raise ConnectionError("RabbitMQ connection is closed")
