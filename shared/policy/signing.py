"""Standard Webhooks signatures (pure): https://www.standardwebhooks.com/

A signed delivery carries ``webhook-id`` (the idempotency key), ``webhook-timestamp`` (Unix
seconds) and ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` for
each of the namespace's secrets, space-separated, so a receiver keeps verifying while secrets
rotate (add the new secret, move receivers to it, then drop the old one).

Secrets are configured per namespace (``"*"`` for the others) as ``whsec_<base64>`` strings.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from shared.contract import codec

PREFIX = "whsec_"
MAX_SECRETS_PER_NAMESPACE = 10

Secrets = Mapping[str, tuple[bytes, ...]]


class SecretsError(ValueError):
    """The signing secrets file is not what it should be."""


def parse_secrets(raw: bytes) -> dict[str, tuple[bytes, ...]]:
    """The file's JSON -> namespace (or "*") -> secret keys; SecretsError naming the problem."""
    try:
        data: Any = codec.loads(raw)
    except codec.DecodeError as exc:
        raise SecretsError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SecretsError('must be a JSON object from namespace (or "*") to a list of secrets')
    return {str(namespace): _keys_of(str(namespace), value) for namespace, value in data.items()}


def _keys_of(namespace: str, value: Any) -> tuple[bytes, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise SecretsError(f"{namespace!r}: must be a list of {PREFIX}... strings")
    if len(value) > MAX_SECRETS_PER_NAMESPACE:
        raise SecretsError(f"{namespace!r}: at most {MAX_SECRETS_PER_NAMESPACE} secrets")
    return tuple(_key_of(namespace, index, item) for index, item in enumerate(value))


def _key_of(namespace: str, index: int, secret: str) -> bytes:
    if not secret.startswith(PREFIX):
        raise SecretsError(f"{namespace!r}[{index}]: must start with {PREFIX}")
    try:
        key = base64.b64decode(secret[len(PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise SecretsError(f"{namespace!r}[{index}]: is not base64 after {PREFIX}") from None
    if len(key) < 16:
        raise SecretsError(f"{namespace!r}[{index}]: must hold at least 16 bytes")
    return key


def keys_for(secrets: Secrets, namespace: str) -> tuple[bytes, ...]:
    """The namespace's own secrets, else the "*" ones, else none (deliveries go unsigned)."""
    found = secrets.get(namespace)
    if found is None:
        found = secrets.get("*", ())
    return found


def signature(keys: tuple[bytes, ...], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: one ``v1,<base64>`` per key, space-separated."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.digest(key, signed, hashlib.sha256)).decode() for key in keys
    )


def headers(
    keys: tuple[bytes, ...], msg_id: str, timestamp: int, body: bytes
) -> list[tuple[str, str]]:
    """The three Standard Webhooks headers, or none when there is no key."""
    if not keys:
        return []
    return [
        ("webhook-id", msg_id),
        ("webhook-timestamp", str(timestamp)),
        ("webhook-signature", signature(keys, msg_id, timestamp, body)),
    ]
