"""A command as received, and the checks it passes before anything is written.

Everything here needs no I/O: the message's properties, its routing key, its body and the
command's own fields are checked in order, and ``Received`` is filled as each part becomes
known, so that a refusal at any step can still audit and dead-letter as much as was understood.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from services.dispatcher import batch
from shared.contract import codec, commands, keys, models, validation
from shared.contract.errors import ValidationFailed
from shared.contract.rows import CommandAudit
from shared.policy import partitions
from shared.rabbitmq import amqp, decoding
from shared.rules.plan import Plan
from shared.runtime.config import DispatcherSettings


@dataclass(frozen=True, slots=True)
class Meta:
    """Who sent a command and where to answer, from the AMQP properties."""

    routing_key: str
    reply_to: str | None = None
    correlation_id: str | None = None
    user_id: str | None = None
    app_id: str | None = None
    message_id: str | None = None

    #: The properties that were not UTF-8 (``shared.rabbitmq.decoding``): shown with U+FFFD
    #: above, and refused.
    undecodable: tuple[str, ...] = ()

    @classmethod
    def of(cls, message: AbstractIncomingMessage) -> Meta:
        properties = {
            "routing_key": message.routing_key or "",
            "reply_to": message.reply_to,
            "correlation_id": message.correlation_id,
            "user_id": message.user_id,
            "app_id": message.app_id,
            "message_id": message.message_id,
        }
        routed_undecodable: list[str] = []
        if message.exchange == keys.PARTITIONS_EXCHANGE:
            headers = message.headers or {}
            properties.update(_routed(headers))
            routed_undecodable = _named(headers.get(keys.ROUTED_UNDECODABLE_HEADER))
        bad = [name for name, value in properties.items() if decoding.undecodable(value)]
        bad += [name for name in routed_undecodable if name in properties and name not in bad]
        if decoding.UNDECODABLE_HEADER in (message.headers or {}):
            bad.append("headers")
        return cls(
            routing_key=decoding.readable(properties["routing_key"] or ""),
            reply_to=_readable(properties["reply_to"]),
            correlation_id=_readable(properties["correlation_id"]),
            user_id=_readable(properties["user_id"]),
            app_id=_readable(properties["app_id"]),
            message_id=_readable(properties["message_id"]),
            undecodable=tuple(bad),
        )


def _routed(headers: Mapping[str, Any]) -> dict[str, str | None]:
    """What the router carried over in headers (``keys.ROUTED_*``): the command as the user
    published it on ``cronbus.commands``."""

    def text(name: str) -> str | None:
        value = headers.get(name)
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        return value if isinstance(value, str) else None

    return {
        "routing_key": text(keys.ROUTED_KEY_HEADER) or "",
        "user_id": text(keys.ROUTED_USER_HEADER),
        "message_id": text(keys.ROUTED_MESSAGE_ID_HEADER),
    }


def _named(value: Any) -> list[str]:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value.split(",") if isinstance(value, str) and value else []


def _readable(value: str | None) -> str | None:
    return None if value is None else decoding.readable(value)


@dataclass(slots=True)
class Received:
    """A command as far as it is understood so far (what a refusal can audit)."""

    body: bytes
    meta: Meta
    #: Earlier deliveries of this message (the quorum queue's ``x-delivery-count``).
    deliveries: int = 0
    namespace: str | None = None
    verb: str | None = None
    parsed: Any = None
    command: models.Strict | None = None
    #: An upsert's checked plan (version 0).
    plan: Plan | None = None
    #: An upsert_many's schedules, each checked or refused on its own.
    items: list[batch.UpsertItem | ValidationFailed] = field(default_factory=list)
    #: The ``id`` each of those schedules gives (None: none that is a string).
    item_ids: list[str | None] = field(default_factory=list)


class ReplyToRefused(ValidationFailed):
    """``reply_to`` names a queue cronbus will not answer on (``shared.policy.replies``): the
    command is dead-lettered unanswered. Known by its class, never by a field's name: a body
    may well hold a field named ``reply_to``."""


class Unparseable(ValidationFailed):
    """The message is not a command at all (or keeps failing): it goes to the dead-letter
    queue, answered or not."""


def delivery_count(message: AbstractIncomingMessage) -> int:
    value = (message.headers or {}).get("x-delivery-count")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def split_routing_key(routing_key: str) -> tuple[str, str]:
    namespace, dot, verb = routing_key.partition(".")
    if not dot or not namespace or not verb:
        raise Unparseable(
            "invalid_command",
            f"routing key {routing_key!r} is not <namespace>.<verb>",
            [{"field": "routing_key", "reason": "must be <namespace>.<verb>"}],
        )
    return namespace, verb


class Checks:
    """The checks of a command in order, against the settings and the operator's target policy."""

    def __init__(self, settings: DispatcherSettings, now_ms: Callable[[], int]) -> None:
        self.settings = settings
        self.now_ms = now_ms
        self.policy = settings.target_policy()

    def validate(self, received: Received) -> None:
        """Everything that needs no I/O, in order; fills ``received`` as parts become known."""
        meta = received.meta
        if received.deliveries >= amqp.COMMAND_DELIVERY_LIMIT:
            raise Unparseable(
                "internal",
                f"the command was delivered {received.deliveries} times without an answer; "
                "it is kept in the dead-letter queue",
            )
        if meta.undecodable:
            raise ValidationFailed(
                "invalid_command",
                f"AMQP properties are not UTF-8: {', '.join(meta.undecodable)}",
                [{"field": name, "reason": "is not UTF-8"} for name in meta.undecodable],
            )
        if len(received.body) > self.settings.max_command_bytes:
            raise ValidationFailed(
                "too_large",
                f"the command is {len(received.body)} bytes; at most "
                f"{self.settings.max_command_bytes} are accepted",
                [
                    {
                        "field": "(body)",
                        "reason": f"is {len(received.body)} bytes, over the "
                        f"{self.settings.max_command_bytes} bytes allowed "
                        "(CRONBUS_MAX_COMMAND_BYTES)",
                    }
                ],
            )
        validation.check_properties(meta.message_id, meta.correlation_id)
        namespace, verb = split_routing_key(meta.routing_key)
        validation.check_namespace(namespace)
        received.namespace = namespace
        received.verb = verb
        try:
            received.parsed = validation.parse_body(received.body)
        except ValidationFailed as failure:
            raise Unparseable(failure.code, str(failure), failure.details) from None
        received.command = validation.parse_command(verb, received.parsed, received.body)
        if isinstance(received.command, commands.UpsertCommand):
            received.plan = validation.check_schedule(
                received.command.schedule, 0, self.now_ms(), self.policy, namespace=namespace
            )
        elif isinstance(received.command, commands.UpsertManyCommand):
            now = self.now_ms()
            raws = received.command.schedules
            received.items = [self._checked_item(namespace, raw, now) for raw in raws]
            received.item_ids = [schedule_id_of(raw) for raw in raws]

    def _checked_item(
        self, namespace: str, raw: Any, now_ms: int
    ) -> batch.UpsertItem | ValidationFailed:
        try:
            item = validation.parse_schedule(raw)
            plan = validation.check_schedule(item, 0, now_ms, self.policy, namespace=namespace)
        except ValidationFailed as failure:
            return failure
        return batch.UpsertItem(namespace, item, plan, brief=True)


