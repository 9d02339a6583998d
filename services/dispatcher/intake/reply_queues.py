"""Which ``reply_to`` a command is answered on: the broker asked, on a connection of its own.

The rules are in ``shared.policy.replies``; this module asks the broker what they need: for a
queue that is neither direct reply-to nor server-named, a passive declare from cronbus's own
connection, which RabbitMQ refuses with RESOURCE_LOCKED when the queue is exclusive to another
connection (the one that declared it: the only one that can consume from it). A refused
passive declare closes its channel, so each check opens a channel of its own, on the
connection ``cronbus-dispatcher-replies``: nothing that goes wrong there reaches the intake's
consumer. Answers to direct reply-to go out on that connection too: RabbitMQ closes the
connection that publishes to a token it cannot place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiormq
import aiormq.abc
import aiormq.exceptions
from aio_pika.abc import AbstractRobustConnection

from services.dispatcher.intake.receiving import ReplyToRefused
from shared.policy import replies
from shared.policy.replies import BrokerAnswer, Route
from shared.rabbitmq import amqp

CONNECTION_NAME = "cronbus-dispatcher-replies"
#: Longest wait for the broker's answer to one check.
CHECK_TIMEOUT_S = 5.0


def refused(reply_to: str, reason: str) -> ReplyToRefused:
    return ReplyToRefused(
        "invalid_command",
        replies.refusal_reason(reply_to, reason),
        [{"field": "reply_to", "reason": reason}],
    )


class ReplyQueues:
    """The checks of ``reply_to``, their verdicts kept a while, and the replies connection."""

    def __init__(self, amqp_url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.amqp_url = amqp_url
        self.clock = clock
        self.cache = replies.VerdictCache()
        self._connection: AbstractRobustConnection | None = None
        self._connecting = asyncio.Lock()
        self._asking: dict[str, asyncio.Future[BrokerAnswer]] = {}
        self._publisher: aiormq.abc.AbstractChannel | None = None
        #: Held while a direct reply is published and confirmed (``Answers.answer``).
        self.direct_publishing = asyncio.Lock()

    async def close(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            await connection.close()

    async def check(self, reply_to: str | None, *, undecodable: bool = False) -> None:
        """Raise ReplyToRefused unless a reply may go to ``reply_to`` (None: no reply);
        ``undecodable``: the property was not UTF-8."""
        if not reply_to:
            return
        if undecodable:
            raise refused(reply_to, "is not UTF-8")
        shape = replies.shape_of(reply_to)
        if shape.route is Route.REFUSED:
            raise refused(reply_to, shape.reason)
        if shape.route is not Route.CHECK:
            return
        verdict = self.cache.get(reply_to, self.clock())
        if verdict is None:
            answer = await self._asked(reply_to)
            verdict = self.cache.put(reply_to, *replies.verdict_of(answer), self.clock())
        if not verdict.answer:
            raise refused(reply_to, verdict.reason)

    def must_ask(self, reply_to: str | None) -> bool:
        """Whether ``check`` will wait for the broker (no verdict kept for this queue)."""
        if not reply_to or replies.shape_of(reply_to).route is not Route.CHECK:
            return False
        return self.cache.get(reply_to, self.clock()) is None

    async def answerable(self, reply_to: str) -> bool:
        """``check`` as a yes or no (the router asks before splitting a command)."""
        try:
            await self.check(reply_to)
        except ReplyToRefused:
            return False
        return True

    async def still_answerable(self, reply_to: str) -> replies.Verdict:
        """The broker's word on ``reply_to`` now, kept verdict or not (a reply is about to be
        published there): the queue answered a moment ago may have lost its exclusive owner,
        and another tenant may have declared a queue of the same name since. Concurrent
        replies to one queue share one question."""
        answer = await self._asked(reply_to)
        return self.cache.put(reply_to, *replies.verdict_of(answer), self.clock())

    async def direct_reply_channel(self) -> aiormq.abc.AbstractChannel:
        """The channel answers to direct reply-to are published on."""
        if self._publisher is None or self._publisher.is_closed:
            self._publisher = await asyncio.wait_for(self._plain_channel(), CHECK_TIMEOUT_S)
        return self._publisher

    async def _asked(self, name: str) -> BrokerAnswer:
        """The broker's answer; commands naming the same queue at once share one question."""
        asking = self._asking.get(name)
        if asking is None:
            asking = asyncio.ensure_future(self._ask(name))
            self._asking[name] = asking
            asking.add_done_callback(lambda _: self._asking.pop(name, None))
        return await asyncio.shield(asking)

    async def _ask(self, name: str) -> BrokerAnswer:
        channel = await asyncio.wait_for(self._plain_channel(), CHECK_TIMEOUT_S)
        try:
            await asyncio.wait_for(channel.queue_declare(name, passive=True), CHECK_TIMEOUT_S)
        except aiormq.exceptions.ChannelLockedResource:
            return BrokerAnswer.LOCKED
        except aiormq.exceptions.ChannelNotFoundEntity:
            return BrokerAnswer.NOT_FOUND
        except aiormq.exceptions.ChannelClosed:
            return BrokerAnswer.OTHER
        finally:
            if not channel.is_closed:
                await channel.close()
        return BrokerAnswer.DECLARED

    async def _plain_channel(self) -> aiormq.abc.AbstractChannel:
        """A channel of the connection's protocol layer: a robust channel would be opened
        again, and its passive declares replayed, after every reconnect."""
        connection = await self._connected()
        await connection.ready()
        transport = connection.transport
        if transport is None:
            raise aiormq.exceptions.AMQPConnectionError("the replies connection is away")
        return await transport.connection.channel()

    async def _connected(self) -> AbstractRobustConnection:
        async with self._connecting:
            if self._connection is None:
                self._connection = await amqp.connect(self.amqp_url, CONNECTION_NAME)
            return self._connection
