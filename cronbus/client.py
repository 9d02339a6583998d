"""The Python client of cronbus: schedule commands over RabbitMQ, answered with typed replies.

```python
from cronbus import Client

async with Client() as c:  # CRONBUS_AMQP_URL, or the local broker
    s = await c.upsert("billing", {"id": "invoice-42", "spec": {...}, "target": {...}})
    print(s.version, s.next_fires)
```

Underneath, each call publishes one command to the exchange ``cronbus.commands`` with routing
key ``<namespace>.<verb>`` and waits for the reply on RabbitMQ's direct reply-to. The CLI and
the console use this client; anything it does can also be done with plain AMQP (see the command
reference).
"""

from __future__ import annotations

import asyncio
import builtins
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from os import environ
from types import TracebackType
from typing import Any, Self
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq.exceptions
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from cronbus.forms import (
    TOO_LARGE,
    ItemResult,
    ScheduleInput,
    UpsertManyIncomplete,
    check,
    chunks,
    command_form,
    instant,
    item_form,
    json_form,
    schedule_id,
)
from shared.contract import codec, keys, replies
from shared.contract.errors import CommandRefused, CronbusError
from shared.contract.replies import StoredSchedule, Triggered
from shared.rabbitmq import nodes
from shared.runtime.config import CommonSettings

#: The broker the services use by default.
DEFAULT_URL: str = CommonSettings.model_fields["amqp_url"].default

#: What the broker raises when a user's permissions do not allow an operation: a publish to
#: another tenant's namespace closes the channel with this.
ACCESS_REFUSED = (aiormq.exceptions.ChannelAccessRefused,)
#: A connection or channel that went away under a publish: a robust connection brings it back.
_LOST = (
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ConnectionClosed,
    aiormq.exceptions.AMQPConnectionError,
    ConnectionError,
)


class AccessRefused(CronbusError):
    """RabbitMQ refused the command: the broker user may not publish to this namespace."""


def _closed() -> NoReply:
    return NoReply("the client was closed before the command was sent")


class NoReply(CronbusError, TimeoutError):
    """No reply came within the timeout: is a dispatcher running against this broker?

    ``message_id`` is the unanswered command's: ``send(..., message_id=...)`` with it sends the
    command again, which cronbus answers from its record if it was applied already."""

    def __init__(self, message: str | None = None, message_id: str | None = None) -> None:
        super().__init__(message)
        self.message_id = message_id


def user_of(url: str) -> str | None:
    """The user named in an AMQP URL: sent as ``user_id``, which the broker checks against the
    connection's user, so the audit records who sent a command, not who it claims to be."""
    username = urlsplit(url).username
    return unquote(username) if username else None


@dataclass(frozen=True)
class Page:
    """One page of ``list``: the schedules, and the cursor of the next page (None: the last)."""

    schedules: builtins.list[StoredSchedule]
    next_cursor: str | None


@dataclass
class _Waiting:
    routing_key: str
    message: aio_pika.Message
    reply: asyncio.Future[dict[str, Any]]


