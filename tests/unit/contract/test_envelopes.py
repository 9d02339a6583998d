"""Envelopes: the commands routed together to one partition, read back as they went in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.contract import envelopes
from shared.contract.envelopes import BadEnvelope, Routed

text = st.one_of(st.none(), st.text(max_size=30))
commands = st.builds(
    Routed,
    routing_key=st.text(max_size=30),
    body=st.binary(max_size=200),
    reply_to=text,
    correlation_id=text,
    message_id=text,
    user_id=text,
    app_id=text,
    deliveries=st.integers(min_value=0, max_value=100),
    undecodable=st.lists(st.sampled_from(["reply_to", "headers", "routing_key"])).map(tuple),
)


@given(st.lists(commands, max_size=20))
def test_an_envelope_gives_back_its_commands_in_order(routed: list[Routed]) -> None:
    assert envelopes.unpacked(b"".join(envelopes.packed(c) for c in routed)) == routed


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x00\x00",  # a length cut short
        b"\x00\x00\x00\x09{}",  # a header cut short
        b"\x00\x00\x00\x02{}",  # no body length
        b"\x00\x00\x00\x02[]\x00\x00\x00\x00",  # a header that is not an object
        b'\x00\x00\x00\x08{"k": 1}\x00\x00\x00\x00',  # fields missing
    ],
)
def test_bytes_that_are_not_an_envelope_are_refused(data: bytes) -> None:
    with pytest.raises(BadEnvelope):
        envelopes.unpacked(data)
