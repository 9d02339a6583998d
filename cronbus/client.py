"""Publishing commands and waiting for their replies (the CLI, tests and benchmarks use it).

A user can do the same with plain aio-pika: publish JSON to exchange ``cronbus.commands`` with
routing key ``<namespace>.<verb>``, ``reply_to`` (a server-named queue, or direct reply-to) and
``correlation_id``.
"""

from __future__ import annotations

import asyncio
import uuid
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from shared.contract import codec, keys

#: What the broker raises when a user's permissions do not allow an operation: a publish to
#: another tenant's namespace closes the channel with this.
ACCESS_REFUSED = (aiormq.exceptions.ChannelAccessRefused,)


def user_of(url: str) -> str | None:
    """The user named in an AMQP URL: sent as ``user_id``, which the broker checks against the
    connection's user, so the audit records who sent a command, not who it claims to be."""
    username = urlsplit(url).username
    return unquote(username) if username else None


class CommandClient:
    def __init__(self, url: str, *, app_id: str = "cronbus-cli") -> None:
        self.url = url
        self.app_id = app_id
        self.user_id = user_of(url)
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._replies: AbstractQueue | None = None
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}

    async def __aenter__(self) -> CommandClient:
        self._connection = await aio_pika.connect(self.url, timeout=10)
        self._channel = await self._connection.channel(publisher_confirms=True)
        self._replies = await self._channel.declare_queue(exclusive=True, auto_delete=True)
        await self._replies.consume(self._on_reply, no_ack=True)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        waiter = self._waiting.pop(message.correlation_id or "", None)
        if waiter is not None and not waiter.done():
            waiter.set_result(codec.loads(message.body))

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
        assert self._channel is not None and self._replies is not None
        correlation_id = uuid.uuid4().hex
        payload = body if isinstance(body, bytes) else codec.dumps(body)
        exchange = await self._channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        await exchange.publish(
            aio_pika.Message(
                payload,
                content_type=content_type,
                correlation_id=correlation_id,
                reply_to=self._replies.name if reply else None,
                message_id=message_id or uuid.uuid4().hex,
                app_id=self.app_id,
                user_id=self.user_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=keys.command_routing_key(namespace, verb),
        )
        return correlation_id

    async def send(
        self,
        namespace: str,
        verb: str,
        body: bytes | dict[str, Any],
        *,
        timeout_s: float = 30,
        message_id: str | None = None,
        app_id: str | None = None,
        user_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Publish one command and wait for its reply.

        Each command gets a fresh ``message_id`` (unless one is given): if the broker delivers
        it twice, cronbus answers the second time instead of applying it again. ``app_id``
        overrides the client's; ``user_id``, when given, must be the connection's user
        (RabbitMQ checks it), so the command audit records who the broker let in.
        """
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        correlation_id = uuid.uuid4().hex
        self._waiting[correlation_id] = waiter
        assert self._channel is not None and self._replies is not None
        payload = body if isinstance(body, bytes) else codec.dumps(body)
        exchange = await self._channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        await exchange.publish(
            aio_pika.Message(
                payload,
                content_type="application/json",
                correlation_id=correlation_id,
                reply_to=self._replies.name,
                message_id=message_id or uuid.uuid4().hex,
                app_id=app_id or self.app_id,
                user_id=user_id or self.user_id,
                headers=dict(headers) if headers else None,
            ),
            routing_key=keys.command_routing_key(namespace, verb),
        )
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._waiting.pop(correlation_id, None)
