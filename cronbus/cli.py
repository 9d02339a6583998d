"""The ``cronbus`` command: the user's front door."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence

from cronbus import preview as preview_cmd
from cronbus.common import CliError

Handler = Callable[[argparse.Namespace], int]


def _add_preview(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("preview", help="print the next fire times of a cron expression or interval")
    p.add_argument("--cron", help="cron expression: 5 fields, or 6 with seconds first")
    p.add_argument("--timezone", help="IANA time zone of the cron expression (default UTC)")
    p.add_argument("--every-s", type=float, dest="every_s", help="interval in seconds")
    p.add_argument("--after", required=True, help="RFC 3339 instant; times strictly after it")
    p.add_argument("--count", type=int, default=10, help="how many times to print (default 10)")
    p.set_defaults(handler=preview_cmd.run)


def _add_migrate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("migrate", help="create the database if missing and apply migrations")
    p.set_defaults(handler=_migrate)


def _migrate(args: argparse.Namespace) -> int:
    from shared import db  # noqa: PLC0415 - keep `cronbus preview` free of driver imports
    from shared.config import SweeperSettings  # noqa: PLC0415

    settings = SweeperSettings()
    applied = asyncio.run(
        db.migrate(settings.database_url, partitions_ahead_days=settings.partitions_ahead_days)
    )
    print("applied: " + ", ".join(applied) if applied else "up to date")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cronbus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_preview(sub)
    _add_migrate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except CliError as exc:
        print(f"cronbus {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
