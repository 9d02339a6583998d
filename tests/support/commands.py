"""The command client the tests use: a plain connection that fails rather than heals, replies
on a server-named queue, and ``publish`` to send a command without waiting (or as raw bytes)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractQueue

from cronbus.client import Client
from shared.contract import codec, keys, timefmt


class CommandClient(Client):
    """For tests: a plain connection that fails rather than heals, replies on a server-named
    queue, and ``publish`` to send a command without waiting (or as raw bytes)."""

    def __init__(self, url: str, *, app_id: str = "cronbus-cli") -> None:
        super().__init__(url, app_id=app_id)

    async def _open(self) -> AbstractConnection:
        return await aio_pika.connect(self.url, timeout=10)

    async def _reply_queue(self, channel: AbstractChannel) -> AbstractQueue:
        return await channel.declare_queue(exclusive=True, auto_delete=True)

    async def publish(
        self,
        namespace: str,
        verb: str,
        body: bytes | dict[str, Any],
        *,
        reply: bool = False,
        message_id: str | None = None,
        content_type: str = "application/json",
    ) -> str:
        """Publish one command; returns its correlation id."""
        correlation_id = uuid.uuid4().hex
        assert self._exchange is not None, "not connected"
        await self._exchange.publish(
            aio_pika.Message(
                body if isinstance(body, bytes) else codec.dumps(body),
                content_type=content_type,
                correlation_id=correlation_id,
                reply_to=self._reply_to() if reply else None,
                message_id=message_id or uuid.uuid4().hex,
                app_id=self.app_id,
                user_id=self.user_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=keys.command_routing_key(namespace, verb),
        )
        return correlation_id


def an_hour_from_now() -> str:
    """A ``start_at`` that keeps an hourly schedule out of a test: without one, an interval
    sits on the epoch's grid, and a whole hour falling during the test would fire it."""
    return timefmt.format_ms(int(time.time() * 1000) + 3_600_000)
