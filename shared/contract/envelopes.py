"""Routed commands travel to their partition several to a message: an envelope (pure).

The router moves every command from ``cronbus.commands`` to its partition. One message per
command doubled the intake's AMQP work (a publish, its confirm, a delivery and an ack more per
command); in an envelope, the commands routed together to one partition cost one of each. An
envelope holds, in order, each command's body untouched and what the intake needs of its
AMQP properties (already made readable by the router, see ``shared.rabbitmq.decoding``).

Layout: for each command, a 4-byte big-endian length and a JSON header, then a 4-byte length
and the body.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from shared.contract import codec

#: Header of a message that is an envelope: how many commands it holds.
ENVELOPE_HEADER = "x-cronbus-envelope"
#: The most commands, and bytes, in one envelope (a bound on what one delivery holds back).
MAX_COMMANDS = 500
MAX_BYTES = 4 * 1024 * 1024

_LENGTH = struct.Struct(">I")


class BadEnvelope(ValueError):
    """Bytes that are not an envelope the router wrote."""


@dataclass(frozen=True, slots=True)
class Routed:
    """One command as the router received it."""

    routing_key: str
    body: bytes
    reply_to: str | None = None
    correlation_id: str | None = None
    message_id: str | None = None
    user_id: str | None = None
    app_id: str | None = None
    #: Its deliveries from ``cronbus.commands`` (the broker's ``x-delivery-count``).
    deliveries: int = 0
    #: The properties that were not UTF-8, by name (``headers``: the table).
    undecodable: tuple[str, ...] = ()


def packed(command: Routed) -> bytes:
    """One command's bytes in an envelope."""
    header = codec.dumps(
        {
            "k": command.routing_key,
            "r": command.reply_to,
            "c": command.correlation_id,
            "m": command.message_id,
            "u": command.user_id,
            "a": command.app_id,
            "d": command.deliveries,
            "x": list(command.undecodable),
        }
    )
    return b"".join(
        (_LENGTH.pack(len(header)), header, _LENGTH.pack(len(command.body)), command.body)
    )


def unpacked(data: bytes) -> list[Routed]:
    """The commands of an envelope, in order."""
    commands = []
    at = 0
    while at < len(data):
        header, at = _chunk(data, at)
        body, at = _chunk(data, at)
        commands.append(_routed(header, body))
    return commands


def _chunk(data: bytes, at: int) -> tuple[bytes, int]:
    if at + 4 > len(data):
        raise BadEnvelope("a length is cut short")
    (length,) = _LENGTH.unpack_from(data, at)
    end = at + 4 + length
    if end > len(data):
        raise BadEnvelope("a part is cut short")
    return data[at + 4 : end], end


def _routed(header: bytes, body: bytes) -> Routed:
    try:
        fields: Any = codec.loads(header)
        return Routed(
            routing_key=_text(fields["k"]) or "",
            body=body,
            reply_to=_text(fields["r"]),
            correlation_id=_text(fields["c"]),
            message_id=_text(fields["m"]),
            user_id=_text(fields["u"]),
            app_id=_text(fields["a"]),
            deliveries=int(fields["d"]),
            undecodable=tuple(str(name) for name in fields["x"]),
        )
    except (codec.DecodeError, KeyError, TypeError, ValueError) as exc:
        raise BadEnvelope(f"a command's header cannot be read: {exc}") from None


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"{value!r} is not text")
