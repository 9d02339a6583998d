"""The pinned public contract as pydantic models: schedules, command bodies and replies.

Structural rules live here (types, ranges, unknown fields, syntax of ids, cron and zones).
Rules that need the clock or the operator's policy (a spec that never fires, a target that is
not allowed) live in ``shared.contract.validation``.
"""

from __future__ import annotations

import functools
import re
import zoneinfo
from datetime import datetime
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    PlainSerializer,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from shared.contract import timefmt
from shared.policy import netpolicy
from shared.rules import cron

# Priorities run from -MAX_PRIORITY to MAX_PRIORITY; a rebuild streams the highest first.
MAX_PRIORITY = 1000

# \Z, not $: "$" also matches before a trailing newline, which would let "acme\n" through.
NAMESPACE_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}\Z")
SCHEDULE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}\Z")
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}\Z")
HTTP_URL_RE = re.compile(r"^https?://[^/\s?#]+")
URL_CREDENTIALS_RE = re.compile(r"^https?://[^/]*@")
HEADER_NAME_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}\Z")
#: C0 controls and DEL; a header value may hold a tab (HTTP allows it), nothing else of these.
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
HEADER_VALUE_CONTROL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
#: A secret's name is one file name under CRONBUS_SECRETS_DIR/<namespace>/: no separators, no
#: "." or "..", nothing hidden.
SECRET_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z", re.ASCII)
#: Headers cronbus sets itself, or that belong to the HTTP connection: a schedule may not set them.
RESERVED_HEADERS = frozenset(
    {"idempotency-key", "host", "content-length", "transfer-encoding", "connection"}
    | {"webhook-id", "webhook-timestamp", "webhook-signature", "traceparent", "tracestate"}
)
RESERVED_HEADER_PREFIX = "x-cronbus-"
MAX_LABELS = 64
MAX_LABEL_VALUE = 256
MAX_HEADERS = 64
MAX_HEADER_VALUE = 4096
MAX_EXCLUSIONS = 100
VERBS = (
    "upsert",
    "delete",
    "pause",
    "resume",
    "trigger",
    "get",
    "list",
    "upsert_many",
    "backfill",
)
#: Occurrences a backfill delivers when its command does not say, and the most it may.
BACKFILL_DEFAULT_LIMIT = 1000
BACKFILL_MAX_LIMIT = 100_000
#: Most schedules one upsert_many command carries.
MAX_UPSERT_MANY = 1000
#: The instants a schedule may name: the Unix epoch up to the end of year 9999 (UTC).
EARLIEST_INSTANT = "1970-01-01T00:00:00Z"
LATEST_INSTANT = "9999-12-31T23:59:59.999Z"


def _parse_instant(value: object) -> datetime:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("must carry a time zone, like 2027-01-01T09:00:00Z")
        return value
    if not isinstance(value, str):
        raise ValueError("must be an RFC 3339 time string, like 2027-01-01T09:00:00Z")
    ms = timefmt.parse_rfc3339_ms(value)
    if not timefmt.MIN_MS <= ms <= timefmt.MAX_MS:
        raise ValueError(f"must be between {EARLIEST_INSTANT} and {LATEST_INSTANT}")
    return timefmt.ms_to_datetime(ms)


def _format_instant(value: datetime) -> str:
    return timefmt.format_ms(timefmt.datetime_to_ms(value))


#: An RFC 3339 instant on input; always written back in UTC with a ``Z``.
Instant = Annotated[
    datetime, BeforeValidator(_parse_instant), PlainSerializer(_format_instant, return_type=str)
]


#: The validation context of a reply from cronbus (``replies.stored``): a newer cronbus's
#: unknown fields are dropped at every level instead of refused. What users send is validated
#: without it, strictly.
REPLY_CONTEXT = {"reply": True}


