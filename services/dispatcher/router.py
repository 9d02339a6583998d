"""The router: commands from ``cronbus.commands`` to their partitions, in the order they came.

Users publish as they always have (exchange ``cronbus.commands``, routing key
``<namespace>.<verb>``) and the queue ``cronbus.commands`` still receives every command. One
dispatcher at a time routes it: the one whose connection holds the exclusive queue
``cronbus.commands.router`` (the broker lets one connection hold it and drops it with that
connection, so a dead router's lock and its consumer go together). Every other dispatcher
tries to take the lock every second.

Routing reads the schedule's id from the body (``shared.policy.partitions``) and republishes
the command, body untouched, to ``cronbus.commands.partitions`` with the partition as routing
key; what a republish cannot carry as is (the routing key, ``user_id``, a message id or its
absence) travels in ``x-cronbus-*`` headers. Publishes go out in arrival order on one channel,
each confirmed before its command is acknowledged, so each partition holds its commands in
the order they came. Should the router die before an acknowledgement, the broker hands its
unacknowledged commands to the next router, which routes them again: a partition then sees a
command twice, the second time after the first, and the intake recognises the copy by its
``message_id`` (the replays).

An ``upsert_many`` over several partitions is split into one part per partition. The parts
answer the router, which answers the user once, with every schedule's result in input order,
and only then acknowledges the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiormq
import aiormq.abc
import aiormq.exceptions
from pamqp import commands as spec

from services.dispatcher.intake.receiving import Meta, Received
from shared.contract import codec, keys
from shared.policy import partitions
from shared.policy.replies import Route as ReplyRoute
from shared.policy.replies import shape_of
from shared.rabbitmq import decoding, nodes
from shared.runtime import metrics, transient
from shared.runtime.config import DispatcherSettings

log = logging.getLogger(__name__)

CONNECTION_NAME = "cronbus-dispatcher-router"
#: How often a dispatcher that is not the router tries to become it.
LOCK_RETRY_S = 1.0
#: Commands the router holds unacknowledged at once (routing is cheap; parts wait longer).
PREFETCH = 2000
#: Headers only the router sets: a user's own are dropped, never believed.
ROUTER_HEADERS = (
    keys.ROUTED_KEY_HEADER,
    keys.ROUTED_USER_HEADER,
    keys.ROUTED_MESSAGE_ID_HEADER,
    keys.ROUTED_UNDECODABLE_HEADER,
)
#: The short-string properties a router republishes (the broker passes on any bytes there).
TEXT_PROPERTIES = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "message_type",
    "user_id",
    "app_id",
)

#: What ends a spell as the router: it tries again (a broker away, a channel closed).
ROUTER_ERRORS: tuple[type[BaseException], ...] = (*transient.ERRORS, aiormq.exceptions.AMQPError)

#: One publish: (partition, body, for a part: (parts queue, correlation id, message id)).
Publish = tuple[int, bytes, tuple[str, str, str | None] | None]

#: Answers one command (the intake's ``Answers.reply``: its reply_to checked again first).
Reply = Callable[[Received, dict[str, Any]], Awaitable[None]]
#: Whether ``reply_to`` may be answered now (the intake's checks).
Answerable = Callable[[str], Awaitable[bool]]


class Unrouted(aiormq.exceptions.AMQPError):
    """A publish to a partition not confirmed (returned or refused)."""


def _readable_properties(
    message: aiormq.abc.DeliveredMessage,
) -> tuple[dict[str, str | None], list[str]]:
    """The command's routing key and text properties, sendable, and the names of those that
    were not UTF-8 (``shared.rabbitmq.decoding``)."""
    properties = message.header.properties
    text: dict[str, str | None] = {name: getattr(properties, name) for name in TEXT_PROPERTIES}
    text["routing_key"] = message.routing_key or ""
    undecodable = [name for name, value in text.items() if decoding.undecodable(value)]
    for name in undecodable:
        text[name] = decoding.readable(text[name] or "")
    return text, undecodable


def _is_split(plan: list[Publish]) -> bool:
    return plan[0][2] is not None


class AckWindow:
    """Which routed commands to acknowledge, and how: those in a row from the oldest still
    unacknowledged go in one frame (``multiple``); one finished behind a command still under
    way (a split waiting for its parts) goes alone, at once, so that a slow split holds back
    no other command (should the router die, the next one would route them all again)."""

    def __init__(self) -> None:
        self._order: deque[int] = deque()
        self._done: set[int] = set()

    def arrived(self, tag: int) -> None:
        self._order.append(tag)

    def finish(self, tags: Iterable[int]) -> list[tuple[int, bool]]:
        """The acks (tag, multiple) that settle ``tags``, to send in this order: each names
        a tag no earlier ack settled."""
        self._done.update(tags)
        acks = []
        last = None
        while self._order and self._order[0] in self._done:
            last = self._order.popleft()
            self._done.discard(last)
        if last is not None:
            acks.append((last, True))
        for tag in sorted(self._done):
            self._order.remove(tag)
            acks.append((tag, False))
        self._done.clear()
        return acks


@dataclass
class Gather:
    """A split upsert_many waiting for its parts' replies."""

    tag: int
    received: Received
    route: partitions.Route
    items: list[Any]
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)


