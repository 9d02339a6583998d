"""``cronbus apply | get | list | pause | resume | delete | trigger | backfill | executions``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from cronbus import client as client_module
from cronbus.cli.common import CliError, amqp_url, broker_error, database_error, database_url
from cronbus.client import CommandClient
from shared.contract import codec, models, timefmt
from shared.runtime import transient


def load_schedules(path: str) -> list[dict[str, Any]]:
    """A YAML or JSON file holding one schedule, a list of them, or YAML documents of either."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CliError(f"-f {path}: {exc.strerror or exc}") from None
    try:
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


def _print(reply: dict[str, Any]) -> None:
    print(codec.dumps(reply).decode())


def _notes(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """What a person should notice in an accepted upsert: nothing changed, or a warning."""
    schedule = result.get("schedule") or {}
    name = result.get("id") or schedule.get("id") or ""
    version = result.get("version", schedule.get("version"))
    if result.get("unchanged"):
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
    where = "; ".join(f"{d.get('field')}: {d.get('reason')}" for d in details)
    return f"{error.get('code')}: {where or error.get('message')}"


async def _send_all(args: argparse.Namespace, verb: str, bodies: list[dict[str, Any]]) -> int:
    failures = 0
    try:
        async with CommandClient(amqp_url(), app_id="cronbus-cli") as client:
            for body in bodies:
                try:
                    reply = await client.send(args.namespace, verb, body, timeout_s=args.timeout)
                except TimeoutError:
                    raise CliError(
                        f"no reply within {args.timeout:g}s: is a dispatcher "
                        "running against this RabbitMQ?"
                    ) from None
                _print(reply)
                _notes(args, reply)
                if not reply.get("ok"):
                    failures += 1
                    print(f"cronbus {args.command}: {_error_line(reply)}", file=sys.stderr)
    except client_module.ACCESS_REFUSED as exc:
        raise CliError(_refused_line(args, verb, exc)) from None
    except transient.ERRORS as exc:
        raise CliError(broker_error(exc)) from None
    return 1 if failures else 0


def _refused_line(args: argparse.Namespace, verb: str, exc: BaseException) -> str:
    user = client_module.user_of(amqp_url()) or "this user"
    reason = " ".join(str(part) for part in getattr(exc, "args", ()) if part).strip()
    return (
        f"RabbitMQ refused access (ACCESS_REFUSED): {user} may not send {verb} commands "
        f"to namespace {args.namespace!r} ({reason or exc!r})"
    )


#: An upsert_many command stays well inside the default CRONBUS_MAX_COMMAND_BYTES.
APPLY_CHUNK_BYTES = 200_000


def run_apply(args: argparse.Namespace) -> int:
    schedules = load_schedules(args.file)
    if len(schedules) == 1:
        return asyncio.run(_send_all(args, "upsert", [{"schedule": schedules[0]}]))
    return asyncio.run(_send_many(args, list(chunks(schedules))))


def chunks(schedules: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """upsert_many bodies: at most 1000 schedules and about APPLY_CHUNK_BYTES each."""
    chunk: list[dict[str, Any]] = []
    size = 0
    for item in schedules:
        item_size = len(codec.dumps(item)) + 1
        if chunk and (len(chunk) >= models.MAX_UPSERT_MANY or size + item_size > APPLY_CHUNK_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += item_size
    if chunk:
        yield chunk


async def _send_many(args: argparse.Namespace, batches: list[list[dict[str, Any]]]) -> int:
    """Print one result per schedule (id, ok, version or error), in file order."""
    failures = 0
    try:
        async with CommandClient(amqp_url(), app_id="cronbus-cli") as client:
            for schedules in batches:
                try:
                    reply = await client.send(
                        args.namespace,
                        "upsert_many",
                        {"schedules": schedules},
                        timeout_s=args.timeout,
                    )
                except TimeoutError:
                    raise CliError(
                        f"no reply within {args.timeout:g}s: is a dispatcher "
                        "running against this RabbitMQ?"
                    ) from None
                if not reply.get("ok"):
                    _print(reply)
                    print(f"cronbus {args.command}: {_error_line(reply)}", file=sys.stderr)
                    failures += 1
                    continue
                for result in reply["results"]:
                    _print(result)
                    _notes(args, result)
                    if not result.get("ok"):
                        failures += 1
                        print(
                            f"cronbus {args.command}: {result.get('id')}: {_error_line(result)}",
                            file=sys.stderr,
                        )
    except client_module.ACCESS_REFUSED as exc:
        raise CliError(_refused_line(args, "upsert_many", exc)) from None
    except transient.ERRORS as exc:
        raise CliError(broker_error(exc)) from None
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

    async def fetch() -> list[dict[str, Any]]:
        try:
            store = await Store.open(database_url(), min_size=1, max_size=1)
        except transient.ERRORS as exc:
            raise CliError(database_error(exc)) from None
        try:
            return await store.recent_executions(args.namespace, args.id, args.limit)
        finally:
            await store.close()

    rows = asyncio.run(fetch())
    if args.json:
        for row in rows:
            print(codec.dumps({k: _plain(v) for k, v in row.items()}).decode())
        return 0
    if not rows:
        print(f"no executions of {args.namespace}/{args.id}")
        return 0
    print(f"{'FIRE TIME':24} {'STATUS':10} {'TRY':>3} {'HTTP':>4} {'LATE MS':>8}  ERROR")
    for row in rows:
        fire = timefmt.format_ms(timefmt.datetime_to_ms(row["nominal_at"]))
        kind = "*" if row["is_trigger"] else ("b" if row["is_backfill"] else " ")
        print(
            f"{fire:23}{kind} {row['status']:10} {row['attempts']:>3} "
            f"{row['http_status'] or '':>4} {row['lateness_ms']:>8}  {row['error'] or ''}"
        )
    return 0


def _plain(value: Any) -> Any:
    if hasattr(value, "tzinfo"):
        return timefmt.format_ms(timefmt.datetime_to_ms(value))
    return value
