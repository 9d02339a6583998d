"""``cronbus preview``: the next nominal fire times of a cron expression or an interval."""

from __future__ import annotations

import argparse

import pydantic

from cronbus.cli.common import CliError
from shared.contract import codec, models, timefmt, validation
from shared.rules import schedule
from shared.rules.plan import Plan, plan_of

MAX_COUNT = 10_000
_FLAGS = {"expr": "--cron", "timezone": "--timezone", "every_s": "--every-s"}


def exclusion_of(text: str) -> object:
    """One ``--exclude``: a JSON ``spec.exclude`` entry, ``FROM/TO`` (RFC 3339), or a cron."""
    if text.lstrip().startswith("{"):
        try:
            return codec.loads(text)
        except codec.DecodeError:
            raise CliError(f"--exclude {text!r}: is not valid JSON") from None
    start, slash, end = text.partition("/")
    if slash and "T" in start and "T" in end:
        return {"from": start, "to": end}
    return {"cron": text}


def _spec_of(args: argparse.Namespace) -> dict[str, object]:
    if (args.cron is None) == (args.every_s is None):
        raise CliError("give exactly one of --cron or --every-s")
    spec: dict[str, object]
    if args.cron is not None:
        spec = {"kind": "cron", "expr": args.cron}
        if args.timezone is not None:
            spec["timezone"] = args.timezone
    elif args.timezone is not None:
        raise CliError("--timezone applies to --cron only")
    else:
        spec = {"kind": "interval", "every_s": args.every_s}
    excludes = getattr(args, "exclude", None) or []
    if excludes:
        spec["exclude"] = [exclusion_of(text) for text in excludes]
    return spec


def _plan_of(spec: dict[str, object]) -> Plan:
    try:
        item = models.Schedule.model_validate(
            {"id": "preview", "spec": spec, "target": {"kind": "webhook", "url": "http://x"}}
        )
    except pydantic.ValidationError as exc:
        problem = validation.field_errors(exc)[0]
        field = problem["field"]
        flag = (
            "--exclude"
            if field.startswith("spec.exclude")
            else _FLAGS.get(field.rpartition(".")[2], field)
        )
        raise CliError(f"{flag}: {problem['reason']}") from None
    return plan_of(item, version=1)


def fire_times(plan: Plan, after_ms: int, count: int) -> list[int]:
    times: list[int] = []
    current = after_ms
    while len(times) < count:
        found = schedule.next_nominal(plan, current)
        if found is None:
            break
        times.append(found)
        current = found
    return times


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.count <= MAX_COUNT:
        raise CliError(f"--count: must be between 1 and {MAX_COUNT}")
    try:
        after_ms = timefmt.parse_rfc3339_ms(args.after)
    except ValueError as exc:
        raise CliError(f"--after: {exc}") from None
    plan = _plan_of(_spec_of(args))
    times = fire_times(plan, after_ms, args.count)
    if not times:
        if plan.exclude:
            raise CliError("--exclude: excludes every fire time within 10 years")
        raise CliError("--cron: never fires: no matching time within 10 years")
    for ms in times:
        print(timefmt.format_ms(ms))
    return 0
