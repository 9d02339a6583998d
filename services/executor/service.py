"""The executor service: consumes cronbus.deliveries, with health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from services.executor.audit import AuditWriter
from services.executor.events import Events
from services.executor.executor import Executor
from services.executor.secrets import SigningSecrets
from services.executor.targets import AmqpTargets, Webhooks
from shared.rabbitmq import amqp
from shared.runtime import metrics, spans, transient
from shared.runtime.config import ExecutorSettings
from shared.runtime.service import ServiceBase, Tasks, finish_budget_s

log = logging.getLogger(__name__)


class ExecutorService(ServiceBase):
    name = "executor"

    def __init__(self, settings: ExecutorSettings) -> None:
        super().__init__(settings)
        self.settings = settings
        metrics.NAMESPACES.limit = settings.metrics_max_namespaces
        #: Read now, so that a bad file stops the start (SecretsError) before anything runs.
        self.signing_secrets = (
            SigningSecrets(settings.signing_secrets_file) if settings.signing_secrets_file else None
        )
        self.spans = spans.open_spans(settings.otlp_endpoint, self.name)
        self.consuming = False
        self._messages: set[asyncio.Task[None]] = set()
        self._executor: Executor | None = None
        self._audit: AuditWriter | None = None

    def left_behind(self) -> dict[str, int]:
        """Delivery messages not settled go back to the broker when the connection drops;
        occurrences still leased are reclaimed by the sweeper; audit rows are lost."""
        counts = super().left_behind()
        counts["delivery_messages"] = len(self._messages)
        counts["leased_occurrences"] = self._executor.holding() if self._executor else 0
        if self._audit is not None:
            counts["audit_rows"] = self._audit.pending
        return counts

    def readiness(self) -> dict[str, bool]:
        status = super().readiness()
        status["consuming"] = self.consuming
        # Deliveries go on while PostgreSQL is away (rows wait in memory): not a reason to
        # take this executor out of service.
        status.pop("postgres", None)
        return status

    async def run(self, stopping: asyncio.Event) -> None:
        settings, connections = self.settings, self.connections
        tasks = self.tasks = Tasks(stopping)
        webhooks = Webhooks.from_settings(settings, self.signing_secrets)
        webhooks.sampled = self.spans is not None
        audit: AuditWriter | None = None
        try:
            await connections.open(stopping, tasks)
            audit = self._audit = AuditWriter(
                connections.store, settings.audit_flush_ms, settings.audit_buffer_max
            )
            executor = self._executor = Executor(
                settings,
                connections.index,
                webhooks,
                AmqpTargets(
                    connections.amqp,
                    sampled=self.spans is not None,
                    policy=settings.exchange_policy(),
                ),
                audit,
                Events(connections.amqp, settings.events),
                stopping,
                spans=self.spans,
            )
            await self._serve(stopping, tasks, executor, audit)
        finally:
            if audit is not None:
                await audit.close(timeout_s=1)
            await webhooks.close()
            await connections.close()
            if self.spans is not None:
                await asyncio.to_thread(self.spans.shutdown)

    async def _serve(
        self, stopping: asyncio.Event, tasks: Tasks, executor: Executor, audit: AuditWriter
    ) -> None:
        settings = self.settings
        channel = await self.connections.amqp.channel(publisher_confirms=True)
        await amqp.declare_topology(channel)
        await channel.set_qos(prefetch_count=settings.prefetch)
        tasks.start("audit-writer", audit.run(stopping))
        tasks.start("lease-keeper", executor.run_lease_keeper(stopping))
        tasks.start("unpark", executor.parking.run(stopping))
        queue = await amqp.deliveries_queue_of(channel)

        async def on_delivery(message: AbstractIncomingMessage) -> None:
            task = asyncio.create_task(executor.handle(message), name="delivery")
            self._messages.add(task)
            task.add_done_callback(self._messages.discard)

        consumer_tag = await queue.consume(on_delivery)
        dead = await amqp.dead_deliveries_queue_of(channel)
        await dead.consume(executor.settle_dead_letter)
        self.consuming = True
        log.info("executor ready", extra={"action": "ready"})
        await stopping.wait()
        await self._shut_down(queue, consumer_tag, executor)
        await tasks.wait_all(1)

    async def _shut_down(self, queue: AbstractQueue, consumer_tag: str, executor: Executor) -> None:
        """Stop consuming, finish in-flight deliveries within the grace period, and hand the
        rest back: messages not started go back to the broker, occurrences cut off mid-way go
        straight back to due (so nothing stays leased until the sweeper notices)."""
        self.consuming = False
        with contextlib.suppress(TimeoutError, *transient.ERRORS):
            # With the broker away the cancel cannot be sent (nor is it needed).
            await asyncio.wait_for(queue.cancel(consumer_tag), 1)
        if self._messages:
            log.info(
                "finishing deliveries in flight",
                extra={"action": "draining", "messages": len(self._messages)},
            )
            _, pending = await asyncio.wait(
                self._messages, timeout=finish_budget_s(self.settings.shutdown_grace_s)
            )
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1)
        await executor.drain()
        await executor.release_abandoned()
