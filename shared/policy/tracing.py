"""W3C trace context for deliveries (pure): https://www.w3.org/TR/trace-context/

Every delivery carries ``traceparent: 00-<trace-id>-<span-id>-<flags>``. The trace id is the
occurrence's idempotency key (a UUID: 32 hex digits), so every attempt of one occurrence, and
whatever the receiver does about it, lands in one trace, and any process can name it without
carrying state. Span ids are derived from (key, attempt, stage), so the dispatcher's publish
span and the executor's delivery span can name each other without a change to the messages.
"""

from __future__ import annotations

import hashlib

VERSION = "00"
#: Flags: "sampled" only when cronbus itself exports its spans.
SAMPLED = "01"
NOT_SAMPLED = "00"


def trace_id(key: str) -> str:
    """The 32 hex digits of the occurrence's trace: its idempotency key without dashes."""
    return key.replace("-", "").lower()


def span_id(key: str, attempt: int, stage: str) -> str:
    """16 hex digits naming one stage (claim, publish, deliver, settle) of one attempt."""
    digest = hashlib.blake2b(f"{key}/{attempt}/{stage}".encode(), digest_size=8).hexdigest()
    return digest if digest != "0" * 16 else "0" * 15 + "1"  # all zeros is invalid


def traceparent(key: str, attempt: int, sampled: bool = False) -> str:
    """The header of one delivery attempt: its parent is the attempt's "deliver" span."""
    flags = SAMPLED if sampled else NOT_SAMPLED
    return f"{VERSION}-{trace_id(key)}-{span_id(key, attempt, 'deliver')}-{flags}"