class Client:
    """An asynchronous cronbus client; use it as ``async with Client() as c: ...``.

    The connection is a robust one: it comes back by itself after the broker or the network
    went away, and a command whose reply was lost with the connection is sent again with the
    same ``message_id``, which cronbus answers without applying it twice.

    Parameters
    ----------
    url
        The broker, as ``amqp://user:password@host:5672/vhost`` (``amqps://`` for TLS);
        ``CRONBUS_AMQP_URL`` when None, else the local broker.
    timeout_s
        How long each call waits for its reply before raising ``NoReply``.
    app_id
        Recorded with every command in cronbus's audit, beside the broker user.
    """

    def __init__(
        self, url: str | None = None, timeout_s: float = 30, *, app_id: str = "cronbus-client"
    ) -> None:
        self.url = url or environ.get("CRONBUS_AMQP_URL") or DEFAULT_URL
        self.timeout_s = timeout_s
        self.app_id = app_id
        self.user_id = user_of(self.url)
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._replies: AbstractQueue | None = None
        self._waiting: dict[str, _Waiting] = {}
        self._resending: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the connection (``async with`` does it for you)."""
        connection = await self._open()
        try:
            self._channel = await connection.channel(publisher_confirms=True)
            self._replies = await self._reply_queue(self._channel)
            await self._replies.consume(self._on_reply, no_ack=True)
            self._exchange = await self._channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        except BaseException:
            # Cancelled or failed half way: the robust connection would live on, reconnecting.
            await asyncio.shield(connection.close())
            self._channel = self._replies = self._exchange = None
            raise
        self._connection = connection
        if isinstance(self._connection, AbstractRobustConnection):
            self._connection.reconnect_callbacks.add(self._resend)

    async def close(self) -> None:
        """Close the connection; calls still waiting for a reply raise ``NoReply``."""
        for waiting in self._waiting.values():
            if not waiting.reply.done():
                waiting.reply.set_exception(NoReply("the client was closed before the reply came"))
        if self._connection is not None:
            connection, self._connection = self._connection, None
            self._channel = self._replies = self._exchange = None
            await connection.close()
        # A resend still waiting for the channel ends with the client (it answers NoReply).
        resending = list(self._resending)
        for task in resending:
            task.cancel()
        await asyncio.gather(*resending, return_exceptions=True)

    async def _open(self) -> AbstractConnection:
        return await nodes.connect(self.url, self.app_id, connect_timeout_s=self.timeout_s)

    async def _reply_queue(self, channel: AbstractChannel) -> AbstractQueue:
        # RabbitMQ's direct reply-to: nothing to declare or leave behind, and cronbus answers it
        # whatever the connection's kind. Declared (passively) rather than merely named, so the
        # robust channel consumes from it again after a reconnect.
        return await channel.declare_queue(keys.DIRECT_REPLY_TO, passive=True)

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        waiting = self._waiting.get(message.correlation_id or "")
        if waiting is not None and not waiting.reply.done():
            waiting.reply.set_result(codec.loads(message.body))

    def _resend(self, *_: object) -> None:
        """After a reconnect: replies on the old channel are lost, so send the commands still
        waiting again, with their own message_id (cronbus replays them, never applies twice).
        On a task of its own: a publish that waits for the channel must not hold up the
        reconnect that brings it back."""
        task = asyncio.get_running_loop().create_task(self._publish_waiting())
        self._resending.add(task)
        task.add_done_callback(self._resending.discard)

    async def _publish_waiting(self) -> None:
        for waiting in list(self._waiting.values()):
            if waiting.reply.done():
                continue
            try:
                await self._publish(waiting.routing_key, waiting.message)
            except Exception as exc:  # noqa: BLE001 - the caller waiting for this reply gets it
                if not waiting.reply.done():
                    waiting.reply.set_exception(exc)

    async def _publish(self, routing_key: str, message: aio_pika.Message) -> None:
        # Held here: close() clears the attributes while a resend may still be waiting.
        exchange, channel = self._exchange, self._channel
        if exchange is None or channel is None:
            raise _closed()
        while True:
            try:
                await exchange.publish(message, routing_key=routing_key)
                return
            except ACCESS_REFUSED as exc:
                reason = " ".join(str(part) for part in exc.args if part).strip()
                raise AccessRefused(reason or repr(exc)) from exc
            except _LOST:
                if not isinstance(channel, AbstractRobustChannel):
                    raise
                # The robust connection is coming back: publish again once it has.
                await self._until_ready(channel, 0.2)
            except aiormq.exceptions.DeliveryError:
                # Refused by the broker (a nack): a queue electing a new leader after its node
                # was lost, or the confirms of a channel that went down with its node. Sent
                # again, with its own message_id: cronbus replays a command, never applies it
                # twice. The caller's timeout bounds the tries.
                if not isinstance(channel, AbstractRobustChannel):
                    raise
                await self._until_ready(channel, 0.5)

    async def _until_ready(self, channel: AbstractRobustChannel, pause_s: float) -> None:
        """Wait ``pause_s``, then for ``channel`` to be back; a client closed meanwhile ends
        the publish with ``NoReply`` (the caller's timeout bounds the rest)."""
        await asyncio.sleep(pause_s)
        if self._connection is None:
            raise _closed()
        await channel.ready()
        if self._connection is None:
            raise _closed()

    async def send(
        self,
        namespace: str,
        verb: str,
        body: bytes | Mapping[str, Any],
        *,
        timeout_s: float | None = None,
        message_id: str | None = None,
        app_id: str | None = None,
        user_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Publish one command as given and return its reply as a dict, refused or not.

        The typed methods are built on this; use it for what they do not cover. Nothing is
        checked before sending.

        Parameters
        ----------
        namespace, verb
            The routing key is ``<namespace>.<verb>``.
        body
            The command body (a JSON object, or its bytes).
        timeout_s
            Overrides the client's timeout for this call.
        message_id
            By default a fresh one: if the broker delivers the command twice, cronbus answers
            the second time instead of applying it again.
        app_id, user_id
            Override the client's; ``user_id`` must be the connection's user (RabbitMQ checks
            it), so the audit records who the broker let in.
        headers
            AMQP headers to add.

        Raises
        ------
        NoReply
            No reply within the timeout (or the client is closed): its ``message_id`` is the
            command's, to send it again with.
        AccessRefused
            The broker user may not publish to this namespace.
        """
        if self._connection is None:
            raise NoReply("the client is not connected (or was closed): use 'async with Client()'")
        correlation_id = uuid.uuid4().hex
        message_id = message_id or uuid.uuid4().hex
        routing_key = keys.command_routing_key(namespace, verb)
        message = aio_pika.Message(
            body if isinstance(body, bytes) else codec.dumps(dict(body)),
            content_type="application/json",
            correlation_id=correlation_id,
            reply_to=self._reply_to(),
            message_id=message_id,
            app_id=app_id or self.app_id,
            user_id=user_id or self.user_id,
            headers=dict(headers) if headers else None,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[correlation_id] = _Waiting(routing_key, message, reply)
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(wait_s):
                await self._publish(routing_key, message)
                return await reply
        except NoReply:
            raise
        except TimeoutError:
            raise NoReply(
                f"no reply to {routing_key} within {wait_s:g}s: is a dispatcher running "
                "against this RabbitMQ?",
                message_id,
            ) from None
        finally:
            self._waiting.pop(correlation_id, None)

    def _reply_to(self) -> str:
        assert self._replies is not None, "not connected: use 'async with Client() as c'"
        return self._replies.name

    async def _command(self, namespace: str, verb: str, body: Mapping[str, Any]) -> dict[str, Any]:
        sent = json_form(body)  # checked and sent as the intake will read it
        check(namespace, verb, sent)
        reply = await self.send(namespace, verb, sent)
        if not reply.get("ok"):
            raise CommandRefused.of(reply.get("error") or {})
        return reply

    async def upsert(
        self, namespace: str, schedule: ScheduleInput, *, expected_version: int | None = None
    ) -> StoredSchedule:
        """Create or replace a schedule.

        Parameters
        ----------
        namespace
            1-63 lowercase letters, digits, ``_`` or ``-``.
        schedule
            A dict in the command's form (``id``, ``spec`` and ``target`` required) or a
            ``Schedule``; both are validated as cronbus's intake validates them.
        expected_version
            Apply only if the stored version is this one (``0``: only create).

        Returns
        -------
        StoredSchedule
            The schedule as stored: ``version``, ``state``, ``next_fires``...

        Raises
        ------
        CommandRefused
            With ``.errors`` naming each offending field; nothing was changed.
        """
        body: dict[str, Any] = {"schedule": command_form(schedule)}
        if expected_version is not None:
            body["expected_version"] = expected_version
        reply = await self._command(namespace, "upsert", body)
        return replies.stored(
            {
                **reply["schedule"],
                "unchanged": reply.get("unchanged", False),
                "warnings": reply.get("warnings", []),
            }
        )

    async def upsert_many(
        self, namespace: str, schedules: Iterable[ScheduleInput]
    ) -> builtins.list[ItemResult]:
        """Create or replace many schedules, each applied or refused on its own.

        Sent as ``upsert_many`` commands of up to 1000 schedules each (more are split). A
        schedule that would be refused is refused here, without being sent. A command cronbus
        refuses as ``too_large`` (its CRONBUS_MAX_COMMAND_BYTES is lower than the client's
        chunks) changed nothing: it is split in half and sent again, down to one schedule,
        which is then refused on its own.

        Returns
        -------
        list[ItemResult]
            One result per schedule, in input order.

        Raises
        ------
        UpsertManyIncomplete
            A command went unanswered or the broker refused it: ``.results`` holds what was
            answered before (None for the schedules whose outcome is unknown).
        """
        check(namespace, "list", {})  # the namespace only
        results: builtins.list[ItemResult | None] = []
        to_send: builtins.list[tuple[int, dict[str, Any]]] = []
        for position, schedule in enumerate(schedules):
            try:
                raw = item_form(schedule)
            except CommandRefused as refused:
                results.append(ItemResult(schedule_id(schedule), False, error=refused))
                continue
            results.append(None)
            to_send.append((position, raw))
        pending = list(chunks(to_send))
        while pending:
            chunk = pending.pop(0)
            try:
                reply = await self.send(
                    namespace, "upsert_many", {"schedules": [raw for _, raw in chunk]}
                )
            except (NoReply, AccessRefused) as exc:
                raise UpsertManyIncomplete(f"upsert_many stopped: {exc}", results) from exc
            if reply.get("ok"):
                for (position, _), result in zip(chunk, reply["results"], strict=True):
                    results[position] = ItemResult.of(result)
                continue
            whole = CommandRefused.of(reply.get("error") or {})
            if whole.code == TOO_LARGE and len(chunk) > 1:
                half = len(chunk) // 2
                pending[:0] = [chunk[:half], chunk[half:]]
                continue
            # Refused as a whole (nothing of it changed): each of its schedules is refused.
            for position, raw in chunk:
                results[position] = ItemResult(schedule_id(raw), False, error=whole)
        return [result for result in results if result is not None]

    async def get(self, namespace: str, schedule_id: str) -> StoredSchedule:
        """One schedule, with its ``stats``, ``breaker`` and running ``backfill``.

        Raises
        ------
        NotFound
            There is no such schedule (or it was deleted).
        """
        reply = await self._command(namespace, "get", {"id": schedule_id})
        return replies.stored(reply["schedule"])

    async def page(
        self,
        namespace: str,
        *,
        labels: Mapping[str, str] | None = None,
        state: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page:
        """One page of ``list``: up to ``limit`` schedules after ``cursor``, in id order."""
        body: dict[str, Any] = {"limit": limit, "labels": dict(labels or {})}
        if cursor is not None:
            body["cursor"] = cursor
        if state is not None:
            body["state"] = state
        reply = await self._command(namespace, "list", body)
        schedules = [replies.stored(item) for item in reply["schedules"]]
        return Page(schedules, reply.get("next_cursor"))

    async def list(
        self,
        namespace: str,
        *,
        labels: Mapping[str, str] | None = None,
        state: str | None = None,
        page_size: int = 100,
    ) -> AsyncIterator[StoredSchedule]:
        """Every schedule of a namespace, page after page, in id order.

        Parameters
        ----------
        labels
            Only schedules carrying every one of these labels.
        state
            Only schedules in this state: ``active``, ``paused`` or ``completed``.
        page_size
            Schedules asked for per command (1-1000).
        """
        cursor: str | None = None
        while True:
            found = await self.page(
                namespace, labels=labels, state=state, limit=page_size, cursor=cursor
            )
            for schedule in found.schedules:
                yield schedule
            if found.next_cursor is None:
                return
            cursor = found.next_cursor

    async def _by_id(self, verb: str, namespace: str, schedule_id: str) -> StoredSchedule:
        reply = await self._command(namespace, verb, {"id": schedule_id})
        return replies.stored(reply["schedule"])

    async def pause(self, namespace: str, schedule_id: str) -> StoredSchedule:
        """Stop a schedule firing; it keeps its place. Pausing a paused schedule changes
        nothing. Raises ``NotFound`` for an unknown schedule."""
        return await self._by_id("pause", namespace, schedule_id)

    async def resume(self, namespace: str, schedule_id: str) -> StoredSchedule:
        """Let a paused schedule fire again; its misfire policy decides about the times it
        missed. Raises ``NotFound`` for an unknown schedule."""
        return await self._by_id("resume", namespace, schedule_id)

    async def delete(self, namespace: str, schedule_id: str) -> StoredSchedule:
        """Delete a schedule (returned with state ``deleted``); its pending triggers and
        backfill go with it. Raises ``NotFound`` for an unknown schedule."""
        return await self._by_id("delete", namespace, schedule_id)

    async def trigger(self, namespace: str, schedule_id: str) -> Triggered:
        """Fire a schedule once now, outside its rotation: the run has its own time and key,
        does not count against ``max_fires`` and does not move the next regular fire. Raises
        ``NotFound`` for an unknown schedule."""
        reply = await self._command(namespace, "trigger", {"id": schedule_id})
        return replies.triggered({**reply["trigger"], "schedule": reply["schedule"]})

    async def backfill(
        self,
        namespace: str,
        schedule_id: str,
        start: datetime | str,
        end: datetime | str,
        *,
        limit: int | None = None,
    ) -> int:
        """Deliver again each nominal occurrence of a schedule in ``[start, end)``, oldest
        first, one at a time, with the key it had (and ``X-Cronbus-Backfill: true``).

        Parameters
        ----------
        start, end
            Instants: timezone-aware datetimes or RFC 3339 strings; ``end`` not in the future.
        limit
            Most occurrences to deliver (default 1000, at most 100000); the oldest are kept.

        Returns
        -------
        int
            How many occurrences will be delivered.
        """
        body: dict[str, Any] = {"id": schedule_id, "from": instant(start), "to": instant(end)}
        if limit is not None:
            body["limit"] = limit
        reply = await self._command(namespace, "backfill", body)
        return int(reply["backfill"]["occurrences"])