class Router:
    def __init__(
        self,
        settings: DispatcherSettings,
        stopping: asyncio.Event,
        reply: Reply,
        answerable: Answerable,
    ) -> None:
        self.settings = settings
        self.stopping = stopping
        self.reply = reply
        self.answerable = answerable
        self.active = False
        self._ids = itertools.count()

    async def run(self) -> None:
        """Route while holding the lock; else try again every second, until stopping."""
        decoding.install()
        while not self.stopping.is_set():
            try:
                await self._route_while_locked()
            except ROUTER_ERRORS as exc:
                log.warning(
                    "the command router stopped; it tries again",
                    extra={"action": "router_wait", "error": transient.said(exc)},
                )
            finally:
                self._set_active(False)
            await transient.pause(LOCK_RETRY_S, self.stopping)

    def _set_active(self, active: bool) -> None:
        if active != self.active:
            log.info(
                "this dispatcher routes cronbus.commands" if active else "routing handed on",
                extra={"action": "router_active" if active else "router_inactive"},
            )
        self.active = active
        metrics.ROUTER_ACTIVE.set(1 if active else 0)

    async def _route_while_locked(self) -> None:
        connection = await nodes.connect_plain(self.settings.amqp_url, CONNECTION_NAME)
        try:
            channel = await connection.channel(publisher_confirms=True)
            try:
                await channel.queue_declare(keys.ROUTER_LOCK_QUEUE, exclusive=True)
            except aiormq.exceptions.ChannelLockedResource:
                return  # another dispatcher routes
            self._set_active(True)
            await Routing(self, connection, channel).run()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 5)


