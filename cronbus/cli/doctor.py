"""``cronbus doctor``: stored schedules that today's settings would refuse.

Settings narrow over time (an upgrade's new default, an operator's change), and PostgreSQL
keeps what was accepted before. Such a schedule is never dropped: it fails at every delivery
with the reason until it is changed, and this command lists them all, so none waits to be
found by its failures. Today it checks AMQP targets against CRONBUS_AMQP_ALLOWED_EXCHANGES.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any

from cronbus.cli import output
from cronbus.cli.common import CliError, database_error, settings
from shared.policy import exchanges
from shared.runtime import transient

#: Schedules read per page.
PAGE = 5000
#: Exit status when some stored schedule is refused (2 stays "could not be asked").
FOUND = 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="list stored schedules the current settings refuse (AMQP targets whose exchange "
        "CRONBUS_AMQP_ALLOWED_EXCHANGES does not allow); exit 1 when there are some",
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
    rows = [dataclasses.asdict(item) for item in refused]
    if args.output in ("json", "yaml"):
        shown = {"setting": exchanges.SETTING, "globs": list(policy.globs), "refused": rows}
        (output.print_json if args.output == "json" else output.print_yaml)(shown)
    elif rows:
        output.print_table(_table(rows, wide=args.output == "wide"))
    setting = f"{exchanges.SETTING}={policy.describe()!r}"
    if not rows:
        print(f"cronbus doctor: no stored schedule is refused by {setting}", file=sys.stderr)
        return 0
    print(
        f"cronbus doctor: {len(rows)} stored schedule(s) have an AMQP target refused by "
        f"{setting}: each occurrence fails (dead, not retried, counted in "
        "cronbus_amqp_target_refused_total) until the target is changed or the operator "
        f"allows its exchange in {exchanges.SETTING}",
        file=sys.stderr,
    )
    return FOUND


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
