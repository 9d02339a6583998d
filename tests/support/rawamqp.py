"""Publishing what a careless or hostile AMQP client sends: short strings that are not UTF-8,
and a header table whose name is not UTF-8 (pamqp, the encoder aio-pika uses, refuses both)."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from typing import Any

import pamqp.encode

#: Mark a message's headers with this key to have them sent as ``RAW_TABLE``.
RAW_HEADERS_MARK = "x-raw"
RAW_TABLE_ENTRY = b"\x04x-\xff\xfeS" + struct.pack(">I", 1) + b"v"


@contextlib.contextmanager
def raw_strings() -> Iterator[None]:
    """While open, this process publishes each lone surrogate of a short string as the raw byte
    it stands for (``"amq_\\udcff"`` goes out as ``b"amq_\\xff"``), and headers holding
    ``RAW_HEADERS_MARK`` as one header whose name is not UTF-8."""
    saved = dict(pamqp.encode.METHODS)

    def short_string(value: str) -> bytes:
        raw = value.encode("utf-8", "surrogateescape")
        return struct.pack(">B", len(raw)) + raw

    def table(value: dict[str, Any]) -> bytes:
        if RAW_HEADERS_MARK not in value:
            return saved["table"](value)
        return struct.pack(">I", len(RAW_TABLE_ENTRY)) + RAW_TABLE_ENTRY

    pamqp.encode.METHODS["shortstr"] = short_string
    pamqp.encode.METHODS["table"] = table
    try:
        yield
    finally:
        pamqp.encode.METHODS.update(saved)
