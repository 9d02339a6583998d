"""Frames whose strings are not UTF-8 are read, not fatal (shared.rabbitmq.decoding)."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st
from pamqp import commands, decode

from shared.rabbitmq import decoding


def short(raw: bytes) -> bytes:
    return struct.pack(">B", len(raw)) + raw


@given(st.binary(max_size=255))
def test_any_short_string_is_read_and_its_bad_bytes_are_told(raw: bytes) -> None:
    decoding.install()
    consumed, text = decode.by_type(short(raw) + b"rest", "shortstr")
    assert consumed == len(raw) + 1 and isinstance(text, str)
    try:
        assert text == raw.decode() and not decoding.undecodable(text)
    except UnicodeDecodeError:
        assert decoding.undecodable(text)
        assert text.encode("utf-8", "surrogateescape") == raw
        decoding.readable(text).encode()  # sent on as valid UTF-8


def test_properties_of_raw_bytes_are_read_and_valid_ones_unchanged() -> None:
    decoding.install()
    good = commands.Basic.Properties(reply_to="amq_1", correlation_id="c", headers={"a": 1})
    wire = good.marshal()
    same = commands.Basic.Properties()
    same.unmarshal(struct.unpack(">H", wire[:2])[0], wire[2:])
    assert (same.reply_to, same.correlation_id, same.headers) == ("amq_1", "c", {"a": 1})
    # The same frame with reply_to's bytes replaced by bytes that are not UTF-8.
    bad = wire.replace(short(b"amq_1"), short(b"amq\xff\xfe"))
    read = commands.Basic.Properties()
    read.unmarshal(struct.unpack(">H", bad[:2])[0], bad[2:])
    assert read.reply_to is not None and decoding.undecodable(read.reply_to)
    assert (read.correlation_id, read.headers) == ("c", {"a": 1})


def test_a_header_table_with_a_name_that_is_not_utf8_becomes_one_header() -> None:
    decoding.install()
    entry = b"\x04x-\xff\xfeS" + struct.pack(">I", 1) + b"v"
    table = struct.pack(">I", len(entry)) + entry
    consumed, value = decode.by_type(table + b"after", "table")
    assert consumed == len(table)
    assert value == {decoding.UNDECODABLE_HEADER: "a header name is not UTF-8"}


def test_installing_twice_keeps_the_first_decoders() -> None:
    decoding.install()
    decoding.install()
    assert decode.METHODS["shortstr"] is decoding.tolerant_short_str
    assert decoding._installed["shortstr"] is decode.short_str