class Strict(BaseModel):
    """Unknown fields are refused, types are not coerced, values are immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_in_replies(cls, data: Any, info: ValidationInfo) -> Any:
        reply = isinstance(info.context, dict) and info.context.get("reply")
        if not reply or not isinstance(data, dict) or cls.model_config.get("extra") == "allow":
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return {key: value for key, value in data.items() if key in known}


class Exclusion(Strict):
    """One ``spec.exclude`` entry: ``{"cron": expr}`` or ``{"from": t, "to": t}``."""

    #: Matched against the occurrence's local time in the schedule's zone (UTC without one).
    cron: str | None = Field(default=None, min_length=1, max_length=256)
    #: Start of an excluded range (inclusive).
    from_: Instant | None = Field(default=None, alias="from")
    #: End of an excluded range (exclusive).
    to: Instant | None = None

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, populate_by_name=False, serialize_by_alias=True
    )

    @model_serializer(mode="wrap")
    def _only_the_given_form(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        return {name: value for name, value in dumped.items() if value is not None}

    @field_validator("cron")
    @classmethod
    def _cron_parses(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                cron.parse(value)
            except cron.CronError as exc:
                raise ValueError(exc.reason) from None
        return value

    @model_validator(mode="after")
    def _one_form(self) -> Exclusion:
        ranged = self.from_ is not None or self.to is not None
        if self.cron is not None and ranged:
            raise ValueError('give either "cron" or "from" and "to", not both')
        if self.cron is None and (self.from_ is None or self.to is None):
            raise ValueError('needs "cron", or both "from" and "to"')
        if self.from_ is not None and self.to is not None and self.to <= self.from_:
            raise ValueError('"to" must be after "from"')
        return self


class SpecCommon(Strict):
    #: No fire before this instant (an interval's grid is anchored here).
    start_at: Instant | None = None
    #: No fire after this instant.
    end_at: Instant | None = None
    #: Stop after this many regular fires.
    max_fires: int | None = Field(default=None, ge=1)
    #: Nominal times that are not delivered (holidays, maintenance windows).
    exclude: list[Exclusion] = Field(default_factory=list, max_length=MAX_EXCLUSIONS)

    @model_validator(mode="after")
    def _window_is_ordered(self) -> SpecCommon:
        if self.start_at and self.end_at and self.end_at <= self.start_at:
            raise ValueError("end_at must be after start_at")
        return self


class CronSpec(SpecCommon):
    kind: Literal["cron"]
    #: 5 fields, or 6 with seconds first.
    expr: str = Field(min_length=1, max_length=256)
    #: IANA zone the expression is read in.
    timezone: str = "UTC"

    @field_validator("expr")
    @classmethod
    def _expr_parses(cls, value: str) -> str:
        try:
            cron.parse(value)
        except cron.CronError as exc:
            raise ValueError(exc.reason) from None
        return value

    @field_validator("timezone")
    @classmethod
    def _zone_exists(cls, value: str) -> str:
        load_zone(value)
        return value


class IntervalSpec(SpecCommon):
    kind: Literal["interval"]
    #: Fixed rate: fires on a grid anchored at start_at (or the Unix epoch).
    every_s: float = Field(ge=1, le=366 * 86_400)


class AfterCompletionSpec(SpecCommon):
    kind: Literal["after_completion"]
    #: Fixed delay: fires this long after the previous occurrence finished.
    delay_s: float = Field(ge=1, le=366 * 86_400)


class OnceSpec(SpecCommon):
    kind: Literal["once"]
    at: Instant


Spec = Annotated[
    CronSpec | IntervalSpec | AfterCompletionSpec | OnceSpec, Field(discriminator="kind")
]


def _check_headers(headers: dict[str, str]) -> dict[str, str]:
    if len(headers) > MAX_HEADERS:
        raise ValueError(f"at most {MAX_HEADERS} headers are allowed")
    for name, value in headers.items():
        if not HEADER_NAME_RE.match(name):
            raise ValueError(f"{name!r} is not a valid header name")
        lowered = name.lower()
        if lowered in RESERVED_HEADERS or lowered.startswith(RESERVED_HEADER_PREFIX):
            raise ValueError(f"{name!r} is set by cronbus and may not be overridden")
        if HEADER_VALUE_CONTROL_RE.search(value) or len(value) > MAX_HEADER_VALUE:
            raise ValueError(
                f"value of {name!r} must be one line of at most {MAX_HEADER_VALUE} characters "
                "without control characters"
            )
    return headers


class RateLimit(Strict):
    """``target.rate_limit``: deliveries to the target's rate key, across all executors."""

    #: Sustained deliveries per second.
    per_s: float = Field(gt=0, le=100_000)
    #: Deliveries that may go at once after a quiet spell (default: one second's worth).
    burst: int | None = Field(default=None, ge=1, le=100_000)


