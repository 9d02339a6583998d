"""Acknowledgements of commands: those finished together go out in one frame per channel.

One ack frame per command cost as much as a tenth of the intake's CPU. Each channel's window
(``ack_window``) says which finished commands one ``multiple`` ack may settle; a command's
``handle`` still returns only once its own ack is written, as before, so that a dispatcher
stopping after its commands leaves none of them unacknowledged. Frames of one channel are
written in order by one flush at a time: a tag named twice would close the channel.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiormq.abc
from aio_pika.abc import AbstractIncomingMessage
from aio_pika.exceptions import ChannelInvalidStateError

from services.dispatcher.intake.ack_window import MAX_HELD, AckWindow

# The package's logger: the intake's log lines keep one logger name whatever module writes them.
log = logging.getLogger("services.dispatcher.intake")


@dataclass(frozen=True, slots=True)
class Delivery:
    """A command's delivery, begun in its channel's window."""

    channel: aiormq.abc.AbstractChannel
    tag: int


class Acks:
    """Per channel, the window of deliveries and the flush that acknowledges them."""

    def __init__(self, max_held: int = MAX_HELD) -> None:
        self.max_held = max_held
        self._windows: dict[aiormq.abc.AbstractChannel, AckWindow] = {}
        self._flushing: set[aiormq.abc.AbstractChannel] = set()
        self._waiters: dict[tuple[int, int], asyncio.Future[None]] = {}
        #: The flushes under way (referenced: the loop keeps only weak references to tasks).
        self._tasks: set[asyncio.Task[None]] = set()

    def begin(self, message: AbstractIncomingMessage) -> Delivery | None:
        """Called as the command arrives, before any await (deliveries begin in tag order).
        None: the message is acknowledged on its own (its channel is closed already)."""
        tag = message.delivery_tag
        try:
            channel = message.channel
        except ChannelInvalidStateError:
            return None
        if tag is None:
            return None
        window = self._windows.get(channel)
        if window is None:
            window = self._windows[channel] = AckWindow(self.max_held)
        window.begin(tag)
        return Delivery(channel, tag)

    async def ack(self, message: AbstractIncomingMessage, delivery: Delivery | None) -> None:
        """Acknowledge the command; returns once its ack (maybe shared) is written."""
        if delivery is None:
            await message.ack()
            return
        window = self._windows[delivery.channel]
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[(id(delivery.channel), delivery.tag)] = waiter
        window.finish(delivery.tag)
        self._flush_soon(delivery.channel)
        await waiter

    async def nack(
        self, message: AbstractIncomingMessage, delivery: Delivery | None, requeue: bool
    ) -> None:
        """Give the command back; the frame is written before any later ack may cover it."""
        try:
            await message.nack(requeue=requeue)
        finally:
            window = None if delivery is None else self._windows.get(delivery.channel)
            if delivery is not None and window is not None:
                window.drop(delivery.tag)
                self._flush_soon(delivery.channel)

    def abandon(self, delivery: Delivery | None) -> None:
        """The command ended without ``ack`` or ``nack`` (an error escaped it, or it was
        cancelled): it stays unacknowledged, and no ack of several may cover it. Nothing
        happens for a command that had its ack or nack."""
        window = None if delivery is None else self._windows.get(delivery.channel)
        if delivery is not None and window is not None and window.abandon(delivery.tag):
            self._flush_soon(delivery.channel)

    def _flush_soon(self, channel: aiormq.abc.AbstractChannel) -> None:
        # One flush per channel at a time, on the next turn of the loop: the commands that
        # finish in this turn share its ack.
        if channel not in self._flushing:
            self._flushing.add(channel)
            task = asyncio.get_running_loop().create_task(self._flush(channel), name="acks")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush(self, channel: aiormq.abc.AbstractChannel) -> None:
        try:
            window = self._windows.get(channel)
            while window is not None:
                acks = window.take()
                if not acks:
                    break
                for ack in acks:
                    error: BaseException | None = None
                    try:
                        await channel.basic_ack(ack.tag, multiple=ack.multiple)
                    except Exception as exc:  # noqa: BLE001 - passed to each command it settles
                        error = exc
                    self._settled(channel, ack.settles, error)
            if window is not None and window.idle():
                del self._windows[channel]
        finally:
            self._flushing.discard(channel)

    def _settled(
        self,
        channel: aiormq.abc.AbstractChannel,
        tags: tuple[int, ...],
        error: BaseException | None,
    ) -> None:
        for tag in tags:
            waiter = self._waiters.pop((id(channel), tag), None)
            if waiter is None or waiter.done():
                continue
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)
