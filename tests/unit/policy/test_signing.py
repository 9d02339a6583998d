"""Standard Webhooks signatures, checked with the `standardwebhooks` package as the oracle."""

from __future__ import annotations

import base64
import re
import time

import pytest
import standardwebhooks
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy import signing

OLD = "whsec_" + base64.b64encode(b"o" * 32).decode()
NEW = "whsec_" + base64.b64encode(b"n" * 24).decode()
OTHER = "whsec_" + base64.b64encode(b"x" * 32).decode()


def verified(secret: str, body: bytes, headers: list[tuple[str, str]]) -> bool:
    try:
        standardwebhooks.Webhook(secret).verify(body, dict(headers), json_parse=False)
    except standardwebhooks.WebhookVerificationError:
        return False
    return True


@settings(max_examples=50)
@given(
    st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=80),
    st.binary(max_size=2000).map(lambda b: b.hex().encode()),
)
def test_every_secret_of_a_rotation_verifies_and_no_other(msg_id: str, body: bytes) -> None:
    secrets = signing.parse_secrets(b'{"acme": ["%s", "%s"]}' % (OLD.encode(), NEW.encode()))
    keys = signing.keys_for(secrets, "acme")
    headers = signing.headers(keys, msg_id, int(time.time()), body)
    assert [name for name, _ in headers] == ["webhook-id", "webhook-timestamp", "webhook-signature"]
    assert headers[0][1] == msg_id
    assert len(headers[2][1].split(" ")) == 2
    assert verified(OLD, body, headers)
    assert verified(NEW, body, headers)
    assert not verified(OTHER, body, headers)
    assert not verified(OLD, body + b"!", headers)


def test_namespaces_fall_back_to_star_and_otherwise_go_unsigned() -> None:
    secrets = signing.parse_secrets(b'{"acme": ["%s"], "*": ["%s"]}' % (OLD.encode(), NEW.encode()))
    assert signing.keys_for(secrets, "acme") == (b"o" * 32,)
    assert signing.keys_for(secrets, "billing") == (b"n" * 24,)
    only_acme = signing.parse_secrets(b'{"acme": ["%s"]}' % OLD.encode())
    assert signing.keys_for(only_acme, "billing") == ()
    assert signing.headers((), "id", 1, b"{}") == []


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"[1]", "must be a JSON object"),
        (b"{nope", "not valid JSON"),
        (b'{"acme": "whsec_x"}', "'acme': must be a list"),
        (b'{"acme": ["secret"]}', "'acme'[0]: must start with whsec_"),
        (b'{"acme": ["whsec_!!!"]}', "'acme'[0]: is not base64"),
        (b'{"acme": ["whsec_c2hvcnQ="]}', "'acme'[0]: must hold at least 16 bytes"),
    ],
)
def test_bad_secret_files_are_named(raw: bytes, reason: str) -> None:
    with pytest.raises(signing.SecretsError, match=re.escape(reason)):
        signing.parse_secrets(raw)
