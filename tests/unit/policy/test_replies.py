"""Where a reply may go: the shape of reply_to, the broker's answer, the verdicts kept."""

from __future__ import annotations

import base64
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.contract import keys
from shared.policy import replies
from shared.policy.replies import BrokerAnswer, Route, VerdictCache

#: A token RabbitMQ 3.10 made for a channel of ours (the pid, then the key).
GENUINE = "amq.rabbitmq.reply-to.g1h2AA1yZXBseUA5MjQ4ODg0AAADEgAAAABrB5cg.MzWPQbQAJh2pJJAXQazD3w=="


def pid(node: bytes, *, new: bool = True) -> bytes:
    if new:
        return b"\x83Xv" + struct.pack(">H", len(node)) + node + struct.pack(">III", 1, 2, 3)
    return b"\x83gd" + struct.pack(">H", len(node)) + node + struct.pack(">IIB", 1, 2, 3)


def token(term: bytes, key: bytes | None = b"k" * 16) -> str:
    text = keys.DIRECT_REPLY_TO + "." + base64.b64encode(term).decode()
    return text if key is None else text + "." + base64.b64encode(key).decode()


@pytest.mark.parametrize(
    ("reply_to", "route"),
    [
        ("amq.rabbitmq.reply-to", Route.DIRECT),
        (GENUINE, Route.DIRECT),
        (token(pid(b"rabbit@host")), Route.DIRECT),
        (token(pid(b"rabbit@host", new=False)), Route.DIRECT),
        (token(pid(b"reply@1"), key=None), Route.DIRECT),
        ("amq.gen-JzTY20BRgKO-HjmUJj0wLg", Route.SERVER_NAMED),
        ("amq_f0b7c0d9ac4f44dea9aa9ea05ab917c2", Route.CHECK),
        ("billing.inbox", Route.CHECK),
        ("amq.gen-", Route.CHECK),  # nothing after the prefix: not a name the broker gives
        # Crafted tokens that made RabbitMQ close the publishing connection.
        ("amq.rabbitmq.reply-to.a.b", Route.REFUSED),
        ("amq.rabbitmq.reply-to.AAAA.AAAA", Route.REFUSED),
        ("amq.rabbitmq.reply-to.gwAA.AAAA", Route.REFUSED),
        ("amq.rabbitmq.reply-to.g2gCZAAFbm9uZ.AAAA", Route.REFUSED),
        (token(pid(b"reply@1") + b"\x00"), Route.REFUSED),  # a byte after the pid
        (token(pid(b"nonode")), Route.REFUSED),
        (token(b"\x83a\x01"), Route.REFUSED),  # not a pid
        (token(pid(b"reply@1"))[:-4] + ".a", Route.REFUSED),  # a key that is not base64
        ("amq.rabbitmq.reply-to.", Route.REFUSED),
        ("amq.rabbitmq.reply-to.\u00e9", Route.REFUSED),
        ("q\x00", Route.REFUSED),
        ("q\n", Route.REFUSED),
        ("x" * 256, Route.REFUSED),
        ("\u00e9" * 128, Route.REFUSED),  # 256 bytes
        ("bad\udcff", Route.REFUSED),  # a byte that was not UTF-8
    ],
)
def test_the_route_of_a_reply_to(reply_to: str, route: Route) -> None:
    assert replies.shape_of(reply_to).route is route


@given(st.text(max_size=300))
def test_any_text_gets_a_route_and_refusals_say_why(reply_to: str) -> None:
    shape = replies.shape_of(reply_to)
    assert (shape.route is Route.REFUSED) == bool(shape.reason)


@given(st.binary(max_size=80), st.binary(max_size=80))
def test_only_a_pid_term_makes_a_direct_token(first: bytes, second: bytes) -> None:
    crafted = token(first, second or None)
    if replies.shape_of(crafted).route is Route.DIRECT:
        assert first[:2] in (b"\x83X", b"\x83g") and b"@" in first


@given(st.from_regex(r"[a-z]{1,20}@[a-z0-9.-]{1,40}", fullmatch=True), st.booleans())
def test_every_pid_on_a_named_node_is_a_direct_token(node: str, new: bool) -> None:
    assert replies.shape_of(token(pid(node.encode(), new=new))).route is Route.DIRECT


def test_only_an_exclusive_queue_of_another_connection_is_answered() -> None:
    assert replies.verdict_of(BrokerAnswer.LOCKED) == (True, "")
    for answer in (BrokerAnswer.NOT_FOUND, BrokerAnswer.DECLARED, BrokerAnswer.OTHER):
        answered, reason = replies.verdict_of(answer)
        assert not answered and reason


def test_verdicts_are_kept_ten_seconds_to_answer_two_to_refuse() -> None:
    cache = VerdictCache()
    cache.put("mine", True, "", now_s=100.0)
    cache.put("theirs", False, "names no queue", now_s=100.0)
    assert cache.get("mine", 109.9) is not None and cache.get("theirs", 101.9) is not None
    assert cache.get("theirs", 102.0) is None
    assert cache.get("mine", 110.0) is None
    assert len(cache) == 0


@given(st.lists(st.text(max_size=5), max_size=200), st.integers(1, 20))
def test_the_cache_keeps_at_most_its_bound_and_the_latest_name(
    names: list[str], bound: int
) -> None:
    cache = VerdictCache(max_names=bound)
    for name in names:
        cache.put(name, True, "", now_s=0.0)
        assert len(cache) <= bound
        assert cache.get(name, 1.0) is not None


def test_the_least_recently_used_name_goes_first() -> None:
    cache = VerdictCache(max_names=2)
    cache.put("a", True, "", 0.0)
    cache.put("b", True, "", 0.0)
    cache.get("a", 1.0)
    cache.put("c", True, "", 0.0)
    assert cache.get("a", 1.0) is not None and cache.get("b", 1.0) is None


@given(st.text(min_size=1, max_size=40))
def test_a_name_cronbus_cannot_check_is_refused_never_asked_about(name: str) -> None:
    """The check is a passive declare: a name the AMQP client cannot declare (pamqp takes
    only these characters) is refused by its shape, never an error inside the intake."""
    checkable = all(c.isascii() and (c.isalnum() or c in "-_.:@#,/+ ") for c in name)
    shape = replies.shape_of("acme." + name)
    if checkable:
        assert shape.route is Route.CHECK
    else:
        assert shape.route is Route.REFUSED and shape.reason


def test_names_with_accents_or_punctuation_are_refused_with_the_characters_allowed() -> None:
    for name in ("amq_\u00e9t\u00e9", "q!", "q*", "q=", "acme.r\u00e9ponses"):
        shape = replies.shape_of(name)
        assert shape.route is Route.REFUSED
        assert "letters, digits" in shape.reason
