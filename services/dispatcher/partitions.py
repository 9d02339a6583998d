"""The commands partitions this dispatcher consumes, one channel each.

Which partitions a dispatcher consumes is spread by leases (``leases.ShardLeases`` on the
partitions' own keys), so that each dispatcher takes its share. That only spreads the work:
the partition queues have a single active consumer, so even two dispatchers that both believe
they own a partition (a lease that expired under a slow one) never apply its commands at once.

Handing a partition over keeps its order: the dispatcher starts no command it receives after
deciding to let go, waits for the commands under way to finish, then closes the partition's
channel. The broker takes back the commands it had not started, in order, at the head of the
queue, and only then makes the next consumer active. A dispatcher that dies hands over the
same way: its channels close with its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from shared.rabbitmq import amqp
from shared.runtime import transient

log = logging.getLogger(__name__)

Handle = Callable[[AbstractIncomingMessage], Coroutine[Any, Any, None]]


class Partition:
    """One partition consumed: its channel, the commands under way, those held back."""

    def __init__(self, number: int, channel: AbstractChannel) -> None:
        self.number = number
        self.channel = channel
        self.under_way: set[asyncio.Task[None]] = set()
        self.letting_go = False

    async def let_go(self) -> None:
        """Finish what is under way, then close: the rest goes back to the queue, in order."""
        self.letting_go = True
        while self.under_way:
            await asyncio.wait(set(self.under_way))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.channel.close(), 5)


class PartitionConsumers:
    def __init__(
        self,
        connection: AbstractRobustConnection,
        handle: Handle,
        prefetch: int,
    ) -> None:
        self.connection = connection
        self.handle = handle
        self.prefetch = prefetch
        self.consumed: dict[int, Partition] = {}
        self.wanted: list[int] = []
        self.changed = asyncio.Event()
        self._letting_go: dict[int, asyncio.Task[None]] = {}

    @property
    def under_way(self) -> int:
        return sum(len(p.under_way) for p in self.consumed.values())

    def use(self, partitions: list[int]) -> None:
        """The partitions this dispatcher should consume now (the leases' choice)."""
        self.wanted = sorted(partitions)
        self.changed.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Follow the wanted partitions until stopping, then let every one go."""
        while not stopping.is_set():
            self.changed.clear()
            await transient.retry(self._follow, what="command partitions", stopping=stopping)
            waiting = asyncio.ensure_future(self.changed.wait())
            stop = asyncio.ensure_future(stopping.wait())
            await asyncio.wait([waiting, stop], return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            stop.cancel()

    async def let_all_go(self) -> None:
        await asyncio.gather(*(self._let_go(n) for n in list(self.consumed)))
        if self._letting_go:
            await asyncio.wait(list(self._letting_go.values()))

    async def _follow(self) -> None:
        for number in [n for n in self.consumed if n not in self.wanted]:
            self._letting_go[number] = asyncio.create_task(self._let_go(number))
        for number in self.wanted:
            if number not in self.consumed:
                await self._consume(number)

    async def _let_go(self, number: int) -> None:
        partition = self.consumed.get(number)
        if partition is None:
            return
        try:
            await partition.let_go()
        finally:
            self.consumed.pop(number, None)
            self._letting_go.pop(number, None)
            self.changed.set()  # it may be wanted back by now
            log.info(
                "command partition handed over",
                extra={"action": "partition_released", "partition": number},
            )

    async def _consume(self, number: int) -> None:
        going = self._letting_go.get(number)
        if going is not None:
            await going  # wanted back while still letting it go
        channel = await self.connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=self.prefetch)
        partition = Partition(number, channel)
        queue = await amqp.partition_queue_of(channel, number)

        async def on_command(message: AbstractIncomingMessage) -> None:
            if partition.letting_go:
                return  # not started: the broker takes it back when the channel closes
            task = asyncio.create_task(self.handle(message), name="command")
            partition.under_way.add(task)
            task.add_done_callback(partition.under_way.discard)

        await queue.consume(on_command)
        self.consumed[number] = partition
        log.info(
            "command partition consumed (active once its previous consumer lets go)",
            extra={"action": "partition_consumed", "partition": number},
        )
