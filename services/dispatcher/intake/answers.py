"""How a command is answered when it is refused or fails: the reply, the dead letter, the audit.

Every message ends answered or kept: a refusal is audited and replied to, and one nobody would
hear of (unparseable, no ``reply_to``, or a ``reply_to`` refused) is also dead-lettered with
the reason in a header, for an operator. After an unexpected error the same is done as far as
it goes, each step bounded, since whatever failed may fail again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aiormq
import aiormq.abc
import aiormq.exceptions
from aio_pika.abc import AbstractChannel

from services.dispatcher.intake.receiving import (
    Meta,
    Received,
    ReplyToRefused,
    Unparseable,
    audit_of,
)
from services.dispatcher.intake.reply_queues import ReplyQueues
from shared.contract import codec, keys, models
from shared.contract.errors import ValidationFailed
from shared.policy import replies
from shared.policy.replies import Route
from shared.postgres.store import Store
from shared.rabbitmq import amqp
from shared.runtime import metrics

# The package's logger: the intake's log lines keep one logger name whatever module writes them.
log = logging.getLogger("services.dispatcher.intake")

#: A reply lists at most this many field errors.
MAX_ERROR_DETAILS = 50
#: How long each step of reporting an unexpected failure may take.
FAIL_SAFE_TIMEOUT_S = 5.0


def error_of(failure: ValidationFailed) -> dict[str, Any]:
    """The reply's error: a hostile command may have thousands of problems; list the first."""
    return {
        "code": failure.code,
        "message": str(failure)[:2000],
        "details": failure.details[:MAX_ERROR_DETAILS],
    }


def reply_to_refused(failure: ValidationFailed) -> bool:
    return isinstance(failure, ReplyToRefused)


