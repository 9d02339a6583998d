"""``cronbus doctor``: stored schedules that today's settings would refuse.

Settings narrow over time (an upgrade's new default, an operator's change), and PostgreSQL
keeps what was accepted before. Such a schedule is never dropped: it fails at every delivery
with the reason until it is changed, and this command lists them all, so none waits to be
found by its failures. It checks AMQP targets against CRONBUS_AMQP_ALLOWED_EXCHANGES, and the
deployment's RabbitMQ (``doctor_rabbitmq``): each finding with the setting or command that
fixes it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any

from cronbus.cli import doctor_rabbitmq, output
from cronbus.cli.common import CliError, database_error, settings
from shared.policy import exchanges
from shared.policy.rabbit_cluster import Finding
from shared.runtime import transient

#: Schedules read per page.
PAGE = 5000
#: Exit status when some stored schedule is refused (2 stays "could not be asked").
FOUND = 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="list stored schedules the current settings refuse (AMQP targets whose exchange "
        "CRONBUS_AMQP_ALLOWED_EXCHANGES does not allow) and check RabbitMQ's nodes and quorum "
        "queues; exit 1 when a schedule is refused or a check fails",
    )
    output.add_option(p, rows="an object with the list, for scripts")
    p.set_defaults(handler=run)


async def find_refused(database_url: str, policy: exchanges.ExchangePolicy) -> list[Any]:
    from shared.postgres.store import Store  # noqa: PLC0415 - only this command needs PostgreSQL

    try:
        store = await Store.open(database_url, min_size=1, max_size=1)
    except transient.ERRORS as exc:
        raise CliError(database_error(exc)) from None
    try:
        found: list[exchanges.RefusedTarget] = []
        async for page in store.amqp_targets(PAGE):
            found.extend(exchanges.refused_targets(page, policy))
        return found
    except transient.ERRORS as exc:
        raise CliError(database_error(exc)) from None
    finally:
        await store.close()


def run(args: argparse.Namespace) -> int:
    config = settings()
    policy = config.exchange_policy()
    refused = asyncio.run(find_refused(config.database_url, policy))
    findings = asyncio.run(doctor_rabbitmq.checks(config))
    rows = [dataclasses.asdict(item) for item in refused]
    if args.output in ("json", "yaml"):
        shown = {
            "setting": exchanges.SETTING,
            "globs": list(policy.globs),
            "refused": rows,
            "findings": [dataclasses.asdict(f) for f in findings],
        }
        (output.print_json if args.output == "json" else output.print_yaml)(shown)
    else:
        if rows:
            output.print_table(_table(rows, wide=args.output == "wide"))
        _print_findings(findings)
    failed = any(f.severity == "error" for f in findings)
    setting = f"{exchanges.SETTING}={policy.describe()!r}"
    if not rows:
        print(f"cronbus doctor: no stored schedule is refused by {setting}", file=sys.stderr)
        return FOUND if failed else 0
    print(
        f"cronbus doctor: {len(rows)} stored schedule(s) have an AMQP target refused by "
        f"{setting}: each occurrence fails (dead, not retried, counted in "
        "cronbus_amqp_target_refused_total) until the target is changed or the operator "
        f"allows its exchange in {exchanges.SETTING}",
        file=sys.stderr,
    )
    return FOUND


def _print_findings(findings: list[Finding]) -> None:
    for finding in findings:
        fix = f"; fix: {finding.fix}" if finding.fix else ""
        print(f"cronbus doctor: {finding.severity}: {finding.message}{fix}", file=sys.stderr)


def _table(rows: list[dict[str, str]], *, wide: bool) -> Any:
    columns = ("namespace", "id", "state", "exchange", "reason")
    table = output.new_table(*(c.upper() for c in columns))
    for row in rows:
        reason = row["reason"] if wide else _short(row["reason"])
        exchange = row["exchange"] or '""'  # the default exchange, visibly
        output.add_row(table, [row["namespace"], row["id"], row["state"], exchange, reason])
    return table


def _short(reason: str) -> str:
    """The reason without the part every row repeats (the setting's value)."""
    return reason.partition(f": {exchanges.SETTING} is ")[0]
