"""Which exchanges an AMQP target may publish to: the pinned default, the reserved names that no
setting opens, and globs that come only from the operator."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.policy import exchanges
from shared.policy.exchanges import ExchangePolicy

NAMESPACES = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,62}", fullmatch=True)
#: Any text an exchange name could hold (RabbitMQ takes up to 255 bytes of UTF-8).
NAMES = st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)
#: Globs that match everything, or nearly: none may open a reserved name.
WIDE_GLOBS = st.sampled_from(["*", "**", "*.*", "?*", "[a-zA-Z]*", "a*,*", "{namespace}*,*"])
RESERVED = st.sampled_from(["amq.", "AMQ.", "Amq.", "cronbus.", "CRONBUS.", "CronBus."])


@pytest.mark.parametrize(
    ("namespace", "exchange", "allowed"),
    [
        ("billing", "billing", True),
        ("billing", "billing.jobs", True),
        ("billing", "billing.jobs.nightly", True),
        ("billing", "billing.", True),  # "{namespace}.*": the star may match nothing
        ("evil", "billing", False),
        ("evil", "billing.jobs", False),
        ("evil", "evilx", False),
        ("evil", "evil-jobs", False),
        ("evil", "Evil", False),  # exchange names are case-sensitive
        ("evil", "xevil", False),
        ("evil", "", False),
        ("evil", "amq.topic", False),
        ("evil", "amq.direct", False),
        ("evil", "cronbus.commands", False),
        ("evil", "cronbus.events", False),
        ("cronbus", "cronbus", True),  # a namespace of that name keeps its own exchange
        ("cronbus", "cronbus.jobs", False),  # ... but never cronbus.*
        ("amq", "amq.jobs", False),
    ],
)
def test_the_default_allows_the_namespace_and_its_children_only(
    namespace: str, exchange: str, allowed: bool
) -> None:
    assert ExchangePolicy().allows(namespace, exchange) is allowed


def test_the_default_is_the_pinned_one() -> None:
    assert exchanges.DEFAULT == "{namespace},{namespace}.*"
    assert ExchangePolicy().globs == ("{namespace}", "{namespace}.*")
    assert ExchangePolicy.from_text(exchanges.DEFAULT) == ExchangePolicy()


@pytest.mark.parametrize(
    ("exchange", "words"),
    [
        ("", ["default exchange", exchanges.SETTING]),
        ("amq.topic", ["reserved", "amq.*", exchanges.SETTING]),
        ("cronbus.commands", ["reserved", "cronbus.*", exchanges.SETTING]),
        ("billing", ["'billing'", "'evil'", exchanges.SETTING, "{namespace},{namespace}.*"]),
    ],
)
def test_a_refusal_says_which_setting_and_which_globs(exchange: str, words: list[str]) -> None:
    reason = ExchangePolicy().refusal("evil", exchange)
    assert reason is not None
    for word in words:
        assert word in reason, (word, reason)


def test_a_refusal_shows_the_globs_as_they_apply_to_the_namespace() -> None:
    reason = ExchangePolicy.from_text("{namespace}, shared.*").refusal("evil", "billing")
    assert reason is not None and "'evil,shared.*'" in reason


def test_an_operator_may_open_chosen_exchanges() -> None:
    policy = ExchangePolicy.from_text("{namespace},{namespace}.*, billing , audit.*")
    assert policy.allows("evil", "billing")
    assert policy.allows("evil", "audit.log")
    assert not policy.allows("evil", "billing.x")
    assert policy.allows("evil", "evil.jobs")


def test_an_empty_setting_allows_nothing() -> None:
    policy = ExchangePolicy.from_text(" , ")
    assert policy.globs == ()
    reason = policy.refusal("evil", "evil")
    assert reason is not None and "'empty'" in reason and "'nothing'" in reason


@given(NAMESPACES, WIDE_GLOBS, RESERVED, NAMES)
def test_no_glob_opens_a_reserved_exchange(
    namespace: str, globs: str, prefix: str, rest: str
) -> None:
    policy = ExchangePolicy.from_text(globs)
    assert not policy.allows(namespace, prefix + rest)
    assert not policy.allows(namespace, "")


@given(NAMESPACES, st.sampled_from(["*", "**", "x,*", "{namespace}.*,*"]), NAMES)
def test_a_glob_of_everything_allows_anything_not_reserved(
    namespace: str, globs: str, name: str
) -> None:
    # The reserved names stay closed (above); everything else is the operator's to open.
    reserved = name == "" or name.casefold().startswith(("amq.", "cronbus."))
    assert ExchangePolicy.from_text(globs).allows(namespace, name) is not reserved


@given(NAMESPACES, NAMESPACES, NAMES)
def test_by_default_a_namespace_reaches_no_other_namespaces_exchange(
    namespace: str, other: str, suffix: str
) -> None:
    exchange = other + suffix
    allowed = ExchangePolicy().allows(namespace, exchange)
    assert allowed == (exchange == namespace or exchange.startswith(namespace + "."))


@given(NAMES, NAMES)
def test_glob_characters_in_a_namespace_are_literal(namespace: str, exchange: str) -> None:
    # Namespaces are checked before this, but the policy does not lean on it: a "*" in the
    # namespace matches a "*" and nothing else.
    allowed = ExchangePolicy().allows(namespace, exchange)
    assert allowed == (
        exchanges.reserved_refusal(exchange) is None
        and (exchange == namespace or exchange.startswith(namespace + "."))
    )


@given(NAMESPACES, NAMES)
def test_the_answer_is_a_reason_or_none(namespace: str, exchange: str) -> None:
    reason = ExchangePolicy().refusal(namespace, exchange)
    assert reason is None or (isinstance(reason, str) and exchanges.SETTING in reason)