class Routing:
    """One spell as the router, on one connection: it ends when the connection does."""

    def __init__(
        self,
        router: Router,
        connection: aiormq.abc.AbstractConnection,
        channel: aiormq.abc.AbstractChannel,
    ) -> None:
        self.router = router
        self.settings = router.settings
        self.connection = connection
        self.channel = channel
        self.arrived: deque[aiormq.abc.DeliveredMessage] = deque()
        self.wake = asyncio.Event()
        self.acks = AckWindow()
        self.acking = asyncio.Lock()
        self.answering: set[asyncio.Future[None]] = set()
        self.acked = 0
        self.gathers: dict[str, Gather] = {}
        self.parts_queue = ""
        self.closed: asyncio.Future[Any] = asyncio.ensure_future(connection.closing)

    async def run(self) -> None:
        replies_channel = await self.connection.channel()
        declared = await replies_channel.queue_declare("", exclusive=True, auto_delete=True)
        self.parts_queue = declared.queue or ""
        await replies_channel.basic_consume(self.parts_queue, self._on_part_reply, no_ack=True)
        await self.channel.basic_qos(prefetch_count=PREFETCH)
        consumed = await self.channel.basic_consume(keys.COMMANDS_QUEUE, self._on_command)
        stopping = asyncio.ensure_future(self.router.stopping.wait())
        try:
            while not stopping.done() and not self.closed.done():
                await asyncio.wait(
                    [stopping, self.closed, asyncio.ensure_future(self.wake.wait())],
                    return_when=asyncio.FIRST_COMPLETED,
                )
                self.wake.clear()
                await self._route_arrived()
            if stopping.done() and not self.closed.done():
                await self._hand_over(consumed.consumer_tag or "")
        finally:
            stopping.cancel()
            self.closed.cancel()

    async def _on_command(self, message: aiormq.abc.DeliveredMessage) -> None:
        self.acks.arrived(message.delivery_tag or 0)
        self.arrived.append(message)
        self.wake.set()

    async def _route_arrived(self) -> None:
        """Everything arrived so far: published in order, then acknowledged together."""
        batch = list(self.arrived)
        self.arrived.clear()
        if not batch:
            return
        # The routes first, in order (a split may ask the broker about its reply_to), then
        # every publish started in arrival order: started without a wait in between, they
        # take the channel's lock, and reach the broker, in that order.
        plans = await self._plans(batch)
        publishing = [
            [
                asyncio.ensure_future(self._sent(message, partition, body, part))
                for partition, body, part in plan
            ]
            for message, plan in zip(batch, plans, strict=True)
        ]
        await asyncio.gather(*(task for tasks in publishing for task in tasks))
        finished = []
        for message, plan, tasks in zip(batch, plans, publishing, strict=True):
            if all(task.result() for task in tasks):
                if _is_split(plan):
                    continue  # acknowledged once its parts have answered
            else:
                await self._dead_letter(message, plan)
            finished.append(message.delivery_tag or 0)
        await self._ack(self.acks.finish(finished))

    async def _sent(
        self,
        message: aiormq.abc.DeliveredMessage,
        partition: int,
        body: bytes,
        part: tuple[str, str, str | None] | None,
    ) -> bool:
        """Published (True); False when this command cannot be, whatever the broker does:
        one hostile command never stops the router (a broker away still does, and every
        command goes back to the queue)."""
        try:
            await self._publish(message, partition, body, part)
        except ROUTER_ERRORS:
            raise
        except Exception:
            log.exception(
                "the router could not route a command; it is dead-lettered",
                extra={"action": "router_refused"},
            )
            return False
        return True

    async def _dead_letter(self, message: aiormq.abc.DeliveredMessage, plan: list[Publish]) -> None:
        """Keep a command that could not be routed in ``cronbus.commands.dead``, with why
        (its own properties left out: they may be what could not be sent)."""
        for _, _, part in plan:
            if part is not None:
                self.gathers.pop(part[1].partition(":")[0], None)
        text, _ = _readable_properties(message)
        reason = "internal: the router could not route this command; the error is logged"
        await self.channel.basic_publish(
            message.body,
            exchange=keys.DEAD_LETTER_EXCHANGE,
            routing_key=keys.dead_letter_queue(keys.COMMANDS_QUEUE),
            properties=spec.Basic.Properties(
                headers={
                    keys.DEAD_REASON_HEADER: reason,
                    keys.ROUTED_KEY_HEADER: text["routing_key"] or "",
                },
                delivery_mode=2,
            ),
        )
        metrics.DEAD_LETTERED.labels(keys.COMMANDS_QUEUE).inc()

    async def _ack(self, acks: list[tuple[int, bool]]) -> None:
        """Send acks in the order they were decided (a tag settled by an earlier ack, named
        again, would close the channel): callers decide and call without a wait between."""
        async with self.acking:
            for tag, multiple in acks:
                await self.channel.basic_ack(tag, multiple=multiple)

    async def _plans(self, batch: list[aiormq.abc.DeliveredMessage]) -> list[list[Publish]]:
        """Each command's publishes: one to its partition, or one per part of a split. The
        reply queues of the splits are asked about together (a slow answer holds up one
        batch, not one command after another)."""
        routes = [self._route_of(message) for message in batch]
        splits = [n for n, (route, _) in enumerate(routes) if route.split]
        answerable = await asyncio.gather(*(self._split_answerable(batch[n]) for n in splits))
        split = {n for n, yes in zip(splits, answerable, strict=True) if yes}
        plans: list[list[Publish]] = []
        for n, (message, (route, parsed)) in enumerate(zip(batch, routes, strict=True)):
            parts = self._parts(message, route, parsed["schedules"]) if n in split else None
            if parts is None:
                metrics.COMMANDS_ROUTED.labels("whole").inc()
                plans.append([(route.partition, message.body, None)])
            else:
                metrics.COMMANDS_ROUTED.labels("split").inc()
                plans.append(parts)
        return plans

    def _route_of(self, message: aiormq.abc.DeliveredMessage) -> tuple[partitions.Route, Any]:
        namespace, _, verb = (message.routing_key or "").partition(".")
        parsed = self._parsed(message.body)
        partition_count = self.settings.command_partitions
        return partitions.route_of(namespace, verb, parsed, partition_count), parsed

    def _parsed(self, body: bytes) -> Any:
        if len(body) > self.settings.max_command_bytes:
            return None  # refused whole by the intake
        try:
            return codec.loads(body)
        except codec.DecodeError:
            return None  # the intake says what is wrong with it

    async def _split_answerable(self, message: aiormq.abc.DeliveredMessage) -> bool:
        """Split only a command the intake would answer: any other goes whole, and the
        intake refuses it (and keeps it in the dead-letter queue) as it always has."""
        if _readable_properties(message)[1]:
            return False  # refused whole, by name, for its properties that are not UTF-8
        reply_to = message.header.properties.reply_to
        if not reply_to:
            return True
        route = shape_of(reply_to).route
        if route is ReplyRoute.REFUSED:
            return False
        return route is not ReplyRoute.CHECK or await self.router.answerable(reply_to)

    async def _publish(
        self,
        message: aiormq.abc.DeliveredMessage,
        partition: int,
        body: bytes,
        part: tuple[str, str, str | None] | None = None,
    ) -> None:
        """One publish, confirmed; ``part``: (parts queue, correlation id, message id)."""
        text, undecodable = _readable_properties(message)
        headers = {
            name: value
            for name, value in (message.header.properties.headers or {}).items()
            # x-delivery-count stays: the deliveries from cronbus.commands count until the
            # partition's own (set by the broker from its first redelivery) replace them.
            if name not in ROUTER_HEADERS
        }
        headers[keys.ROUTED_KEY_HEADER] = text["routing_key"] or ""
        if text["user_id"] is not None:
            headers[keys.ROUTED_USER_HEADER] = text["user_id"]
        message_id = text["message_id"] if part is None else part[2]
        if message_id is not None:
            headers[keys.ROUTED_MESSAGE_ID_HEADER] = message_id
        if undecodable:
            headers[keys.ROUTED_UNDECODABLE_HEADER] = ",".join(undecodable)
        routed = spec.Basic.Properties(
            content_type=text["content_type"],
            content_encoding=text["content_encoding"],
            headers=headers,
            delivery_mode=2,
            correlation_id=text["correlation_id"] if part is None else part[1],
            reply_to=text["reply_to"] if part is None else part[0],
            # Unreadable, it could not say when the command expires: it does not. A part
            # never expires: its command's reply waits for every part.
            expiration=None
            if "expiration" in undecodable or part is not None
            else text["expiration"],
            # Our own id: the broker's return of an unroutable publish names it.
            message_id=uuid.uuid4().hex,
            timestamp=message.header.properties.timestamp,
            message_type=text["message_type"],
            app_id=text["app_id"],
        )
        confirmation = await self.channel.basic_publish(
            body,
            exchange=keys.PARTITIONS_EXCHANGE,
            routing_key=str(partition),
            properties=routed,
            mandatory=True,
        )
        if not isinstance(confirmation, spec.Basic.Ack):
            # A partition queue gone or a broker refusal: give every command back (the
            # connection closes) rather than acknowledge one that went nowhere.
            raise Unrouted(f"partition {partition} did not take a command: {confirmation!r}")

    def _parts(
        self, message: aiormq.abc.DeliveredMessage, route: partitions.Route, items: list[Any]
    ) -> list[Publish] | None:
        """The parts' publishes, the gather waiting for their replies registered; None when
        the parts cannot be written (the command then goes whole, and the intake refuses
        what is wrong with it: orjson reads deeper nesting than it writes)."""
        try:
            bodies = [
                codec.dumps({"schedules": [items[p] for p in part.positions]})
                for part in route.parts
            ]
        except (TypeError, ValueError):
            return None
        properties = message.header.properties
        gather_id = f"{next(self.router._ids)}"
        meta = Meta(
            routing_key=message.routing_key or "",
            reply_to=properties.reply_to,
            correlation_id=properties.correlation_id,
            user_id=properties.user_id,
            app_id=properties.app_id,
            message_id=properties.message_id,
        )
        self.gathers[gather_id] = Gather(
            message.delivery_tag or 0, Received(message.body, meta), route, items
        )
        message_id = properties.message_id
        return [
            (
                part.partition,
                body,
                (
                    self.parts_queue,
                    f"{gather_id}:{n}",
                    None if message_id is None else f"{message_id}#{part.partition}",
                ),
            )
            for n, (part, body) in enumerate(zip(route.parts, bodies, strict=True))
        ]

    async def _on_part_reply(self, message: aiormq.abc.DeliveredMessage) -> None:
        gather_id, _, n = (message.header.properties.correlation_id or "").partition(":")
        gather = self.gathers.get(gather_id)
        if gather is None or not n.isdigit():
            return  # a part answered twice (a replayed part) or not ours
        try:
            reply = codec.loads(message.body)
        except codec.DecodeError:
            reply = {}
        gather.replies[int(n)] = reply if isinstance(reply, dict) else {}
        if len(gather.replies) == len(gather.route.parts):
            del self.gathers[gather_id]
            answering = asyncio.ensure_future(self._answer(gather))
            self.answering.add(answering)
            answering.add_done_callback(self.answering.discard)

    async def _answer(self, gather: Gather) -> None:
        """The merged reply to the user, then the command's acknowledgement. Should this fail,
        the command stays unacknowledged and the next router routes it again."""
        replies = [gather.replies[n] for n in range(len(gather.route.parts))]
        merged = partitions.merged_results(gather.route.parts, replies, gather.items)
        try:
            if gather.received.meta.reply_to:
                await transient.retry(
                    lambda: self.router.reply(gather.received, merged),
                    what="upsert_many reply",
                    stopping=self.router.stopping,
                )
            await self._ack(self.acks.finish([gather.tag]))
        except Exception as exc:  # noqa: BLE001 (any failure: the next router answers it)
            log.warning(
                "a split upsert_many could not be answered; it is routed again",
                extra={"action": "router_answer_failed", "error": transient.said(exc)},
            )
            with contextlib.suppress(Exception):
                await self.connection.close()

    async def _hand_over(self, consumer_tag: str) -> None:
        """Stopping: take no more commands, wait a moment for split commands' parts, then
        close (every unacknowledged command goes back to the queue for the next router)."""
        with contextlib.suppress(*ROUTER_ERRORS):
            await self.channel.basic_cancel(consumer_tag)
        await self._route_arrived()
        for _ in range(20):
            if not self.gathers and not self.answering:
                break
            await asyncio.sleep(0.1)
