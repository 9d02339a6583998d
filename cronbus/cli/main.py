"""cronbus: publish schedule commands, preview fire times, inspect executions, run the services.

Connection settings come from the same CRONBUS_* environment variables the services read
(CRONBUS_AMQP_URL, CRONBUS_DATABASE_URL, ...). The namespace comes from -n/--namespace or
CRONBUS_NAMESPACE; without either, "default" (and the command says so on stderr).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import TypeAlias

from cronbus.bench import command as bench_command
from cronbus.cli import commands, completion, dev, doctor, importer, output, procs, top
from cronbus.cli import preview as preview_cmd
from cronbus.cli.common import (
    DEFAULT_NAMESPACE,
    CliError,
    interval_s,
    namespace_arg,
    positive_int,
    quiet_drivers,
    unreachable,
)
from shared.rules import compact
from shared.runtime.config import DispatcherSettings, ExecutorSettings, SweeperSettings

Handler = Callable[[argparse.Namespace], int]
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
SERVICES = ("dispatcher", "executor", "sweeper")


def _with_namespace(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-n",
        "--namespace",
        type=namespace_arg,
        # A set CRONBUS_NAMESPACE goes through namespace_arg too (argparse converts string
        # defaults), so an empty one is refused naming -n; unset, main() says 'default' is used.
        default=os.environ.get("CRONBUS_NAMESPACE"),
        help="namespace of the schedules (default: $CRONBUS_NAMESPACE, else 'default', "
        "which the command then says on stderr)",
    )
    p.add_argument("--timeout", type=float, default=30, help="seconds to wait for the reply")


def _add_commands(sub: Subparsers) -> None:
    p = sub.add_parser("apply", help="create or replace schedules from a YAML or JSON file")
    p.add_argument("-f", "--file", required=True, help="file of one or many schedules ('-': stdin)")
    _with_namespace(p)
    output.add_action_option(p)
    p.set_defaults(handler=commands.run_apply)
    p = sub.add_parser("get", help="show a schedule with its next fire times and stats")
    p.add_argument("id", help="schedule id")
    _with_namespace(p)
    output.add_option(p)
    p.set_defaults(handler=commands.run_by_id)
    for verb, text in (
        ("pause", "stop a schedule firing (it keeps its place)"),
        ("resume", "let a paused schedule fire again (misfire policy applies)"),
        ("delete", "delete a schedule"),
        ("trigger", "fire a schedule once now, outside its rotation"),
    ):
        p = sub.add_parser(verb, help=text)
        p.add_argument("id", help="schedule id")
        _with_namespace(p)
        output.add_action_option(p)
        p.set_defaults(handler=commands.run_by_id)
    p = sub.add_parser(
        "backfill",
        help="deliver again each past occurrence of a schedule in [--from, --to), oldest "
        "first, one at a time (header X-Cronbus-Backfill: true)",
    )
    p.add_argument("id", help="schedule id")
    p.add_argument("--from", dest="from_", required=True, help="RFC 3339 instant (inclusive)")
    p.add_argument("--to", required=True, help="RFC 3339 instant (exclusive), not in the future")
    p.add_argument(
        "--limit", type=int, help="most occurrences to deliver (default 1000, at most 100000)"
    )
    _with_namespace(p)
    output.add_action_option(p)
    p.set_defaults(handler=commands.run_backfill)
    p = sub.add_parser("list", help="list schedules (paged)")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--cursor", help="next_cursor of the previous page")
    p.add_argument("-l", "--label", action="append", help="key=value (repeatable)")
    p.add_argument("--state", choices=("active", "paused", "completed"))
    _with_namespace(p)
    output.add_option(p)
    p.set_defaults(handler=commands.run_list)
    p = sub.add_parser("import", help="bulk-load schedules from a JSON-lines file")
    p.add_argument("file", help="one schedule per line, as in upsert ('-': stdin)")
    p.add_argument("--batch", type=int, default=5000, help="schedules per transaction")
    _with_namespace(p)
    p.set_defaults(handler=importer.run)
    p = sub.add_parser("executions", help="recent executions of a schedule (from PostgreSQL)")
    p.add_argument("id", help="schedule id")
    p.add_argument("--limit", type=positive_int, default=20, help="most rows to show (20)")
    p.add_argument("--json", action="store_true", help="the same as -o json")
    p.add_argument(
        "-w", "--watch", action="store_true", help="then print executions as they come or change"
    )
    p.add_argument(
        "--interval",
        type=interval_s,
        default=2.0,
        help="seconds between looks with --watch (2; at least 0.1)",
    )
    _with_namespace(p)
    output.add_option(p, rows="one JSON object per line")
    p.set_defaults(handler=commands.run_executions)


def _add_preview(sub: Subparsers) -> None:
    p = sub.add_parser("preview", help="print the next fire times of a cron expression or interval")
    p.add_argument("--cron", help="cron expression: 5 fields, or 6 with seconds first")
    p.add_argument("--timezone", help="IANA time zone of the cron expression (default UTC)")
    p.add_argument("--every-s", type=float, dest="every_s", help="interval in seconds")
    p.add_argument("--after", required=True, help="RFC 3339 instant; times strictly after it")
    p.add_argument("--count", type=int, default=10, help="how many times to print (default 10)")
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        help="skip these times (repeatable): a cron expression matched in the zone, "
        "FROM/TO (two RFC 3339 instants), or a spec.exclude entry as JSON",
    )
    p.set_defaults(handler=preview_cmd.run)


def _add_operations(sub: Subparsers) -> None:
    p = sub.add_parser("migrate", help="create the database if missing and apply migrations")
    p.add_argument(
        "--compact-form",
        choices=["binary", "json"],
        help="then store every schedule's compact value in this form (json: before going "
        "back to a version from before 2026-11-26; see docs/upgrading.md)",
    )
    p.set_defaults(handler=_migrate)
    doctor.add_parser(sub)
    p = sub.add_parser("run", help="run one service (same as python -m services.NAME)")
    p.add_argument("service", choices=SERVICES)
    p.add_argument(
        "--processes",
        default="1",
        help="how many processes of it to run: a number, or 'auto' for one per "
        "core (metrics ports count up from CRONBUS_METRICS_PORT)",
    )
    p.set_defaults(handler=_run_service)
    p = sub.add_parser(
        "console",
        help="serve the web console (same as python -m services.console; "
        "port CRONBUS_CONSOLE_PORT, actions with CRONBUS_CONSOLE_ACTIONS=1)",
    )
    p.set_defaults(handler=_run_console)
    p = sub.add_parser(
        "dev",
        help="run migrations, the three services and the console locally",
        epilog="Redis, RabbitMQ and PostgreSQL come from the CRONBUS_* settings. A service "
        "that does not start is named with the last error lines of its log; "
        + dev.OWN_REDIS_HINT
        + ".",
    )
    p.add_argument(
        "--demo", action="store_true", help="also start a printing sink and register demo schedules"
    )
    p.add_argument(
        "--port-base",
        type=int,
        default=9101,
        help="metrics ports: dispatcher, executor, sweeper, console from here (default 9101)",
    )
    p.add_argument("--sink-port", type=int, default=8099, help="demo sink port (default 8099)")
    p.add_argument("--console-port", type=int, default=8080, help="web console port (default 8080)")
    p.add_argument("--status-every", type=float, default=1.0, help="seconds between status lines")
    p.set_defaults(handler=dev.run)
    bench_command.add_parser(sub)
    top.add_parser(sub)
    p = sub.add_parser("completion", help="print a shell completion script: bash or zsh")
    p.add_argument("shell", choices=completion.SHELLS)
    p.set_defaults(handler=_completion)
    p = sub.add_parser("sink", help="an HTTP sink that prints every delivery it receives")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8099)
    p.set_defaults(handler=dev.run_sink)


def _migrate(args: argparse.Namespace) -> int:
    import asyncio  # noqa: PLC0415

    from shared.postgres import db  # noqa: PLC0415
    from shared.runtime import transient  # noqa: PLC0415

    settings = SweeperSettings()
    try:
        applied = asyncio.run(
            db.migrate(settings.database_url, partitions_ahead_days=settings.partitions_ahead_days)
        )
        print("applied: " + ", ".join(applied) if applied else "up to date")
        if args.compact_form:
            rewritten = asyncio.run(_rewrite_compact_form(settings.database_url, args.compact_form))
            print(f"schedules rewritten in the {args.compact_form} form: {rewritten}")
    except transient.ERRORS as exc:
        raise CliError(
            unreachable("PostgreSQL", "CRONBUS_DATABASE_URL", settings.database_url, exc)
        ) from None
    return 0


async def _rewrite_compact_form(database_url: str, form: compact.Form) -> int:
    from shared.postgres.store import Store  # noqa: PLC0415

    store = await Store.open(database_url, min_size=1, max_size=1)
    try:
        return await store.rewrite_compact_form(form)
    finally:
        await store.close()


def _run_service(args: argparse.Namespace) -> int:
    if args.processes == "auto":
        count = os.cpu_count() or 1
    elif args.processes.isdigit() and int(args.processes) >= 1:
        count = int(args.processes)
    else:
        raise CliError(f"--processes: {args.processes!r} is not a number >= 1 or 'auto'")
    if count > 1:
        settings = {
            "dispatcher": DispatcherSettings,
            "executor": ExecutorSettings,
            "sweeper": SweeperSettings,
        }[args.service]()
        return procs.supervise(args.service, count, settings.metrics_port)
    sys.argv = [f"services.{args.service}"]
    runpy.run_module(f"services.{args.service}", run_name="__main__", alter_sys=True)
    return 0


def _run_console(args: argparse.Namespace) -> int:
    sys.argv = ["services.console"]
    runpy.run_module("services.console", run_name="__main__", alter_sys=True)
    return 0


def _completion(args: argparse.Namespace) -> int:
    print(completion.script(build_parser(), args.shell))
    return 0


EXIT_CODES = """exit status:
  0    done (every command answered ok)
  1    cronbus refused a command (the reason on stderr; with several, at least one);
       doctor: some stored schedule is refused by the current settings
  2    a usage error, or cronbus could not be asked: RabbitMQ or PostgreSQL unreachable,
       access refused by the broker, no reply within --timeout
  130  interrupted (Ctrl-C)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cronbus",
        description=__doc__,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_commands(sub)
    _add_preview(sub)
    _add_operations(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    if "namespace" in args and args.namespace is None:
        args.namespace = DEFAULT_NAMESPACE
        print(
            f"cronbus {args.command}: no -n given and CRONBUS_NAMESPACE unset: "
            f"using namespace '{DEFAULT_NAMESPACE}'",
            file=sys.stderr,
        )
    quiet_drivers()
    try:
        return handler(args)
    except CliError as exc:
        print(f"cronbus {args.command}: {exc}", file=sys.stderr)
        return 2
    except procs.Interrupted as exc:
        figures = "; no figures" if args.command == "bench" else ""
        print(
            f"cronbus {args.command}: {exc}; what it started is stopped{figures}", file=sys.stderr
        )
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to print, and nothing to say about it.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        # Whatever path got here (an error, a crash of this code), no service outlives it.
        procs.stop_started()


if __name__ == "__main__":
    sys.exit(main())
