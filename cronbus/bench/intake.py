"""``cronbus bench intake``: commands per second through ``cronbus.commands``, each answered.

A dispatcher runs in a corner of its own (``cronbus.bench.harness``, as for the other
benchmarks); one client process on the same machine publishes N commands of each verb with up
to ``--window`` unanswered at once and counts the replies. Figures: commands (or schedules) per
second per verb, failed replies, and the dispatcher's CPU time per command.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from cronbus.bench import harness
from cronbus.bench.harness import Kinds
from cronbus.cli.common import CliError
from shared.contract import codec, keys
from shared.runtime.config import CommonSettings

NAMESPACE = "bench"
#: Schedules per upsert_many command.
MANY_CHUNK = 1000

Body = Callable[[int], dict[str, Any]]
Figures = dict[str, Any]


def schedule_of(i: int) -> dict[str, Any]:
    return {
        "id": f"s{i:08d}",
        "spec": {"kind": "interval", "every_s": 3600},
        "target": {"kind": "webhook", "url": "http://127.0.0.1:9/bench"},
    }


class Client:
    """Publishes commands, at most ``window`` unanswered, and counts their replies."""

    def __init__(self, channel: AbstractChannel, reply_to: str, window: int) -> None:
        self.channel = channel
        self.reply_to = reply_to
        self.window = asyncio.Semaphore(window)
        self.waiting = 0
        self.failed = 0
        self.first_error: dict[str, Any] | None = None
        self.done = asyncio.Event()

    async def on_reply(self, message: AbstractIncomingMessage) -> None:
        reply = codec.loads(message.body)
        if not reply.get("ok") or any(not r.get("ok") for r in reply.get("results", ())):
            self.failed += 1
            self.first_error = self.first_error or reply
        self.waiting -= 1
        self.window.release()
        if self.waiting == 0:
            self.done.set()

    async def run(self, verb: str, bodies: list[bytes], timeout_s: float) -> float:
        """Seconds from the first publish to the last reply; at most ``timeout_s`` in all,
        publishing included (a window that never frees up would otherwise wait forever)."""
        self.done.clear()
        self.waiting = len(bodies)
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._publish_all(verb, bodies), timeout_s)
            await asyncio.wait_for(self.done.wait(), max(started + timeout_s - time.monotonic(), 0))
        except TimeoutError:
            answered = len(bodies) - self.waiting
            raise CliError(
                f"{verb}: {answered} of {len(bodies)} commands answered after {timeout_s:g}s "
                "; no figures (raise --timeout-s or lower --n)"
            ) from None
        return time.monotonic() - started

    async def _publish_all(self, verb: str, bodies: list[bytes]) -> None:
        exchange = await self.channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        routing_key = keys.command_routing_key(NAMESPACE, verb)
        for body in bodies:
            await self.window.acquire()
            await exchange.publish(
                aio_pika.Message(
                    body,
                    content_type="application/json",
                    reply_to=self.reply_to,
                    correlation_id=uuid.uuid4().hex,
                    message_id=uuid.uuid4().hex,
                ),
                routing_key=routing_key,
            )


def phases(n: int) -> list[tuple[str, str, list[bytes], int]]:
    """(figure name, verb, bodies, items counted) in the order they run."""
    ids = [{"id": f"s{i:08d}"} for i in range(n)]
    many = [
        codec.dumps(
            {"schedules": [schedule_of(n + i) for i in range(start, min(start + MANY_CHUNK, n))]}
        )
        for start in range(0, n, MANY_CHUNK)
    ]
    return [
        ("upsert", "upsert", [codec.dumps({"schedule": schedule_of(i)}) for i in range(n)], n),
        ("upsert_many", "upsert_many", many, n),
        ("get", "get", [codec.dumps(body) for body in ids], n),
        ("list", "list", [codec.dumps({"limit": 10})] * n, n),
        ("pause", "pause", [codec.dumps(body) for body in ids], n),
        ("resume", "resume", [codec.dumps(body) for body in ids], n),
        ("trigger", "trigger", [codec.dumps(body) for body in ids], n),
        ("delete", "delete", [codec.dumps(body) for body in ids], n),
    ]


async def _measured(args: argparse.Namespace) -> dict[str, Any]:
    async with harness.corner(CommonSettings()) as found:
        with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
            run = harness.Run(found, Path(logs))
            try:
                run.start("dispatcher", args.dispatchers, {**harness.service_env(args)})
                await run.ready()
                return await harness.watched(run, _phases(args, found, run))
            finally:
                run.stop()


async def _phases(args: argparse.Namespace, found: harness.Corner, run: harness.Run) -> Figures:
    figures: Figures = {"n": args.n, "window": args.window, "dispatchers": args.dispatchers}
    connection = await aio_pika.connect(found.amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=False)
        replies = await channel.declare_queue(exclusive=True)
        client = Client(channel, replies.name, args.window)
        await replies.consume(client.on_reply, no_ack=True)
        for name, verb, bodies, items in phases(args.n):
            if args.only and name not in args.only:
                continue
            cpu_before = run.cpu_seconds()
            elapsed = await client.run(verb, bodies, args.timeout_s)
            cpu_s = run.cpu_seconds() - cpu_before
            figures[f"{name}_per_s"] = round(items / elapsed, 1)
            figures[f"{name}_dispatcher_cpu_ms_per_item"] = round(cpu_s * 1000 / items, 3)
            # Progress on stderr (stdout holds the figures): a long run is not a silent one.
            print(
                f"cronbus bench intake: {name}: {items} in {elapsed:.1f}s",
                file=sys.stderr,
                flush=True,
            )
            if client.failed:
                raise CliError(
                    f"{name}: {client.failed} of {len(bodies)} replies were refusals, the "
                    f"first: {codec.dumps(client.first_error).decode()}; no figures (they "
                    "would time refusals, not the intake)"
                )
        figures["failed_replies"] = client.failed
    return figures


def check_args(args: argparse.Namespace) -> None:
    """Refused before anything starts, each naming its option."""
    if args.n < 1 or args.n > 20_000:
        raise CliError("--n: between 1 and 20000 (each verb runs N commands)")
    if args.window < 1:
        raise CliError("--window: at least 1 unanswered command")
    if not args.timeout_s > 0:
        raise CliError("--timeout-s: a number of seconds above 0")
    names = [name for name, *_ in phases(0)]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        raise CliError(f"--only: {', '.join(unknown)} not among {', '.join(names)}")
    if args.only == []:
        raise CliError(f"--only: name at least one of {', '.join(names)}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    return harness.report(args, _measured(args))


def add_kind(kinds: Kinds) -> argparse.ArgumentParser:
    intake = kinds.add_parser(
        "intake", help="commands per second through cronbus.commands, each answered"
    )
    intake.add_argument("--n", type=int, default=5000, help="commands of each verb")
    intake.add_argument("--window", type=int, default=2000, help="unanswered commands at most")
    intake.add_argument("--timeout-s", type=float, default=120)
    intake.add_argument(
        "--only", nargs="*", default=None, help="only these figures (upsert, get, list, ...)"
    )
    intake.set_defaults(handler=run)
    return intake
