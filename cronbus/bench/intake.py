"""``cronbus bench intake``: commands per second through ``cronbus.commands``, each answered.

For each count of ``--dispatchers`` (1, 2 and 4 by default), that many dispatchers run in a
corner of their own (``cronbus.bench.harness``, as for the other benchmarks; a fresh one per
count, so the counts share no state); one client process on the same machine publishes N
commands of each verb with up to ``--window`` unanswered at once and counts the replies.
Figures, per count: commands (or schedules) per second per verb, failed replies, and the
dispatchers' CPU time per command (summed over the processes). Last, the ``ordered`` phase
sends interleaved upserts to a few schedules and judges from the replies whether each
schedule's commands were applied in the order sent (``cronbus.bench.order``).
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

from cronbus.bench import harness, order
from cronbus.bench.harness import Kinds
from cronbus.cli import procs
from cronbus.cli.common import CliError
from shared.contract import codec, keys
from shared.runtime.config import CommonSettings

NAMESPACE = "bench"
#: Schedules per upsert_many command.
MANY_CHUNK = 1000
#: The phase that checks the order; it runs after the phases of ``phases``.
ORDERED = "ordered"
#: Dispatcher processes at most per count (a 2-core machine is already crowded at 4).
MOST_DISPATCHERS = 16
#: Exit status when figures were printed but some schedule's commands were applied out of
#: order (2, a ``CliError``, means no figures).
ORDER_VIOLATED = 1

Body = Callable[[int], dict[str, Any]]
Figures = dict[str, Any]


def schedule_of(i: int) -> dict[str, Any]:
    return {
        "id": f"s{i:08d}",
        "spec": {"kind": "interval", "every_s": 3600},
        "target": {"kind": "webhook", "url": "http://127.0.0.1:9/bench"},
    }


def ordered_id(schedule: int) -> str:
    return f"o{schedule:06d}"


def ordered_commands(schedules: int, each: int) -> list[tuple[str, int, bytes]]:
    """(schedule id, seq, upsert body), interleaved: every schedule's seq 0, then every seq 1...

    Interleaved, a schedule's consecutive commands are ``schedules`` apart in the queue, so
    several dispatchers are likely to take them into different batches.
    """
    commands = []
    for seq in range(each):
        for schedule in range(schedules):
            body = {
                **schedule_of(0),
                "id": ordered_id(schedule),
                "labels": {order.SEQ_LABEL: str(seq)},
            }
            commands.append((ordered_id(schedule), seq, codec.dumps({"schedule": body})))
    return commands


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
        #: The correlation ids of the last run, in the order sent.
        self.sent: list[str] = []
        #: The last run's replies by correlation id, when it keeps them (``keep``).
        self.kept: dict[str, dict[str, Any]] = {}
        self.keep = False

    async def on_reply(self, message: AbstractIncomingMessage) -> None:
        reply = codec.loads(message.body)
        if not reply.get("ok") or any(not r.get("ok") for r in reply.get("results", ())):
            self.failed += 1
            self.first_error = self.first_error or reply
        if self.keep and message.correlation_id is not None:
            self.kept[message.correlation_id] = reply
        self.waiting -= 1
        self.window.release()
        if self.waiting == 0:
            self.done.set()

    async def run(
        self, verb: str, bodies: list[bytes], timeout_s: float, keep: bool = False
    ) -> float:
        """Seconds from the first publish to the last reply; at most ``timeout_s`` in all,
        publishing included (a window that never frees up would otherwise wait forever).
        With ``keep``, the replies are kept for ``replies_in_order``."""
        self.done.clear()
        self.waiting = len(bodies)
        self.sent = []
        self.kept = {}
        self.keep = keep
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

    def replies_in_order(self) -> list[dict[str, Any] | None]:
        """The last run's kept replies, in the order their commands were sent."""
        return [self.kept.get(correlation_id) for correlation_id in self.sent]

    async def _publish_all(self, verb: str, bodies: list[bytes]) -> None:
        exchange = await self.channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        routing_key = keys.command_routing_key(NAMESPACE, verb)
        for body in bodies:
            await self.window.acquire()
            correlation_id = uuid.uuid4().hex
            self.sent.append(correlation_id)
            await exchange.publish(
                aio_pika.Message(
                    body,
                    content_type="application/json",
                    reply_to=self.reply_to,
                    correlation_id=correlation_id,
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


async def _measured(args: argparse.Namespace) -> list[Figures]:
    """One block of figures per dispatcher count, each measured in a fresh corner."""
    return [await _measured_with(args, count) for count in args.dispatchers]


async def _measured_with(args: argparse.Namespace, dispatchers: int) -> Figures:
    async with harness.corner(CommonSettings()) as found:
        with tempfile.TemporaryDirectory(prefix="cronbus-bench-") as logs:
            run = harness.Run(found, Path(logs))
            try:
                run.start("dispatcher", dispatchers, {**harness.service_env(args)})
                await run.ready()
                return await harness.watched(run, _phases(args, dispatchers, found, run))
            finally:
                run.stop()


async def _phases(
    args: argparse.Namespace, dispatchers: int, found: harness.Corner, run: harness.Run
) -> Figures:
    figures: Figures = {"n": args.n, "window": args.window, "dispatchers": dispatchers}
    connection = await aio_pika.connect(found.amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=False)
        replies = await channel.declare_queue(exclusive=True)
        client = Client(channel, replies.name, args.window)
        await replies.consume(client.on_reply, no_ack=True)
        for name, verb, bodies, items in phases(args.n):
            if args.only and name not in args.only:
                continue
            figures |= await _timed(args, dispatchers, client, run, name, verb, bodies, items)
        if not args.only or ORDERED in args.only:
            figures |= await _ordered(args, dispatchers, client, run)
        figures["failed_replies"] = client.failed
    return figures


async def _timed(
    args: argparse.Namespace,
    dispatchers: int,
    client: Client,
    run: harness.Run,
    name: str,
    verb: str,
    bodies: list[bytes],
    items: int,
    keep: bool = False,
) -> Figures:
    """One phase's rate and the dispatchers' CPU per item (the processes summed)."""
    cpu_before = run.cpu_seconds()
    elapsed = await client.run(verb, bodies, args.timeout_s, keep)
    cpu_s = run.cpu_seconds() - cpu_before
    # Progress on stderr (stdout holds the figures): a long run is not a silent one.
    print(
        f"cronbus bench intake: {dispatchers} dispatcher(s): {name}: {items} in {elapsed:.1f}s",
        file=sys.stderr,
        flush=True,
    )
    if client.failed:
        raise CliError(
            f"{name}: {client.failed} of {len(bodies)} replies were refusals, the "
            f"first: {codec.dumps(client.first_error).decode()}; no figures (they "
            "would time refusals, not the intake)"
        )
    return {
        f"{name}_per_s": round(items / elapsed, 1),
        f"{name}_dispatcher_cpu_ms_per_item": round(cpu_s * 1000 / items, 3),
    }


async def _ordered(
    args: argparse.Namespace, dispatchers: int, client: Client, run: harness.Run
) -> Figures:
    """Interleaved upserts to a few schedules, timed like a phase, then each schedule read
    back; the order judged from the replies alone, as a user would see it."""
    commands = ordered_commands(args.order_schedules, args.order_each)
    bodies = [body for _, _, body in commands]
    figures = await _timed(
        args, dispatchers, client, run, ORDERED, "upsert", bodies, len(bodies), keep=True
    )
    answers = [
        order.Answer(schedule, seq, order.version_of(reply))
        for (schedule, seq, _), reply in zip(commands, client.replies_in_order(), strict=True)
    ]
    ids = [ordered_id(schedule) for schedule in range(args.order_schedules)]
    await client.run("get", [codec.dumps({"id": id_}) for id_ in ids], args.timeout_s, True)
    finals = {
        id_: order.final_seq_of(reply)
        for id_, reply in zip(ids, client.replies_in_order(), strict=True)
    }
    violations = order.judge(dict.fromkeys(ids, args.order_each), answers, finals)
    return figures | {
        "order_schedules": args.order_schedules,
        "order_each": args.order_each,
        "order_violations": order.summary(violations),
    }


def check_args(args: argparse.Namespace) -> None:
    """Refused before anything starts, each naming its option."""
    if args.n < 1 or args.n > 20_000:
        raise CliError("--n: between 1 and 20000 (each verb runs N commands)")
    if args.window < 1:
        raise CliError("--window: at least 1 unanswered command")
    if not args.timeout_s > 0:
        raise CliError("--timeout-s: a number of seconds above 0")
    if any(not 1 <= count <= MOST_DISPATCHERS for count in args.dispatchers):
        raise CliError(f"--dispatchers: each count between 1 and {MOST_DISPATCHERS}")
    if args.order_schedules < 1 or args.order_each < 2:
        raise CliError("--order-schedules: at least 1; --order-each: at least 2 (an order)")
    if args.order_schedules * args.order_each > 20_000:
        raise CliError("--order-schedules times --order-each: at most 20000 commands")
    names = [name for name, *_ in phases(0)] + [ORDERED]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        raise CliError(f"--only: {', '.join(unknown)} not among {', '.join(names)}")
    if args.only == []:
        raise CliError(f"--only: name at least one of {', '.join(names)}")


def violated(blocks: list[Figures]) -> str | None:
    """Why the run fails its order check, or None when every checked count kept the order."""
    found = [
        f"{block['dispatchers']} dispatcher(s): {block['order_violations']['count']} "
        f"violation(s), the first: {codec.dumps(block['order_violations']['examples'][0]).decode()}"
        for block in blocks
        if block.get("order_violations", {}).get("count")
    ]
    if not found:
        return None
    return "commands on one schedule were applied out of the order sent; " + "; ".join(found)


def run(args: argparse.Namespace) -> int:
    """The figures of every count printed, then exit status 1 if any broke the order (2 with
    no figures, as for the other benchmarks, when a count could not be measured)."""
    check_args(args)
    blind = order.blind_counts(args.order_schedules, args.dispatchers)
    if blind and (not args.only or ORDERED in args.only):
        print(
            f"cronbus bench intake: --order-schedules {args.order_schedules} is a multiple of "
            f"{', '.join(map(str, blind))} dispatchers: taken in turn, each schedule's commands "
            "may all reach one of them, so the order check may not see a shared queue's "
            "disorder (an odd or prime count avoids it)",
            file=sys.stderr,
            flush=True,
        )
    blocks = procs.run_until_signal(_measured(args))
    for i, block in enumerate(blocks):
        if i and not args.json:
            print()
        harness.emit(args, block)
    reason = violated(blocks)
    if reason is not None:
        print(f"cronbus bench intake: {reason}", file=sys.stderr, flush=True)
        return ORDER_VIOLATED
    return 0


def add_kind(kinds: Kinds) -> argparse.ArgumentParser:
    intake = kinds.add_parser(
        "intake", help="commands per second through cronbus.commands, each answered"
    )
    intake.add_argument("--n", type=int, default=5000, help="commands of each verb")
    intake.add_argument("--window", type=int, default=2000, help="unanswered commands at most")
    intake.add_argument("--timeout-s", type=float, default=120)
    intake.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="only these figures (upsert, get, list, ..., ordered)",
    )
    intake.add_argument(
        "--order-schedules",
        type=int,
        # Prime: no dispatcher count divides it (see order.blind_counts).
        default=101,
        help="schedules of the ordered phase (default 101)",
    )
    intake.add_argument(
        "--order-each",
        type=int,
        default=20,
        help="upserts to each schedule in the ordered phase, interleaved (default 20)",
    )
    intake.set_defaults(handler=run)
    return intake