RATE_KEY_RE = re.compile(r"^[!-~]{1,200}$")


def _check_rate_key(value: str | None) -> str | None:
    if value is not None and not RATE_KEY_RE.match(value):
        raise ValueError("must be 1-200 printable ASCII characters without spaces")
    return value


class WebhookTarget(Strict):
    kind: Literal["webhook"]
    url: str = Field(min_length=1, max_length=2048)
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"
    headers: dict[str, str] = Field(default_factory=dict)
    #: Sent as JSON (omitted when null).
    body: JsonValue = None
    timeout_s: float = Field(default=10, gt=0, le=300)
    #: HTTP statuses that count as success; any 2xx when omitted.
    success_codes: list[int] | None = Field(default=None, min_length=1, max_length=100)
    #: Header name -> name of a secret read at delivery from CRONBUS_SECRETS_DIR/<namespace>/;
    #: only the names are stored.
    secret_headers: dict[str, str] = Field(default_factory=dict)
    rate_limit: RateLimit | None = None
    #: Deliveries sharing a rate key share its limit, Retry-After holds and breaker (within
    #: the namespace); default scheme://host:port of the URL.
    rate_key: str | None = None

    @field_validator("rate_key")
    @classmethod
    def _rate_key_is_printable(cls, value: str | None) -> str | None:
        return _check_rate_key(value)

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, value: str) -> str:
        problem = url_refusal(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("headers")
    @classmethod
    def _headers_are_allowed(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_headers(value)

    @field_validator("secret_headers")
    @classmethod
    def _secret_headers_are_allowed(cls, value: dict[str, str]) -> dict[str, str]:
        _check_headers(dict.fromkeys(value, ""))
        for name, secret in value.items():
            if not SECRET_NAME_RE.match(secret):
                raise ValueError(
                    f"secret name of {name!r} must be 1-128 letters, digits, '.', '_' or '-', "
                    "starting with a letter or digit"
                )
        return value

    @model_validator(mode="after")
    def _headers_are_set_once(self) -> WebhookTarget:
        if not self.secret_headers:
            return self  # nothing to clash with, and ``headers`` alone is bounded already
        plain = {name.lower() for name in self.headers}
        secret = {name.lower() for name in self.secret_headers}
        if len(plain) + len(secret) > MAX_HEADERS:
            raise ValueError(f"at most {MAX_HEADERS} headers are allowed")
        both = sorted(plain & secret)
        if both:
            raise ValueError(f"{both[0]!r} is both in headers and in secret_headers")
        return self

    @field_validator("success_codes")
    @classmethod
    def _codes_are_http(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(not 100 <= code <= 599 for code in value):
            raise ValueError("every code must be an HTTP status between 100 and 599")
        return value


#: RabbitMQ's limit on an exchange name or routing key (an AMQP short string).
MAX_AMQP_NAME_BYTES = 255


class AmqpTarget(Strict):
    kind: Literal["amqp"]
    exchange: str = Field(max_length=255)
    routing_key: str = Field(default="", max_length=255)
    headers: dict[str, str | int | float | bool] = Field(default_factory=dict)
    body: JsonValue = None
    #: How long to wait for the broker's publisher confirm.
    timeout_s: float = Field(default=10, gt=0, le=300)
    rate_limit: RateLimit | None = None
    #: Default: the exchange (``amqp:<exchange>``).
    rate_key: str | None = None

    @field_validator("rate_key")
    @classmethod
    def _rate_key_is_printable(cls, value: str | None) -> str | None:
        return _check_rate_key(value)

    @field_validator("exchange", "routing_key")
    @classmethod
    def _name_is_printable(cls, value: str) -> str:
        if CONTROL_RE.search(value):
            raise ValueError("must not contain control characters")
        # The broker's limit is in bytes (a short string): 255 characters of "é" are 510, and
        # would be accepted here only to fail at every delivery.
        if len(value.encode("utf-8", "surrogatepass")) > MAX_AMQP_NAME_BYTES:
            raise ValueError(f"must be at most {MAX_AMQP_NAME_BYTES} bytes in UTF-8")
        return value

    @field_validator("headers")
    @classmethod
    def _headers_are_allowed(
        cls, value: dict[str, str | int | float | bool]
    ) -> dict[str, str | int | float | bool]:
        _check_headers({name: str(item) for name, item in value.items()})
        return value


Target = Annotated[WebhookTarget | AmqpTarget, Field(discriminator="kind")]


class Retry(Strict):
    max_attempts: int = Field(default=3, ge=1, le=100)
    initial_backoff_s: float = Field(default=1, gt=0, le=86_400)
    multiplier: float = Field(default=2, ge=1, le=100)
    max_backoff_s: float = Field(default=60, gt=0, le=86_400)
    #: Each wait is drawn uniformly from [0, backoff] so retries of a herd spread out.
    full_jitter: bool = True

    @model_validator(mode="after")
    def _cap_covers_initial(self) -> Retry:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("max_backoff_s must be at least initial_backoff_s")
        return self


class MisfireCommon(Strict):
    #: An occurrence later than this is "missed" and its policy applies; less late, it just fires.
    grace_s: float = Field(default=1, ge=0, le=86_400)


class SkipMisfire(MisfireCommon):
    policy: Literal["skip"]


class FireOnceMisfire(MisfireCommon):
    policy: Literal["fire_once"]


class FireAllMisfire(MisfireCommon):
    policy: Literal["fire_all"]
    #: Only missed times at most this old are replayed.
    window_s: float = Field(default=3600, gt=0, le=30 * 86_400)
    #: At most this many missed times are replayed (the most recent ones).
    limit: int = Field(default=100, ge=1, le=100_000)


DEFAULT_RETRY = Retry()
DEFAULT_MISFIRE = FireOnceMisfire(policy="fire_once")

Misfire = Annotated[SkipMisfire | FireOnceMisfire | FireAllMisfire, Field(discriminator="policy")]

#: Why each field a reply shows, but cronbus assigns, is refused in an upsert (never ignored).
READ_ONLY_REASONS = {
    "version": "is assigned by cronbus; send expected_version for compare-and-set",
    "namespace": "comes from the routing key <namespace>.<verb>",
    "state": "is read-only; use the pause, resume or delete commands",
    "next_fires": "is read-only",
    "last_fire_at": "is read-only",
    "fires": "is read-only",
    "created_at": "is read-only",
    "updated_at": "is read-only",
    "stats": "is read-only",
    "breaker": "is read-only",
    "paused_reason": "is read-only; pause_after_failures sets it, resume clears it",
}
ReadOnly = Annotated[None, Field(exclude=True)]


class ScheduleDefinition(Strict):
    """What a user defines: the fields an upsert carries, which a reply shows back as stored."""

    id: str
    spec: Spec
    target: Target
    # Shared default instances: the models are frozen, and building them per schedule showed up
    # in bulk imports.
    retry: Retry = DEFAULT_RETRY
    misfire: Misfire = DEFAULT_MISFIRE
    #: A deterministic delay in [0, jitter_s) per occurrence, spreading herds.
    jitter_s: float = Field(default=0, ge=0, le=86_400)
    #: Rebuild order after Redis loses data: higher first.
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    #: Create (or keep) the schedule paused.
    paused: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    #: Pause the schedule after this many consecutive occurrences ended dead (none: never).
    pause_after_failures: int | None = Field(default=None, ge=1, le=1000)

    @field_validator("id")
    @classmethod
    def _id_is_safe(cls, value: str) -> str:
        return check_schedule_id(value)

    @field_validator("labels")
    @classmethod
    def _labels_are_bounded(cls, value: dict[str, str]) -> dict[str, str]:
        return check_labels(value)


class Schedule(ScheduleDefinition):
    """A schedule as an upsert carries it: the fields cronbus assigns are refused, by name."""

    # Fields that replies show but cronbus assigns.
    version: ReadOnly = None
    namespace: ReadOnly = None
    state: ReadOnly = None
    next_fires: ReadOnly = None
    last_fire_at: ReadOnly = None
    fires: ReadOnly = None
    created_at: ReadOnly = None
    updated_at: ReadOnly = None
    stats: ReadOnly = None
    paused_reason: ReadOnly = None
    breaker: ReadOnly = None

    @field_validator(
        "version",
        "namespace",
        "state",
        "next_fires",
        "last_fire_at",
        "fires",
        "created_at",
        "updated_at",
        "stats",
        "paused_reason",
        "breaker",
        mode="plain",
    )
    @classmethod
    def _refuse_read_only(cls, value: object, info: ValidationInfo) -> None:
        raise ValueError(READ_ONLY_REASONS[str(info.field_name)])


def check_schedule_id(value: str) -> str:
    if not SCHEDULE_ID_RE.match(value):
        raise ValueError(
            "must be 1-200 characters of letters, digits and . _ : @ -, "
            "starting with a letter or digit"
        )
    return value


def check_namespace(value: str) -> str:
    if not NAMESPACE_RE.match(value):
        raise ValueError(
            "must be 1-63 lowercase letters, digits, _ or -, starting with a letter or digit"
        )
    return value


def check_labels(value: dict[str, str]) -> dict[str, str]:
    if len(value) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels are allowed")
    for key, item in value.items():
        if not LABEL_KEY_RE.match(key):
            raise ValueError(f"label key {key!r} must be 1-63 letters, digits or . _ / -")
        if len(item) > MAX_LABEL_VALUE:
            raise ValueError(f"label {key!r} is longer than {MAX_LABEL_VALUE} characters")
        if CONTROL_RE.search(item):
            raise ValueError(f"label {key!r} must not contain control characters")
    return value


# URLs repeat across schedules (a bulk import names one endpoint many times): judged once.
# Bounded: at most 1024 URLs of at most 2048 characters (the field's max_length, checked first).
@functools.lru_cache(maxsize=1024)
def url_refusal(url: str) -> str | None:
    """Why a webhook URL is refused (the field error's reason), or None."""
    if not HTTP_URL_RE.match(url):
        return "must be an absolute http:// or https:// URL"
    if URL_CREDENTIALS_RE.match(url):
        return "must not carry credentials; put them in headers"
    if any(ch.isspace() for ch in url) or CONTROL_RE.search(url):
        return "must not contain whitespace or control characters"
    try:
        check_url_authority(url)
    except ValueError as exc:
        return str(exc)
    return netpolicy.url_problem(url)


def check_url_authority(url: str) -> None:
    """ValueError unless the URL's host and port parse: a closed ``[...]``, a port 1-65535."""
    try:
        port = urlsplit(url).port
    except ValueError as exc:
        raise ValueError(f"has a malformed host or port ({exc})") from None
    if port == 0:
        raise ValueError("port must be between 1 and 65535")


@functools.cache
def _zone_names() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones()) | {"UTC"}


def load_zone(name: str) -> zoneinfo.ZoneInfo:
    """The IANA zone called ``name``; ValueError naming it when there is none.

    Only names tzdata lists are zones: ``America`` is a directory of tzdata, and opening it
    raises an OSError that would pass for an outage.
    """
    if name not in _zone_names():
        raise ValueError(f"unknown time zone {name!r}")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(f"unknown time zone {name!r}") from None
