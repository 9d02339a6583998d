"""Turning what a user sent into a command, or into errors naming each field and why (pure).

Structural checks come from the pydantic models; the checks here need the clock or the
operator's policy: a spec that never fires, a body that is too big, a target that is not allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import ipaddress
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pydantic

from shared.contract import codec, commands, models, timefmt
from shared.contract.errors import ValidationFailed
from shared.policy import exchanges, netpolicy
from shared.rules import cron, schedule
from shared.rules.plan import AfterCompletionRule, CronRule, OnceRule, Plan, plan_of

FieldError = dict[str, str]

_UNION_TAGS = {
    "spec": {"cron", "interval", "after_completion", "once"},
    "target": {"webhook", "amqp"},
    "misfire": {"skip", "fire_once", "fire_all"},
}
_DISCRIMINATORS = {"spec": "kind", "target": "kind", "misfire": "policy"}


@dataclass(frozen=True)
class TargetPolicy:
    """What an operator allows schedules to call (``CRONBUS_WEBHOOK_*``, ``CRONBUS_AMQP_*``)."""

    #: Host globs a webhook may call ("*" allows any).
    allowed_hosts: tuple[str, ...] = ("*",)
    #: Networks denied even when ``allowed_networks`` lists them.
    denied_networks: tuple[str, ...] = ()
    #: Restricted networks (loopback, private, ...) webhooks may reach nevertheless.
    allowed_networks: tuple[str, ...] = ()
    #: Exchange globs an AMQP target may publish to (``{namespace}``: the schedule's).
    allowed_exchanges: tuple[str, ...] = exchanges.parse_globs(exchanges.DEFAULT)
    #: Largest JSON body stored with a schedule.
    max_body_bytes: int = 65_536
    addresses: netpolicy.AddressPolicy = field(init=False, repr=False, compare=False)
    exchange_policy: exchanges.ExchangePolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        addresses = netpolicy.AddressPolicy.from_text(self.allowed_networks, self.denied_networks)
        object.__setattr__(self, "addresses", addresses)
        policy = exchanges.ExchangePolicy(self.allowed_exchanges)
        object.__setattr__(self, "exchange_policy", policy)

    def host_denied(self, host: str) -> bool:
        """True for a literal address the policy denies (names are checked at delivery, once
        resolved: resolving here would tell tenants about the operator's network)."""
        return _host_denied(self, host)

    def host_allowed(self, host: str) -> bool:
        return _host_allowed(self, host)

    def exchange_refusal(self, namespace: str, exchange: str) -> str | None:
        """Why ``namespace`` may not publish to ``exchange`` (None: it may)."""
        return self.exchange_policy.refusal(namespace, exchange)


# Hosts repeat across schedules (a bulk import has millions of one host): answer once.
@functools.lru_cache(maxsize=4096)
def _host_denied(policy: TargetPolicy, host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return not policy.addresses.allows(address)


@functools.lru_cache(maxsize=4096)
def _host_allowed(policy: TargetPolicy, host: str) -> bool:
    return any(fnmatch.fnmatchcase(host, glob) for glob in policy.allowed_hosts)


def _path_of(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for index, item in enumerate(loc):
        previous = loc[index - 1] if index else None
        if isinstance(previous, str) and item in _UNION_TAGS.get(previous, ()):
            continue  # the discriminated union's tag is not a field the user wrote
        parts.append(f"[{item}]" if isinstance(item, int) else str(item))
    return ".".join(parts).replace(".[", "[")


_REASONS = {
    "extra_forbidden": "unknown field",
    "missing": "is required",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "list_type": "must be a list",
}


def _known_fields() -> tuple[str, ...]:
    """Every field name the contract's models accept (what a misspelt name was meant to be)."""
    names: set[str] = set()
    for value in vars(models).values():
        if isinstance(value, type) and issubclass(value, pydantic.BaseModel):
            for name, info in value.model_fields.items():
                names.add(info.alias or name)
    return tuple(sorted(names))


_KNOWN_FIELDS = _known_fields()


#: Unknown fields of one command that get a "did you mean": a suggestion costs a fuzzy match
#: against every known name, and a hostile command may hold thousands of unknown keys.
MAX_SUGGESTIONS = 10
#: Longer names get no suggestion (no known field is near them, and matching costs their length).
MAX_SUGGESTED_NAME = 64


def _unknown_field(loc: tuple[int | str, ...], suggest: bool) -> str:
    name = str(loc[-1]) if loc else ""
    if not suggest or len(name) > MAX_SUGGESTED_NAME:
        return "unknown field"
    close = difflib.get_close_matches(name, _KNOWN_FIELDS, n=1, cutoff=0.75)
    return f"unknown field; did you mean {close[0]!r}?" if close else "unknown field"


def _reason_of(error: Any, suggest: bool = True) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return _unknown_field(tuple(error["loc"]), suggest)
    if kind in _REASONS:
        return _REASONS[kind]
    if kind == "union_tag_invalid":
        ctx = error.get("ctx", {})
        return f"must be one of {ctx.get('expected_tags')}, not {ctx.get('tag')!r}"
    message = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    return message[:1].lower() + message[1:]


def field_errors(exc: pydantic.ValidationError, strip: str = "") -> list[FieldError]:
    """One ``{"field", "reason"}`` per problem; ``strip`` drops a leading path segment."""
    details: list[FieldError] = []
    unknown = 0
    for error in exc.errors():
        loc = tuple(error["loc"])
        if strip and loc[:1] == (strip,):
            loc = loc[1:]
        path = _path_of(loc)
        if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
            path = f"{path}.{_DISCRIMINATORS.get(str(loc[-1]) if loc else '', 'kind')}"
            if error["type"] == "union_tag_not_found":
                details.append({"field": path.lstrip("."), "reason": "is required"})
                continue
        unknown += error["type"] == "extra_forbidden"
        details.append(
            {"field": path or "(body)", "reason": _reason_of(error, unknown <= MAX_SUGGESTIONS)}
        )
    return details


def parse_body(raw: bytes) -> Any:
    """JSON bytes -> object; ValidationFailed(invalid_command) when it is not JSON."""
    try:
        return codec.loads(raw) if raw.strip() else {}
    except codec.DecodeError as exc:
        raise ValidationFailed(
            "invalid_command",
            f"the body is not valid JSON: {exc}",
            [{"field": "(body)", "reason": "is not valid JSON"}],
        ) from None


def parse_command(verb: str, body: Any, raw: bytes | None = None) -> models.Strict:
    """A command body -> its model, or ValidationFailed naming every offending field.
    ``raw``: the JSON text ``body`` was parsed from (it may spare the structural walk)."""
    model = commands.COMMAND_MODELS.get(verb)
    if model is None:
        raise ValidationFailed(
            "unknown_verb",
            f"unknown verb {verb!r}; expected one of {', '.join(models.VERBS)}",
            [{"field": "routing_key", "reason": f"verb {verb!r} is not one of {models.VERBS}"}],
        )
    if not isinstance(body, dict):
        raise ValidationFailed(
            "invalid_command",
            "the body must be a JSON object",
            [{"field": "(body)", "reason": "must be a JSON object"}],
        )
    checked = body
    if verb == "upsert_many" and isinstance(body.get("schedules"), list):
        # Each schedule is checked (and refused) on its own, by parse_schedule.
        checked = {key: value for key, value in body.items() if key != "schedules"}
    problems = [] if raw is not None and plainly_structured(raw) else structural_problems(checked)
    if problems:
        raise _named_failure(verb, problems)
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise _command_failure(verb, exc) from None


#: PostgreSQL cannot store a NUL in text or JSON, and no field has a use for one.
NUL_REASON = "must not contain a NUL character"
#: Fields with a NUL named in one refusal.
MAX_NUL_FIELDS = 50


#: How deep a command may nest (a schedule needs 4 levels; a target body gets the rest). The
#: JSON parser takes 1024, but the encoder stops at 255, and every command is encoded again.
MAX_DEPTH = 64


def _printable(key: str) -> str:
    return key if key.isprintable() and len(key) <= 64 else repr(key[:64])


def plainly_structured(raw: bytes) -> bool:
    """Whether the value of a JSON text is sure to have no ``structural_problems``, seen from
    its bytes (the walk costs more): a NUL in a JSON string is always the escape ``\\u0000``
    (a raw control character is not JSON), and nesting deeper than MAX_DEPTH takes more
    brackets than that."""
    return b"\\u0000" not in raw and raw.count(b"{") + raw.count(b"[") < MAX_DEPTH


def structural_problems(body: Any) -> list[FieldError]:
    """What no field may hold: nesting deeper than MAX_DEPTH, a NUL anywhere (one pass)."""
    nul: list[str] = []
    stack: list[tuple[str, Any, int]] = [("", body, 0)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, str):
            if "\x00" in value and len(nul) < MAX_NUL_FIELDS:
                nul.append(path or "(body)")
        elif depth >= MAX_DEPTH and isinstance(value, dict | list) and value:
            # Name where the nesting starts (say schedule.target.body), not 65 levels of it.
            head = ".".join(path.split("[", 1)[0].split(".")[:3])
            return [{"field": head or "(body)", "reason": f"nests deeper than {MAX_DEPTH} levels"}]
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{_printable(key)}" if path else _printable(key)
                if "\x00" in key and len(nul) < MAX_NUL_FIELDS:
                    nul.append(child)
                stack.append((child, item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))
    return [{"field": path, "reason": NUL_REASON} for path in sorted(nul)]


def parse_schedule(raw: Any) -> models.Schedule:
    """One schedule of an upsert_many, or ValidationFailed(invalid_schedule) naming its fields."""
    if not isinstance(raw, dict):
        details = [{"field": "(schedule)", "reason": "must be an object"}]
        raise ValidationFailed("invalid_schedule", _summary(details), details)
    problems = structural_problems(raw)
    if problems:
        raise ValidationFailed("invalid_schedule", _summary(problems), problems)
    try:
        return models.Schedule.model_validate(raw)
    except pydantic.ValidationError as exc:
        details = field_errors(exc)
        raise ValidationFailed("invalid_schedule", _summary(details), details) from None


def _command_failure(verb: str, exc: pydantic.ValidationError) -> ValidationFailed:
    return _named_failure(verb, field_errors(exc))


def _named_failure(verb: str, details: list[FieldError]) -> ValidationFailed:
    if verb == "upsert" and all(d["field"].startswith("schedule.") for d in details):
        # Schedule errors are named relative to the schedule, as in the pinned reply example.
        details = [
            {"field": d["field"].removeprefix("schedule."), "reason": d["reason"]} for d in details
        ]
        return ValidationFailed("invalid_schedule", _summary(details), details)
    return ValidationFailed("invalid_command", _summary(details), details)


def _summary(details: list[FieldError]) -> str:
    first = details[0]
    more = f" (and {len(details) - 1} more)" if len(details) > 1 else ""
    return f"{first['field']}: {first['reason']}{more}"


def check_properties(message_id: str | None, correlation_id: str | None) -> None:
    """The AMQP properties a command is audited and replayed by: printable text."""
    details = [
        {"field": name, "reason": "must not contain control characters"}
        for name, value in (("message_id", message_id), ("correlation_id", correlation_id))
        if value is not None and models.CONTROL_RE.search(value)
    ]
    if details:
        raise ValidationFailed("invalid_command", _summary(details), details)


def check_namespace(namespace: str) -> None:
    try:
        models.check_namespace(namespace)
    except ValueError as exc:
        raise ValidationFailed(
            "invalid_command",
            f"namespace {namespace!r} {exc}",
            [{"field": "routing_key", "reason": f"namespace {exc}"}],
        ) from None


def check_schedule(
    item: models.Schedule, version: int, now_ms: int, policy: TargetPolicy, *, namespace: str
) -> Plan:
    """The schedule's plan, or ValidationFailed(invalid_schedule) when it would never fire or
    its target is not allowed (an AMQP target's exchange depends on the ``namespace``)."""
    plan = plan_of(item, version)
    details = _target_problems(item.target, policy, namespace) + _firing_problems(plan, now_ms)
    if details:
        raise ValidationFailed("invalid_schedule", _summary(details), details)
    return plan


def _denied_reason(policy: TargetPolicy, host: str) -> str:
    if policy.addresses.denied_by_operator(ipaddress.ip_address(host)):
        return (
            f"host {host} is not allowed: it is in the networks this cronbus never calls "
            "(the operator's CRONBUS_WEBHOOK_DENIED_NETWORKS)"
        )
    return (
        f"host {host} is not allowed: a private, local or reserved address, which webhooks "
        "may reach only in the networks the operator lists in "
        "CRONBUS_WEBHOOK_ALLOWED_NETWORKS (comma-separated CIDRs)"
    )


def _target_problems(
    target: models.WebhookTarget | models.AmqpTarget, policy: TargetPolicy, namespace: str
) -> list[FieldError]:
    problems: list[FieldError] = []
    if target.body is not None and len(codec.dumps(target.body)) > policy.max_body_bytes:
        problems.append(
            {
                "field": "target.body",
                "reason": f"is larger than the {policy.max_body_bytes} bytes allowed",
            }
        )
    if isinstance(target, models.WebhookTarget):
        host = (urlsplit(target.url).hostname or "").lower()
        if policy.host_denied(host):
            problems.append({"field": "target.url", "reason": _denied_reason(policy, host)})
        elif not policy.host_allowed(host):
            problems.append(
                {
                    "field": "target.url",
                    "reason": f"host {host} is not in the allowed hosts of this cronbus "
                    "(the operator's CRONBUS_WEBHOOK_ALLOWED_HOSTS)",
                }
            )
        return problems
    refusal = policy.exchange_refusal(namespace, target.exchange)
    if refusal is not None:
        problems.append({"field": "target.exchange", "reason": refusal})
    return problems


def _firing_problems(plan: Plan, now_ms: int) -> list[FieldError]:
    rule = plan.rule
    if isinstance(rule, CronRule):
        tz = schedule.zone(rule.timezone)
        if cron.next_fire_ms(cron.parse(rule.expr), tz, now_ms) is None:
            return [
                {
                    "field": "spec.expr",
                    "reason": "never fires: no matching time within "
                    f"{cron.SEARCH_HORIZON_YEARS} years",
                }
            ]
    first = schedule.first_nominal(plan, now_ms)
    if first is None and plan.exclude:
        unexcluded = dataclasses.replace(plan, exclude=())
        if schedule.first_nominal(unexcluded, now_ms) is not None:
            return [
                {
                    "field": "spec.exclude",
                    "reason": "excludes every fire time: the schedule would never fire",
                }
            ]
    if first is None:
        return [_no_fire_problem(plan, now_ms)]
    if schedule.resolve_due(plan, first, now_ms) is None:
        return [
            {
                "field": "spec.at" if isinstance(rule, OnceRule) else "spec.end_at",
                "reason": f"{timefmt.format_ms(first)} is already past and misfire policy "
                f"{plan.misfire.policy} would never fire it",
            }
        ]
    return []


def warnings_of(plan: Plan, now_ms: int) -> list[FieldError]:
    """What an accepted schedule does that its author may not expect (the reply's
    ``warnings``): a ``once`` whose time has passed fires right away, as a catch-up."""
    rule = plan.rule
    if isinstance(rule, OnceRule) and rule.at_ms < now_ms:
        return [
            {
                "field": "spec.at",
                "reason": f"{timefmt.format_ms(rule.at_ms)} is in the past: the schedule fires "
                "once, now (misfire policy "
                f"{plan.misfire.policy}); give a future time to fire it later",
            }
        ]
    return []


def _no_fire_problem(plan: Plan, now_ms: int) -> FieldError:
    if isinstance(plan.rule, OnceRule):
        return {"field": "spec.at", "reason": "is outside start_at..end_at"}
    if plan.end_ms is not None and plan.end_ms < now_ms:
        return {"field": "spec.end_at", "reason": "is in the past: the schedule would never fire"}
    if isinstance(plan.rule, AfterCompletionRule):
        return {"field": "spec.end_at", "reason": "ends before the first fire"}
    return {"field": "spec.end_at", "reason": "ends before the first fire time"}
