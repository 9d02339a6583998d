"""The compact encoding of a schedule stored in the Redis ``sched`` hash (pure).

Redis holds one entry per schedule, so every byte counts: keys are one or two letters and
defaults are left out. The value starts with ``{"v":<version>`` so that Lua scripts can read
the version with a pattern match instead of decoding JSON.
"""

from __future__ import annotations

import re
from typing import Any

from shared.contract import codec
from shared.rules.exclusion import CronExclusion, Exclusion, RangeExclusion
from shared.rules.plan import (
    AfterCompletionRule,
    AmqpPlan,
    CronRule,
    IntervalRule,
    MisfirePolicy,
    MisfireRule,
    OnceRule,
    Plan,
    RetryRule,
    Rule,
    TargetPlan,
    WebhookPlan,
)

_DEFAULT_RETRY = RetryRule()
_DEFAULT_MISFIRE = MisfireRule()
_DEFAULT_TIMEOUT_MS = 10_000
_POLICY_CODES: dict[MisfirePolicy, str] = {"skip": "s", "fire_once": "o", "fire_all": "a"}
_POLICY_NAMES: dict[str, MisfirePolicy] = {code: name for name, code in _POLICY_CODES.items()}


def _encode_rule(rule: Rule, out: dict[str, Any]) -> None:
    if isinstance(rule, CronRule):
        out["c"] = rule.expr
        if rule.timezone != "UTC":
            out["z"] = rule.timezone
    elif isinstance(rule, IntervalRule):
        out["i"] = rule.every_ms
    elif isinstance(rule, AfterCompletionRule):
        out["d"] = rule.delay_ms
    else:
        out["o"] = rule.at_ms


def _decode_rule(data: dict[str, Any]) -> Rule:
    if "c" in data:
        return CronRule(data["c"], data.get("z", "UTC"))
    if "i" in data:
        return IntervalRule(data["i"])
    if "d" in data:
        return AfterCompletionRule(data["d"])
    return OnceRule(data["o"])


def _encode_target(target: TargetPlan, out: dict[str, Any]) -> None:
    """Target fields sit beside the schedule's, with upper-case keys where they would clash."""
    if isinstance(target, WebhookPlan):
        out["u"] = target.url
        if target.method != "POST":
            out["M"] = target.method
        if target.success_codes is not None:
            out["S"] = sorted(target.success_codes)
        if target.secret_headers:
            out["X"] = dict(target.secret_headers)
    else:
        out["x"] = target.exchange
        if target.routing_key:
            out["k"] = target.routing_key
    if target.headers:
        out["H"] = dict(target.headers)
    if target.body is not None:
        # Stored as a JSON value, not a string of JSON: escaping would cost bytes.
        out["B"] = codec.Fragment(target.body)
    if target.timeout_ms != _DEFAULT_TIMEOUT_MS:
        out["T"] = target.timeout_ms
    if target.rate_key is not None:
        out["K"] = target.rate_key
    if target.rate_per_s is not None:
        out["L"] = [target.rate_per_s, target.rate_burst]


def _decode_target(data: dict[str, Any]) -> TargetPlan:
    encoded = codec.dumps(data["B"]) if "B" in data else None
    timeout_ms = data.get("T", _DEFAULT_TIMEOUT_MS)
    headers = tuple(data["H"].items()) if "H" in data else ()
    per_s, burst = data.get("L", (None, 1))
    if "u" in data:
        codes = data.get("S")
        return WebhookPlan(
            url=data["u"],
            method=data.get("M", "POST"),
            headers=headers,
            body=encoded,
            timeout_ms=timeout_ms,
            success_codes=frozenset(codes) if codes is not None else None,
            rate_key=data.get("K"),
            rate_per_s=per_s,
            rate_burst=burst,
            secret_headers=tuple(data["X"].items()) if "X" in data else (),
        )
    return AmqpPlan(
        exchange=data["x"],
        routing_key=data.get("k", ""),
        headers=headers,
        body=encoded,
        timeout_ms=timeout_ms,
        rate_key=data.get("K"),
        rate_per_s=per_s,
        rate_burst=burst,
    )


def encode(plan: Plan) -> bytes:
    out: dict[str, Any] = {"v": plan.version}
    _encode_rule(plan.rule, out)
    if plan.start_ms is not None:
        out["a"] = plan.start_ms
    if plan.end_ms is not None:
        out["e"] = plan.end_ms
    if plan.max_fires is not None:
        out["n"] = plan.max_fires
    if plan.jitter_ms:
        out["j"] = plan.jitter_ms
    if plan.retry != _DEFAULT_RETRY:
        retry = plan.retry
        out["r"] = [
            retry.max_attempts,
            retry.initial_ms,
            retry.multiplier,
            retry.max_ms,
            int(retry.full_jitter),
        ]
    if plan.misfire != _DEFAULT_MISFIRE:
        misfire = plan.misfire
        out["f"] = [
            _POLICY_CODES[misfire.policy],
            misfire.grace_ms,
            misfire.window_ms,
            misfire.limit,
        ]
    if plan.exclude:
        out["E"] = [
            item.expr if isinstance(item, CronExclusion) else [item.from_ms, item.to_ms]
            for item in plan.exclude
        ]
    if plan.pause_after_failures is not None:
        out["P"] = plan.pause_after_failures
    _encode_target(plan.target, out)
    return codec.dumps(out)


def _decode_exclusions(data: dict[str, Any]) -> tuple[Exclusion, ...]:
    items = data.get("E")
    if not items:
        # Most schedules have none: no generator to build and exhaust for them.
        return ()
    return tuple(
        CronExclusion(item) if isinstance(item, str) else RangeExclusion(item[0], item[1])
        for item in items
    )


_VERSION_PREFIX = b'{"v":'


_VERSION = re.compile(rb'\{"v":(\d+)')


def version_of(raw: bytes) -> int:
    """The version of a stored value without decoding it (it always comes first)."""
    found = _VERSION.match(raw)
    if found is None:
        raise ValueError("not a compact schedule")
    return int(found.group(1))


def with_version(raw: bytes, version: int) -> bytes:
    """The same encoding at another version (cheaper than re-encoding the plan)."""
    old = version_of(raw)
    return b'{"v":%d' % version + raw[len(_VERSION_PREFIX) + len(str(old)) :]


def decode(raw: bytes | str) -> Plan:
    data = codec.loads(raw)
    return decode_object(data)


def decode_object(data: dict[str, Any]) -> Plan:
    """Decode an already parsed compact value (the deliveries carry it inline)."""
    retry = data.get("r")
    misfire = data.get("f")
    return Plan(
        version=data["v"],
        rule=_decode_rule(data),
        target=_decode_target(data),
        start_ms=data.get("a"),
        end_ms=data.get("e"),
        max_fires=data.get("n"),
        jitter_ms=data.get("j", 0),
        retry=RetryRule(retry[0], retry[1], retry[2], retry[3], bool(retry[4]))
        if retry
        else _DEFAULT_RETRY,
        misfire=MisfireRule(_POLICY_NAMES[misfire[0]], misfire[1], misfire[2], misfire[3])
        if misfire
        else _DEFAULT_MISFIRE,
        exclude=_decode_exclusions(data),
        pause_after_failures=data.get("P"),
    )