class Answers:
    """Replies on ``reply_to``, refusals and dead letters on the command channel."""

    def __init__(self, store: Store, channel: AbstractChannel, reply_queues: ReplyQueues) -> None:
        self.store = store
        self.channel = channel
        self.reply_queues = reply_queues

    async def refuse(self, failure: ValidationFailed, received: Received) -> dict[str, Any]:
        meta = received.meta
        error = error_of(failure)
        verb = received.verb
        metrics.COMMANDS.labels(verb if verb in models.VERBS else "unknown", failure.code).inc()
        log.info(
            "command refused",
            extra={
                "action": "command_refused",
                "routing_key": meta.routing_key,
                "code": failure.code,
                "error": str(failure),
            },
        )
        await self.store.record_command(audit_of(received, failure.code, error))
        if reply_to_refused(failure):
            metrics.REPLY_TO_REFUSED.inc()
        if isinstance(failure, Unparseable) or not meta.reply_to or reply_to_refused(failure):
            # Nobody would hear of it otherwise: keep the message, with why, for an operator.
            await self.dead_letter(received, f"{failure.code}: {failure}")
        return {"ok": False, "error": error}

    async def dead_letter(self, received: Received, reason: str) -> None:
        meta = received.meta
        await amqp.dead_letter(
            self.channel,
            keys.COMMANDS_QUEUE,
            received.body,
            reason,
            {
                "reply_to": meta.reply_to,
                "correlation_id": meta.correlation_id,
                "message_id": meta.message_id,
                "headers": {"x-cronbus-routing-key": meta.routing_key},
            },
        )
        metrics.DEAD_LETTERED.labels(keys.COMMANDS_QUEUE).inc()

    async def fail_safely(self, received: Received) -> None:
        """After an unexpected error: audit, dead-letter and answer ``internal``, each as far as
        it goes (whatever failed may fail again), and never raise."""
        failure = ValidationFailed(
            "internal", "cronbus could not handle this command; the error is logged"
        )
        metrics.COMMANDS.labels(
            received.verb if received.verb in models.VERBS else "unknown", "internal"
        ).inc()
        error = error_of(failure)
        steps: list[Callable[[], Awaitable[None]]] = [
            lambda: self.store.record_command(audit_of(received, "internal", error)),
            lambda: self.dead_letter(received, "internal: the error is in the dispatcher's log"),
        ]
        # Answered only where it was checked before the failure, and still may be.
        if received.meta.reply_to and self._checked(received.meta.reply_to):
            steps.append(lambda: self._answer_if_answerable(received.meta, error))
        for step in steps:
            try:
                await asyncio.wait_for(step(), FAIL_SAFE_TIMEOUT_S)
            except Exception:
                log.exception("could not report a failed command", extra={"action": "internal"})

    async def _answer_if_answerable(self, meta: Meta, error: dict[str, Any]) -> None:
        reply_to = meta.reply_to or ""
        checked = replies.shape_of(reply_to).route is Route.CHECK if reply_to else False
        if checked and not (await self.reply_queues.still_answerable(reply_to)).answer:
            return  # dead-lettered anyway
        await self.answer(meta, {"ok": False, "error": error})

    def _checked(self, reply_to: str) -> bool:
        route = replies.shape_of(reply_to).route
        if route is Route.CHECK:
            verdict = self.reply_queues.cache.get(reply_to, self.reply_queues.clock())
            return verdict is not None and verdict.answer
        return route is not Route.REFUSED

    async def reply(self, received: Received, reply: dict[str, Any]) -> None:
        """Answer an applied command, where the broker says right now that a reply may go: a
        kept verdict is not enough to write into a queue (its owner may have left, and another
        tenant may have declared that name since). Else the command is dead-lettered."""
        meta = received.meta
        if meta.reply_to and replies.shape_of(meta.reply_to).route is Route.CHECK:
            verdict = await self.reply_queues.still_answerable(meta.reply_to)
            if not verdict.answer:
                metrics.REPLY_TO_REFUSED.inc()
                log.warning(
                    "reply queue no longer exclusive: the applied command is not answered",
                    extra={"action": "reply_to_gone", "reply_to": meta.reply_to[:255]},
                )
                reason = replies.refusal_reason(meta.reply_to, verdict.reason)
                await self.dead_letter(received, f"invalid_command: {reason} (it was applied)")
                return
        await self.answer(meta, reply)

    async def answer(self, meta: Meta, reply: dict[str, Any]) -> None:
        if not meta.reply_to:
            return
        # Straight to the protocol channel: aio-pika's Message and Exchange layers cost more
        # per reply than the publish itself. Direct reply-to on the replies connection: the
        # broker closes the connection that publishes to a token it cannot place.
        if replies.shape_of(meta.reply_to).route is not Route.DIRECT:
            channel = await self.channel.get_underlay_channel()
            await self._publish(channel, meta, reply)
            return
        # One direct reply at a time, each confirmed: a token that makes the broker close the
        # connection then fails alone. Published side by side, the replies in flight with it
        # were lost with the connection (36 of 40 in tests/e2e/test_reply_queues.py).
        async with self.reply_queues.direct_publishing:
            channel = await self.reply_queues.direct_reply_channel()
            try:
                await self._publish(channel, meta, reply)
            except aiormq.exceptions.ConnectionInternalError:
                self._unplaceable(meta.reply_to)

    async def _publish(
        self, channel: aiormq.abc.AbstractChannel, meta: Meta, reply: dict[str, Any]
    ) -> None:
        # The broker's confirm is awaited, not the socket's drain: a drain per reply cost a
        # wake-up of the connection's writer for each (the confirm says more anyway). The
        # protocol channel takes ``wait``; its abstract class does not name it.
        await cast(aiormq.Channel, channel).basic_publish(
            codec.dumps(reply),
            exchange="",
            routing_key=meta.reply_to or "",
            properties=aiormq.spec.Basic.Properties(
                content_type="application/json", correlation_id=meta.correlation_id
            ),
            wait=False,
        )

    def _unplaceable(self, reply_to: str) -> None:
        # A token of the broker's shape naming a node it does not know: trying again would
        # close the replies connection again. The command was applied; its reply is lost.
        metrics.REPLY_TO_REFUSED.inc()
        log.warning(
            "the broker could not place a direct reply-to token",
            extra={"action": "reply_to_unplaceable", "reply_to": reply_to[:255]},
        )
