"""``cronbus apply | get | list | pause | resume | delete | trigger | backfill | executions``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from cronbus.cli import output, said
from cronbus.cli.common import CliError, amqp_url, broker_error, database_error, database_url
from cronbus.client import AccessRefused, Client, NoReply, user_of
from shared.contract import replies, timefmt
from shared.contract.errors import CommandRefused
from shared.runtime import transient

#: Largest input file read by ``apply -f``: far above any real set of schedules, and small
#: enough that parsing it stays quick.
MAX_INPUT_BYTES = 16 * 1024 * 1024
#: Deepest nesting of lists and objects accepted; a schedule needs fewer than ten levels.
MAX_INPUT_DEPTH = 64


def _read_bounded(path: str) -> str:
    """The file's text, refused before it is parsed when it is larger than MAX_INPUT_BYTES."""
    try:
        if path == "-":
            raw = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
        else:
            with Path(path).open("rb") as handle:
                raw = handle.read(MAX_INPUT_BYTES + 1)
    except OSError as exc:
        raise CliError(f"-f {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_INPUT_BYTES:
        raise CliError(
            f"-f {path}: the file is larger than the {MAX_INPUT_BYTES} bytes allowed; "
            "split it into several files"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CliError(f"-f {path}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def check_structure(path: str, text: str) -> None:
    """Refuse aliases and deep nesting from the parser's events, before anything is built.

    A YAML alias repeats a node by reference; nested ones expand exponentially when the
    document is constructed (a "billion laughs" file), so they are refused outright: a
    schedule file never needs them (anchors alone are harmless and allowed).
    """
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            line = event.start_mark.line + 1 if event.start_mark else "?"
            raise CliError(
                f"-f {path}: line {line}: YAML aliases (*{event.anchor}) are not accepted; "
                "write each value out in full"
            )
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_INPUT_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise CliError(
                    f"-f {path}: line {line}: nested deeper than the {MAX_INPUT_DEPTH} levels "
                    "allowed"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def load_schedules(path: str) -> list[dict[str, Any]]:
    """A YAML or JSON file holding one schedule, a list of them, or YAML documents of either."""
    text = _read_bounded(path)
    try:
        check_structure(path, text)
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise CliError(f"-f {path}: not valid YAML or JSON: {exc}".replace("\n", " ")) from None
    schedules: list[dict[str, Any]] = []
    for number, document in enumerate(documents, start=1):
        items = document if isinstance(document, list) else [document]
        for item in items:
            if item is None:
                continue
            if not isinstance(item, dict):
                raise CliError(f"-f {path}: document {number} is not a schedule (an object)")
            schedules.append(_json_safe(item))
    if not schedules:
        raise CliError(f"-f {path}: no schedules in the file")
    return schedules


def _json_safe(value: Any) -> Any:
    """YAML reads timestamps as datetimes; the contract wants RFC 3339 strings."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if hasattr(value, "isoformat") and hasattr(value, "tzinfo"):
        if value.tzinfo is None:
            raise CliError(f"time {value} has no zone: write it as RFC 3339, e.g. ...Z")
        return timefmt.format_ms(timefmt.datetime_to_ms(value))
    return value


def _notes(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """What a person should notice in an accepted upsert: nothing changed, or a warning."""
    schedule = result.get("schedule") or {}
    name = result.get("id") or schedule.get("id") or ""
    version = result.get("version", schedule.get("version"))
    # In text the line on stdout says it already; scripts reading json or yaml get it here.
    if result.get("unchanged") and getattr(args, "output", "json") != "text":
        print(
            f"cronbus {args.command}: {name}: unchanged (still version {version})", file=sys.stderr
        )
    for warning in result.get("warnings") or []:
        print(
            f"cronbus {args.command}: {name}: warning: {warning.get('field')}: "
            f"{warning.get('reason')}",
            file=sys.stderr,
        )


def _error_line(reply: dict[str, Any]) -> str:
    error = reply.get("error") or {}
    details = error.get("details") or []
    where = "; ".join(_detail_text(d) for d in details)
    return f"{error.get('code')}: {where or error.get('message')}"


def _detail_text(detail: dict[str, Any]) -> str:
    # "(body)" is the contract's name for the whole command; printed as a field it read like
    # target.body ("too_large: (body): is too large").
    if detail.get("field") == "(body)":
        return f"the command's body {detail.get('reason')}"
    return f"{detail.get('field')}: {detail.get('reason')}"


@contextlib.asynccontextmanager
async def _connected(args: argparse.Namespace, verb: str) -> AsyncIterator[Client]:
    """The public client, with what can go wrong on the way told in one line (exit status 2)."""
    try:
        async with Client(amqp_url(), timeout_s=args.timeout, app_id="cronbus-cli") as client:
            yield client
    except NoReply:
        raise CliError(
            f"no reply within {args.timeout:g}s: is a dispatcher running against this RabbitMQ?"
        ) from None
    except AccessRefused as exc:
        user = user_of(amqp_url()) or "this user"
        raise CliError(
            f"RabbitMQ refused access (ACCESS_REFUSED): {user} may not send {verb} commands "
            f"to namespace {args.namespace!r} ({exc})"
        ) from None
    except BrokenPipeError:
        raise  # stdout's reader went away (`| head`), not the broker: main ends quietly
    except transient.ERRORS as exc:
        raise CliError(broker_error(exc)) from None


def _show(args: argparse.Namespace, reply: dict[str, Any], body: dict[str, Any]) -> None:
    """A reply as ``-o`` asks: get and list as tables, the other verbs as a line for people
    (``said``), or the reply itself (json, yaml)."""
    fmt = getattr(args, "output", "json")
    if fmt == "json":
        output.print_json(reply)
    elif fmt == "yaml":
        output.print_yaml(reply)
    elif fmt == "text":
        verb = "upsert" if args.command == "apply" else args.command
        text = said.line(verb, args.namespace, reply, str(body.get("id", "")))
        if text is not None:
            print(text)
        elif reply.get("ok"):
            output.print_json(reply)  # a reply this CLI does not know how to word: as it came
    elif reply.get("ok"):
        wide = fmt == "wide"
        if "schedules" in reply:
            found = [replies.stored(item) for item in reply["schedules"]]
            if not found:
                print(f"no schedules in namespace {args.namespace!r}", file=sys.stderr)
                return
            output.print_table(output.schedules_table(found, wide=wide))
            if reply.get("next_cursor"):
                print(f"more: --cursor {reply['next_cursor']}", file=sys.stderr)
        else:
            schedule = replies.stored(reply["schedule"])
            output.print_table(output.schedule_table(schedule, wide=wide))


async def _send_all(args: argparse.Namespace, verb: str, bodies: list[dict[str, Any]]) -> int:
    failures = 0
    async with _connected(args, verb) as client:
        for body in bodies:
            reply = await client.send(args.namespace, verb, body)
            _show(args, reply, body)
            _notes(args, reply)
            if not reply.get("ok"):
                failures += 1
                print(f"cronbus {args.command}: {_error_line(reply)}", file=sys.stderr)
    return 1 if failures else 0


def run_apply(args: argparse.Namespace) -> int:
    schedules = load_schedules(args.file)
    if len(schedules) == 1:
        return asyncio.run(_send_all(args, "upsert", [{"schedule": schedules[0]}]))
    return asyncio.run(_apply_many(args, schedules))


async def _apply_many(args: argparse.Namespace, schedules: list[dict[str, Any]]) -> int:
    """Print one result per schedule (id, ok, version or error), in file order."""
    async with _connected(args, "upsert_many") as client:
        try:
            results = await client.upsert_many(args.namespace, schedules)
        except CommandRefused as refused:
            _show(args, refused.reply, {})
            print(f"cronbus {args.command}: {_error_line(refused.reply)}", file=sys.stderr)
            return 1
    failures = 0
    for result in results:
        shown = result.as_reply()
        if args.output == "json":
            output.print_json(shown)  # a line per schedule, as before -o existed
        elif args.output == "yaml":
            print("---")
            output.print_yaml(shown)
        elif (text := said.result_line(args.namespace, shown)) is not None:
            print(text)
        _notes(args, shown)
        if not result.ok:
            failures += 1
            print(f"cronbus {args.command}: {result.id}: {_error_line(shown)}", file=sys.stderr)
    return 1 if failures else 0


def run_by_id(args: argparse.Namespace) -> int:
    return asyncio.run(_send_all(args, args.command, [{"id": args.id}]))


def run_backfill(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"id": args.id, "from": args.from_, "to": args.to}
    if args.limit is not None:
        body["limit"] = args.limit
    return asyncio.run(_send_all(args, "backfill", [body]))


def run_list(args: argparse.Namespace) -> int:
    labels = dict(_label(item) for item in args.label or [])
    body: dict[str, Any] = {"limit": args.limit, "labels": labels}
    if args.cursor:
        body["cursor"] = args.cursor
    if args.state:
        body["state"] = args.state
    return asyncio.run(_send_all(args, "list", [body]))


def _label(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise CliError(f"--label {text!r}: expected key=value")
    return key, value


def run_executions(args: argparse.Namespace) -> int:
    from shared.postgres.store import Store  # noqa: PLC0415 - only this subcommand needs PostgreSQL

    fmt = "json" if args.json else args.output

    async def watch() -> None:
        try:
            store = await Store.open(database_url(), min_size=1, max_size=1)
        except transient.ERRORS as exc:
            raise CliError(database_error(exc)) from None
        try:
            rows = await store.recent_executions(args.namespace, args.id, args.limit)
            if not rows and fmt in ("table", "wide"):
                print(f"no executions of {args.namespace}/{args.id}", file=sys.stderr)
            seen: dict[Any, Any] = {}
            # Watching, the first screen is oldest first too, so the stream reads in order.
            first = output.news(seen, rows) if args.watch else rows
            output.print_executions(first, fmt, header=bool(rows) or args.watch)
            while args.watch:
                await asyncio.sleep(args.interval)
                rows = await store.recent_executions(args.namespace, args.id, args.limit)
                # A new occurrence, or one whose attempt moved on.
                output.print_executions(output.news(seen, rows), fmt, header=False)
        finally:
            await store.close()

    asyncio.run(watch())
    return 0