def audit_of(received: Received, outcome: str, error: dict[str, Any] | None = None) -> CommandAudit:
    """The command's audit row, with as much of it as was understood."""
    meta = received.meta
    parsed = received.parsed
    return CommandAudit(
        namespace=received.namespace,
        verb=received.verb,
        schedule_id=schedule_id_of(parsed),
        outcome=outcome,
        body=parsed if isinstance(parsed, dict | list) else None,
        error=error,
        user_id=meta.user_id,
        app_id=meta.app_id,
        message_id=meta.message_id,
        correlation_id=meta.correlation_id,
    )


def provisional_turn(received: Received, max_bytes: int) -> tuple[str, list[str]]:
    """The namespace and schedules a command names, read before it is checked (its turn is
    taken before a wait for the broker): every schedule it may touch, as the checks will
    find them. A body that does not parse, or over ``max_bytes`` (refused whole), names the
    schedule ``""``."""
    namespace, _, verb = received.meta.routing_key.partition(".")
    parsed: Any = None
    if len(received.body) <= max_bytes:
        with contextlib.suppress(codec.DecodeError):
            parsed = codec.loads(received.body)
    if verb == "upsert_many" and isinstance(parsed, dict):
        schedules = parsed.get("schedules")
        if isinstance(schedules, list):
            return namespace, [i for i in (schedule_id_of(s) for s in schedules) if i] or [""]
    return namespace, [partitions.schedule_id_of(verb, parsed) or ""]


def schedule_ids_of(received: Received) -> list[str]:
    """The schedules a command touches (their locks keep commands on each in order)."""
    if isinstance(received.command, commands.UpsertManyCommand):
        return [item.schedule.id for item in received.items if isinstance(item, batch.UpsertItem)]
    return [schedule_id_of(received.parsed) or ""]


def schedule_id_of(parsed: Any) -> str | None:
    if not isinstance(parsed, dict):
        return None
    found = parsed.get("id")
    inner = parsed.get("schedule")
    if found is None and isinstance(inner, dict):
        found = inner.get("id")
    return found if isinstance(found, str) else None
