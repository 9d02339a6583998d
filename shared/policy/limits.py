"""Per-target rate limits, Retry-After and circuit breakers: the pure parts.

Every delivery has a *rate key*: the target's ``rate_key``, or ``scheme://host:port`` of a
webhook URL, or ``amqp:<exchange>``, always inside the schedule's namespace, so tenants never
share a bucket, a hold or a breaker. The shared state lives in Redis (``gate.lua``,
``report.lua``); this module names the keys and reads ``Retry-After``.
"""

from __future__ import annotations

import email.utils
import functools
import math
from dataclasses import dataclass
from enum import Enum
from typing import Protocol
from urllib.parse import urlsplit

from shared.contract import timefmt
from shared.rules.plan import TargetPlan, WebhookPlan

_DEFAULT_PORTS = {"http": 80, "https": 443}
#: The most a Retry-After is read as before the operator's cap applies (a day).
MAX_RETRY_AFTER_MS = 86_400_000
#: Statuses whose Retry-After holds the rate key.
BACKPRESSURE_STATUSES = frozenset({429, 503})
#: The 4xx answer that speaks for the host (it asks everyone to slow down), not for one request.
TOO_MANY_REQUESTS = 429


class Health(Enum):
    """What one attempt says about the host behind its rate key."""

    #: The host answered: a success, a 4xx about that one request (404, 400, 410, ...), or
    #: an AMQP broker returning one message as unroutable.
    UP = "up"
    #: The host is unhealthy: no answer (refused, reset, timed out), a 5xx, or a 429.
    DOWN = "down"
    #: Nothing was sent (refused by the operator's policy, a secret missing): no news.
    UNKNOWN = "unknown"


class Attempt(Protocol):
    """The parts of a delivery outcome the breaker looks at."""

    @property
    def ok(self) -> bool: ...
    @property
    def http_status(self) -> int | None: ...
    @property
    def reached(self) -> bool: ...
    @property
    def sent(self) -> bool: ...


def attempt_health(outcome: Attempt) -> Health:
    """UP, DOWN or UNKNOWN: the circuit breaker counts DOWN attempts and closes on UP ones.

    A 404 on one schedule's path says the host is up; counting it would let one broken
    schedule open the breaker for every healthy schedule sharing the host."""
    if not outcome.sent:
        return Health.UNKNOWN
    if outcome.ok:
        return Health.UP
    if not outcome.reached:
        return Health.DOWN
    status = outcome.http_status
    if status is None:
        # Reached with no HTTP status: the AMQP broker returned the message as unroutable,
        # which is about that message's routing, not the broker's health.
        return Health.UP
    if status >= 500 or status == TOO_MANY_REQUESTS:
        return Health.DOWN
    return Health.UP


def rate_key(namespace: str, target: TargetPlan) -> str:
    """The namespaced rate key of a target: ``<namespace>|<key>``."""
    if target.rate_key is not None:
        key = target.rate_key
    elif isinstance(target, WebhookPlan):
        key = origin(target.url)
    else:
        key = f"amqp:{target.exchange}"
    return f"{namespace}|{key}"


@functools.lru_cache(maxsize=65_536)  # pure, and asked once per delivery of the same URLs
def origin(url: str) -> str:
    """``scheme://host:port`` of a URL, with the scheme's default port made explicit."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{scheme}://{host}:{port or _DEFAULT_PORTS.get(scheme, 0)}"


def retry_after_ms(value: str | None, now_ms: int, cap_ms: int) -> int | None:
    """How long a ``Retry-After`` value (delay-seconds or an HTTP date) asks to wait, in ms,
    capped at ``cap_ms``; None when absent or unreadable. A date in the past asks for 0."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return min(int(text) * 1000, cap_ms)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    wait = math.ceil(when.timestamp() * 1000) - now_ms
    return min(max(wait, 0), cap_ms)


@dataclass(frozen=True, slots=True)
class Bucket:
    """GCRA parameters of a limit: one delivery per ``interval_ms``, ``burst`` at once."""

    interval_ms: float
    burst: int


def bucket_of(target: TargetPlan) -> Bucket | None:
    if target.rate_per_s is None:
        return None
    return Bucket(1000 / target.rate_per_s, target.rate_burst)


def breaker_view(
    namespaced_key: str, fails: int, open_until: int, hold_until: int, now_ms: int
) -> dict[str, object]:
    """The ``breaker`` object of a get reply: the rate key (without its namespace), the
    breaker's state, and any Retry-After hold. An open breaker whose cooldown passed is
    ``half_open`` (one probe goes) until a success closes it."""
    if open_until > now_ms:
        state = "open"
    elif open_until > 0:
        state = "half_open"
    else:
        state = "closed"
    return {
        "rate_key": namespaced_key.partition("|")[2],
        "state": state,
        "consecutive_failures": fails,
        "open_until": timefmt.format_ms(open_until) if state == "open" else None,
        "held_until": timefmt.format_ms(hold_until) if hold_until > now_ms else None,
    }
