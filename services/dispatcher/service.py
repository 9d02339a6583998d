"""The dispatcher service: command intake plus the claim loop, with health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import redis.asyncio as aioredis

from services.dispatcher.dispatcher import Dispatcher
from services.dispatcher.fence import Fence
from services.dispatcher.intake import Intake
from services.dispatcher.intake.reply_queues import ReplyQueues
from services.dispatcher.leases import ShardLeases
from services.dispatcher.partitions import PartitionConsumers
from services.dispatcher.router import Router
from shared.rabbitmq import amqp
from shared.redis import connection
from shared.runtime import metrics, spans, transient
from shared.runtime.config import DispatcherSettings
from shared.runtime.service import ServiceBase, Tasks, finish_budget_s

log = logging.getLogger(__name__)


class DispatcherService(ServiceBase):
    name = "dispatcher"

    def __init__(self, settings: DispatcherSettings) -> None:
        super().__init__(settings)
        self.settings = settings
        self.spans = spans.open_spans(settings.otlp_endpoint, self.name)
        self.consuming = False
        self._partitions: PartitionConsumers | None = None
        self._dispatcher: Dispatcher | None = None
        self._reply_queues: ReplyQueues | None = None

    def left_behind(self) -> dict[str, int]:
        """Commands not answered go back to the broker when the connection drops (a replay
        is recognised); occurrences claimed and not published are reclaimed by the sweeper."""
        counts = super().left_behind()
        counts["commands"] = self._partitions.under_way if self._partitions else 0
        counts["claimed_occurrences"] = self._dispatcher.publishing if self._dispatcher else 0
        return counts

    def readiness(self) -> dict[str, bool]:
        status = super().readiness()
        status["consuming"] = self.consuming
        return status

    async def run(self, stopping: asyncio.Event) -> None:
        tasks = self.tasks = Tasks(stopping)
        # Wake-ups travel over pub/sub on a plain connection (a cluster node relays them).
        pubsub_client = connection.connect_node(self.settings)
        try:
            await self.connections.open(stopping, tasks)
            await self._serve(stopping, tasks, pubsub_client)
        finally:
            await self.connections.close()
            await pubsub_client.aclose()
            if self.spans is not None:
                await asyncio.to_thread(self.spans.shutdown)

    async def _serve(
        self, stopping: asyncio.Event, tasks: Tasks, pubsub_client: aioredis.Redis
    ) -> None:
        settings, connections = self.settings, self.connections
        publish_channel = await connections.amqp.channel(publisher_confirms=True)
        await amqp.declare_topology(publish_channel)
        fence = Fence()
        dispatcher = self._dispatcher = Dispatcher(
            settings, connections.index, publish_channel, stopping, spans=self.spans, fence=fence
        )
        wake_channel = connections.index.keys.wake_channel

        async def wake(shard: int, fire_ms: int) -> None:
            dispatcher.wake(fire_ms)
            with contextlib.suppress(*transient.ERRORS):
                await pubsub_client.publish(wake_channel, str(fire_ms))

        # Replies and dead letters; commands arrive on each partition's own channel.
        command_channel = await connections.amqp.channel(publisher_confirms=True)
        await amqp.declare_partitions(command_channel, settings.command_partitions)
        # Reply queue checks on a connection of their own (a refused check closes its channel).
        reply_queues = self._reply_queues = ReplyQueues(settings.amqp_url)
        intake = Intake(
            settings,
            connections.store,
            connections.index,
            command_channel,
            wake,
            stopping,
            reply_queues=reply_queues,
            fence=fence,
        )
        tasks.start(
            "answered-positions",
            fence.follow(connections.store.pool, settings.position_check_s, stopping),
        )
        partitions = self._partitions = PartitionConsumers(
            connections.amqp, intake.handle, settings.commands_prefetch
        )
        self._lease_work(dispatcher, partitions, tasks, stopping)
        tasks.start("claim-loop", dispatcher.run())
        tasks.start(
            "wake-listener", _listen_for_wakes(pubsub_client, wake_channel, dispatcher, stopping)
        )
        tasks.start("backlog-report", dispatcher.report_backlog())
        tasks.start("command-partitions", partitions.run(stopping))
        router = Router(settings, stopping, intake.answers.reply, reply_queues.answerable)
        tasks.start("command-router", router.run())
        self.consuming = True
        log.info("dispatcher ready", extra={"action": "ready", "shards": settings.shards})
        await stopping.wait()
        await self._shut_down(partitions, tasks)

    def _lease_work(
        self,
        dispatcher: Dispatcher,
        partitions: PartitionConsumers,
        tasks: Tasks,
        stopping: asyncio.Event,
    ) -> None:
        """Shards to claim from and commands partitions to consume, each dispatcher its share
        (without leases: all of them)."""
        settings, index = self.settings, self.connections.index
        if settings.shard_lease_s <= 0:
            metrics.SHARDS_OWNED.set(settings.shards)
            partitions.use(list(range(settings.command_partitions)))
            metrics.PARTITIONS_OWNED.set(settings.command_partitions)
            return
        dispatcher.shards = []  # until the first leases are taken
        shards = ShardLeases(
            index, settings.shards, settings.shard_lease_s, on_change=dispatcher.use_shards
        )
        tasks.start("shard-leases", shards.run(stopping))
        partition_leases = ShardLeases(
            index,
            settings.command_partitions,
            settings.shard_lease_s,
            on_change=partitions.use,
            dispatcher_id=shards.id,
            owner_key=index.keys.partition_owner,
            what="partition",
            gauge=metrics.PARTITIONS_OWNED,
        )
        tasks.start("partition-leases", partition_leases.run(stopping))

    async def _shut_down(self, partitions: PartitionConsumers, tasks: Tasks) -> None:
        """Stop taking commands and claiming; finish the commands and publishes under way
        (the commands not started go back to their partitions, in order)."""
        self.consuming = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + finish_budget_s(self.settings.shutdown_grace_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(partitions.let_all_go(), max(deadline - loop.time(), 0))
        await tasks.wait_all(max(deadline - loop.time(), 0))
        if self._reply_queues is not None:
            with contextlib.suppress(TimeoutError, *transient.ERRORS):
                await asyncio.wait_for(self._reply_queues.close(), 1)


async def _listen_for_wakes(
    client: aioredis.Redis, channel: str, dispatcher: Dispatcher, stopping: asyncio.Event
) -> None:
    """Wake-ups published by intakes and executors in other processes."""
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
        except transient.ERRORS as exc:
            # Wake-ups are only a shortcut (claims poll anyway): listen again rather than
            # stop the dispatcher.
            log.warning(
                "wake-up listener reconnects",
                extra={"action": "wake_listener_wait", "error": transient.said(exc)},
            )
            await transient.pause(1.0, stopping)
