"""Reading AMQP frames whose strings are not UTF-8, without losing the connection.

The broker passes a property's bytes on as the publisher sent them. pamqp decodes every short
string (``reply_to``, ``correlation_id``, ``message_id``, a routing key, a header's name) as
UTF-8 and raises on anything else, inside the connection's reader: the connection dies, the
message comes back after the reconnect and kills it again. Installed, short strings that are
not UTF-8 are read with ``surrogateescape`` (each bad byte a lone surrogate, so the intake can
tell and refuse them), and a header table that cannot be read becomes one header,
``UNDECODABLE_HEADER``. Nothing valid reads any differently.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

from pamqp import decode

#: The one header a message's unreadable header table is read as.
UNDECODABLE_HEADER: Final = "x-cronbus-undecodable"

_TABLE_LENGTH = struct.Struct(">I")
_installed: dict[str, Callable[[bytes], tuple[int, Any]]] = {}


def tolerant_short_str(value: bytes) -> tuple[int, str]:
    try:
        return decode.short_str(value)
    except UnicodeDecodeError:
        length = value[0]
        return length + 1, value[1 : length + 1].decode("utf-8", "surrogateescape")


def tolerant_field_table(value: bytes) -> tuple[int, Any]:
    try:
        return _installed["table"](value)
    except UnicodeDecodeError:
        (length,) = _TABLE_LENGTH.unpack_from(value, 0)
        return length + 4, {UNDECODABLE_HEADER: "a header name is not UTF-8"}


def install() -> None:
    """Make pamqp's decoding tolerant (idempotent; for the whole process)."""
    if _installed:
        return
    _installed["shortstr"] = decode.METHODS["shortstr"]
    _installed["table"] = decode.METHODS["table"]
    decode.METHODS["shortstr"] = tolerant_short_str
    decode.METHODS["table"] = tolerant_field_table


def undecodable(text: str | None) -> bool:
    """Whether ``text`` holds bytes that were not UTF-8 (read as lone surrogates)."""
    return text is not None and any("\udc80" <= c <= "\udcff" for c in text)


def readable(text: str) -> str:
    """``text`` with each byte that was not UTF-8 shown as U+FFFD (safe to send on)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
