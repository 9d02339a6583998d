"""The runtime form of a schedule: small frozen dataclasses in milliseconds (pure).

The pydantic models are the public contract; a ``Plan`` is what the hot path works with. It
is cheap to build from the compact Redis encoding (``shared.rules.compact``) and carries only
what firing needs: the rule, its bounds, jitter, retry and misfire policies, and the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from shared.contract import codec, models, timefmt
from shared.rules.exclusion import CronExclusion, Exclusion, RangeExclusion

RuleKind = Literal["cron", "interval", "after_completion", "once"]
MisfirePolicy = Literal["skip", "fire_once", "fire_all"]


@dataclass(frozen=True, slots=True)
class CronRule:
    expr: str
    timezone: str = "UTC"


@dataclass(frozen=True, slots=True)
class IntervalRule:
    every_ms: int


@dataclass(frozen=True, slots=True)
class AfterCompletionRule:
    delay_ms: int


@dataclass(frozen=True, slots=True)
class OnceRule:
    at_ms: int


Rule = CronRule | IntervalRule | AfterCompletionRule | OnceRule


@dataclass(frozen=True, slots=True)
class RetryRule:
    max_attempts: int = 3
    initial_ms: int = 1000
    multiplier: float = 2.0
    max_ms: int = 60_000
    full_jitter: bool = True


@dataclass(frozen=True, slots=True)
class MisfireRule:
    policy: MisfirePolicy = "fire_once"
    grace_ms: int = 1000
    window_ms: int = 3_600_000
    limit: int = 100


@dataclass(frozen=True, slots=True)
class WebhookPlan:
    url: str
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()
    #: The JSON body, already encoded (None: no body).
    body: bytes | None = None
    timeout_ms: int = 10_000
    #: None: any 2xx.
    success_codes: frozenset[int] | None = None
    #: The user's rate key (None: scheme://host:port of the URL).
    rate_key: str | None = None
    #: Deliveries per second allowed to the rate key (None: no limit).
    rate_per_s: float | None = None
    rate_burst: int = 1
    #: (header, secret name): the value is read at delivery, never carried.
    secret_headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class AmqpPlan:
    exchange: str
    routing_key: str = ""
    headers: tuple[tuple[str, str | int | float | bool], ...] = ()
    body: bytes | None = None
    timeout_ms: int = 10_000
    #: The user's rate key (None: the exchange).
    rate_key: str | None = None
    rate_per_s: float | None = None
    rate_burst: int = 1


TargetPlan = WebhookPlan | AmqpPlan


@dataclass(frozen=True, slots=True)
class Plan:
    version: int
    rule: Rule
    target: TargetPlan
    start_ms: int | None = None
    end_ms: int | None = None
    max_fires: int | None = None
    jitter_ms: int = 0
    retry: RetryRule = RetryRule()
    misfire: MisfireRule = MisfireRule()
    #: Nominal times the rotation skips (``spec.exclude``).
    exclude: tuple[Exclusion, ...] = ()
    #: Pause the schedule after this many consecutive occurrences ended dead (None: never).
    pause_after_failures: int | None = None


def seconds_to_ms(seconds: float) -> int:
    return round(seconds * 1000)


def _rule_of(
    spec: models.CronSpec | models.IntervalSpec | models.AfterCompletionSpec | models.OnceSpec,
) -> Rule:
    if isinstance(spec, models.CronSpec):
        return CronRule(spec.expr, spec.timezone)
    if isinstance(spec, models.IntervalSpec):
        return IntervalRule(seconds_to_ms(spec.every_s))
    if isinstance(spec, models.AfterCompletionSpec):
        return AfterCompletionRule(seconds_to_ms(spec.delay_s))
    return OnceRule(timefmt.datetime_to_ms(spec.at))


def _burst_of(limit: models.RateLimit | None) -> int:
    if limit is None:
        return 1
    return limit.burst if limit.burst is not None else max(1, math.ceil(limit.per_s))


def _target_of(target: models.WebhookTarget | models.AmqpTarget) -> TargetPlan:
    body = None if target.body is None else codec.dumps(target.body)
    per_s = target.rate_limit.per_s if target.rate_limit is not None else None
    burst = _burst_of(target.rate_limit)
    if isinstance(target, models.WebhookTarget):
        return WebhookPlan(
            url=target.url,
            method=target.method,
            headers=tuple(target.headers.items()),
            body=body,
            timeout_ms=seconds_to_ms(target.timeout_s),
            success_codes=frozenset(target.success_codes) if target.success_codes else None,
            rate_key=target.rate_key,
            rate_per_s=per_s,
            rate_burst=burst,
            secret_headers=tuple(target.secret_headers.items()),
        )
    return AmqpPlan(
        exchange=target.exchange,
        routing_key=target.routing_key,
        headers=tuple(target.headers.items()),
        body=body,
        timeout_ms=seconds_to_ms(target.timeout_s),
        rate_key=target.rate_key,
        rate_per_s=per_s,
        rate_burst=burst,
    )


def _misfire_of(
    misfire: models.SkipMisfire | models.FireOnceMisfire | models.FireAllMisfire,
) -> MisfireRule:
    grace_ms = seconds_to_ms(misfire.grace_s)
    if isinstance(misfire, models.FireAllMisfire):
        return MisfireRule("fire_all", grace_ms, seconds_to_ms(misfire.window_s), misfire.limit)
    return MisfireRule(misfire.policy, grace_ms)


def _exclusions_of(entries: list[models.Exclusion]) -> tuple[Exclusion, ...]:
    return tuple(
        CronExclusion(entry.cron)
        if entry.cron is not None
        else RangeExclusion(
            timefmt.datetime_to_ms(entry.from_) if entry.from_ else 0,
            timefmt.datetime_to_ms(entry.to) if entry.to else 0,
        )
        for entry in entries
    )


def plan_of(schedule: models.Schedule, version: int) -> Plan:
    """The runtime form of a validated schedule at ``version``."""
    spec = schedule.spec
    retry = schedule.retry
    return Plan(
        version=version,
        rule=_rule_of(spec),
        target=_target_of(schedule.target),
        start_ms=timefmt.datetime_to_ms(spec.start_at) if spec.start_at else None,
        end_ms=timefmt.datetime_to_ms(spec.end_at) if spec.end_at else None,
        max_fires=spec.max_fires,
        jitter_ms=seconds_to_ms(schedule.jitter_s),
        retry=RetryRule(
            max_attempts=retry.max_attempts,
            initial_ms=seconds_to_ms(retry.initial_backoff_s),
            multiplier=retry.multiplier,
            max_ms=seconds_to_ms(retry.max_backoff_s),
            full_jitter=retry.full_jitter,
        ),
        misfire=_misfire_of(schedule.misfire),
        exclude=_exclusions_of(spec.exclude),
        pause_after_failures=schedule.pause_after_failures,
    )


def same_rotation(a: Plan, b: Plan) -> bool:
    """True when both plans fire at the same nominal times, so a running rotation can be kept."""
    return (a.rule, a.start_ms, a.end_ms, a.max_fires, a.jitter_ms, a.exclude) == (
        b.rule,
        b.start_ms,
        b.end_ms,
        b.max_fires,
        b.jitter_ms,
        b.exclude,
    )
