"""Partitioned intake under hostile input and faults: each test once broke a promise of
docs/partitions.md (a review of the change found them), and passes since the fix."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlparse

import aio_pika
import aiormq.channel
import asyncpg
import pytest

from shared.contract import codec, keys
from shared.policy import partitions
from tests.support import brokerctl
from tests.support.stack import Stack

PARTITIONS = 4


def ids_in_distinct_partitions(namespace: str, count: int) -> list[str]:
    """``count`` schedule ids, each in a partition of its own."""
    found: dict[int, str] = {}
    for n in range(10_000):
        schedule_id = f"s{n}"
        found.setdefault(partitions.partition_of(namespace, schedule_id, PARTITIONS), schedule_id)
        if len(found) == count:
            return list(found.values())
    raise AssertionError("not enough partitions")


def ids_in_partition(namespace: str, partition: int, count: int) -> list[str]:
    return [
        f"b{n}"
        for n in range(100_000)
        if partitions.partition_of(namespace, f"b{n}", PARTITIONS) == partition
    ][:count]


def schedule(schedule_id: str, every_s: int = 60, **extra: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": every_s},
        "target": {"kind": "webhook", "url": "http://127.0.0.1:9/x"},
        **extra,
    }


def vhost_of(amqp_url: str) -> str:
    return unquote(urlparse(amqp_url).path[1:]) or "/"


def queue_counts(amqp_url: str) -> dict[str, tuple[int, int]]:
    """Per queue of the test's vhost: (ready, unacknowledged)."""
    out = subprocess.run(
        [
            "rabbitmqctl",
            "-q",
            "list_queues",
            "-p",
            vhost_of(amqp_url),
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    counts = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            counts[parts[0]] = (int(parts[1]), int(parts[2]))
    return counts


class Raw:
    """A raw publisher on cronbus.commands with its own reply queue (any properties)."""

    def __init__(self, amqp_url: str) -> None:
        self.url = amqp_url
        self.replies: dict[str, dict[str, Any]] = {}

    async def __aenter__(self) -> Raw:
        self.connection = await aio_pika.connect(self.url)
        self.channel = await self.connection.channel()
        self.queue = await self.channel.declare_queue(exclusive=True, auto_delete=True)
        await self.queue.consume(self._on_reply, no_ack=True)
        self.exchange = await self.channel.get_exchange(keys.COMMANDS_EXCHANGE)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.connection.close()

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self.replies[message.correlation_id or ""] = codec.loads(message.body)

    async def publish(
        self,
        routing_key: str,
        body: bytes | dict[str, Any],
        *,
        reply: bool = True,
        reply_to: str | None = None,
        exchange: aio_pika.abc.AbstractExchange | None = None,
        **properties: Any,
    ) -> str:
        correlation_id = uuid.uuid4().hex
        await (exchange or self.exchange).publish(
            aio_pika.Message(
                body if isinstance(body, bytes) else codec.dumps(body),
                correlation_id=correlation_id,
                reply_to=reply_to or (self.queue.name if reply else None),
                **properties,
            ),
            routing_key=routing_key,
        )
        return correlation_id

    async def wait(self, correlation_id: str, timeout_s: float) -> dict[str, Any] | None:
        for _ in range(int(timeout_s * 20)):
            if correlation_id in self.replies:
                return self.replies[correlation_id]
            await asyncio.sleep(0.05)
        return None


@pytest.fixture
def partitioned(stack_env: dict[str, str]) -> dict[str, str]:
    stack_env["CRONBUS_COMMAND_PARTITIONS"] = str(PARTITIONS)
    stack_env["CRONBUS_SHARD_LEASE_S"] = "2"
    return stack_env


async def test_a_deeply_nested_item_in_a_split_upsert_many_is_refused_and_routing_goes_on(
    partitioned: dict[str, str], stack: Stack, amqp_url: str
) -> None:
    """orjson reads 1024 levels but writes only 254: the parts of this command cannot be
    written. It once killed every router in turn (each dispatcher with it); it goes whole
    now, and the intake refuses it for its nesting, as it did before partitions."""
    await stack.start_all(("dispatcher", "dispatcher"))
    a, b = ids_in_distinct_partitions("rv", 2)
    # 300 levels: within what orjson reads (1024), beyond what it writes (254).
    deep = b"[" * 300 + b'"x"' + b"]" * 300
    first = codec.dumps(schedule(a))[:-1] + b',"labels":' + deep + b"}"
    body = b'{"schedules":[' + first + b"," + codec.dumps(schedule(b)) + b"]}"
    async with Raw(amqp_url) as raw:
        sent = await raw.publish("rv.upsert_many", body, message_id="deep-1")
        reply = await raw.wait(sent, 15)
        alive = stack.running("dispatcher")
        after = await raw.publish("rv.upsert", {"schedule": schedule("after")})
        after_reply = await raw.wait(after, 15)
    assert len(alive) == 2, stack.tails()
    assert reply is not None and reply["error"]["code"] == "invalid_command", reply
    assert after_reply is not None and after_reply["ok"], after_reply


async def test_a_split_command_behind_a_backlog_holds_back_no_other_command(
    partitioned: dict[str, str], stack: Stack, amqp_url: str, database_url: str
) -> None:
    """A split upsert_many with an ``expiration``, queued behind a backlog: its parts once
    expired in their partition, it was never answered, and the router acknowledged nothing
    after it (routing stopped after PREFETCH more commands). Parts never expire now, and a
    command waiting for its parts holds back no other acknowledgement."""
    await stack.start_all(("dispatcher",))
    a, b = ids_in_distinct_partitions("rv", 2)
    crowd = ids_in_partition("rv", partitions.partition_of("rv", a, PARTITIONS), 600)
    conn = await asyncpg.connect(database_url)
    async with Raw(amqp_url) as raw:
        # The intake held up for 3 s (a slow database): partition a's queue fills beyond its
        # prefetch (512), so the part queues behind the rest for longer than its expiration.
        lock = conn.transaction()
        await lock.start()
        await conn.execute("LOCK TABLE schedules IN ACCESS EXCLUSIVE MODE")
        for schedule_id in crowd:
            await raw.publish("rv.upsert", {"schedule": schedule(schedule_id)}, reply=False)
        sent = await raw.publish(
            "rv.upsert_many",
            {"schedules": [schedule(a), schedule(b)]},
            message_id="exp-1",
            expiration=1,
        )
        await asyncio.sleep(3)
        await lock.rollback()
        reply = await raw.wait(sent, 20)
        later = await raw.publish("rv.upsert", {"schedule": schedule("later")})
        later_reply = await raw.wait(later, 15)
        await asyncio.sleep(2)
        counts = queue_counts(amqp_url)
        # PREFETCH (2000) commands more: none of them can be acknowledged behind the gather.
        for _ in range(2100):
            await raw.publish("rv.get", {"id": "later"}, reply=False)
        last = await raw.publish("rv.get", {"id": "later"})
        last_reply = await raw.wait(last, 30)
        stalled_counts = queue_counts(amqp_url)
    await conn.close()
    print("queues", counts, "after 2100 more", stalled_counts)
    assert reply is not None and reply["ok"], f"the split upsert_many: {reply}; queues {counts}"
    assert later_reply is not None and later_reply["ok"], later_reply
    assert last_reply is not None, f"routing stalled; queues {stalled_counts}"


async def test_a_command_whose_reply_to_is_checked_is_not_overtaken(
    partitioned: dict[str, str], stack: Stack, amqp_url: str
) -> None:
    """A reply_to the broker is asked about (a queue neither amq.gen-* nor direct reply-to)
    once let a later command on the same schedule, which needed no check, be applied first
    (10 of 10): the turn is taken before that wait now."""
    await stack.start_all(("dispatcher",))
    async with Raw(amqp_url) as raw:
        overtaken = []
        for n in range(10):
            # A queue of the client's own, exclusive, named by it (aio-pika's amq_<hex> style).
            own = await raw.channel.declare_queue(f"review-{uuid.uuid4().hex}", exclusive=True)
            first = await raw.publish(
                "rv.upsert", {"schedule": schedule(f"o{n}", every_s=1)}, reply_to=own.name
            )
            await raw.publish("rv.upsert", {"schedule": schedule(f"o{n}", every_s=2)}, reply=False)
            del first
        await asyncio.sleep(3)
        for n in range(10):
            got = await raw.publish("rv.get", {"id": f"o{n}"})
            reply = await raw.wait(got, 10)
            assert reply is not None
            if reply["schedule"]["spec"]["every_s"] != 2:
                overtaken.append((f"o{n}", reply["schedule"]["spec"], reply["schedule"]["version"]))
    assert not overtaken, f"{len(overtaken)} of 10: the first upsert applied last: {overtaken}"


@contextlib.contextmanager
def without_message_ids() -> Iterator[None]:
    """aiormq gives every publish a random message_id; other clients send none."""

    class NoId:
        hex = None

        def __init__(self, **_: Any) -> None:
            pass

    saved = getattr(aiormq.channel, "UUID")  # noqa: B009 (not exported: mypy would refuse)
    setattr(aiormq.channel, "UUID", NoId)  # noqa: B010
    try:
        yield
    finally:
        setattr(aiormq.channel, "UUID", saved)  # noqa: B010


def router_of(stack: Stack) -> Any:
    for proc in stack.running("dispatcher"):
        _, text = proc.get("/metrics")
        if "\ncronbus_command_router_active 1.0" in text:
            return proc
    return None


async def test_order_and_answers_while_connections_are_closed(
    partitioned: dict[str, str], stack: Stack, amqp_url: str
) -> None:
    """Promises 1, 2, 6: the router's connection closed mid-flow, then every dispatcher
    connection; routing and partitions come back by themselves."""
    await stack.start_all(("dispatcher", "dispatcher"))
    ids = [f"c{n}" for n in range(24)]
    rounds = 36
    sent: dict[tuple[str, int], str] = {}
    events: list[str] = []
    async with Raw(amqp_url) as raw:
        for r in range(1, rounds + 1):
            for schedule_id in ids:
                sent[(schedule_id, r)] = await raw.publish(
                    "rv.upsert",
                    {"schedule": schedule(schedule_id, every_s=r)},
                    message_id=f"{schedule_id}-{r}",
                )
            await asyncio.sleep(0.25)
            if r in (10, 22):
                named = "cronbus-dispatcher-router" if r == 10 else "cronbus-"
                closed = await asyncio.to_thread(
                    brokerctl.close_connections, amqp_url, named, prefix=True
                )
                events.append(f"{closed} connections named {named} closed")
        missing: list[tuple[str, int]] = []
        for key, correlation_id in sent.items():
            if await raw.wait(correlation_id, 40 if not missing else 0.1) is None:
                missing.append(key)
        finals: dict[str, dict[str, Any] | None] = {}
        for schedule_id in ids:
            got = await raw.publish("rv.get", {"id": schedule_id})
            finals[schedule_id] = await raw.wait(got, 20)
        after = queue_counts(amqp_url)
        await asyncio.sleep(8)
        later = queue_counts(amqp_url)
    print("events", events, "queues", after, "8 s later", later)
    violations = judged(raw, sent, ids, rounds, finals)
    assert len(stack.running("dispatcher")) == 2
    assert later.get(keys.COMMANDS_QUEUE, (0, 0))[1] == 0, later
    assert not missing and not violations, stack.tails()[-4000:]


def judged(
    raw: Raw,
    sent: dict[tuple[str, int], str],
    ids: list[str],
    rounds: int,
    finals: dict[str, dict[str, Any] | None],
) -> list[Any]:
    """Versions rising with the round on each schedule, the last round's state at the end,
    every reply ok."""
    violations: list[Any] = []
    for schedule_id in ids:
        versions = [
            raw.replies[sent[(schedule_id, r)]].get("schedule", {}).get("version")
            for r in range(1, rounds + 1)
            if sent[(schedule_id, r)] in raw.replies
        ]
        if versions != sorted(versions) or len(set(versions)) != len(versions):
            violations.append((schedule_id, versions))
        final = finals[schedule_id]
        if final is None or final["schedule"]["spec"]["every_s"] != rounds:
            violations.append((schedule_id, "final", final and final["schedule"]["spec"]))
    violations += [k for k, c in sent.items() if c in raw.replies and not raw.replies[c].get("ok")]
    return violations


async def test_a_thousand_mixed_items_answered_once_in_input_order(
    partitioned: dict[str, str], stack: Stack, amqp_url: str
) -> None:
    """Promise 3: 1000 items over every partition, some without id, some duplicated, some
    invalid, some hostile: one reply, 1000 results in input order, each on its own."""
    await stack.start_all(("dispatcher", "dispatcher"))
    items: list[Any] = []
    for n in range(1000):
        kind = n % 10
        if kind == 0:
            items.append({"spec": {"kind": "interval", "every_s": 5}})  # no id
        elif kind == 1:
            items.append(schedule(f"d{n % 7}"))  # duplicated ids
        elif kind == 2:
            items.append(schedule(f"bad{n}", every_s=-1))  # invalid
        elif kind == 3:
            items.append("not an object")
        elif kind == 4:
            items.append(schedule(f"nul\x00{n}"))
        else:
            items.append(schedule(f"ok{n}"))
    async with Raw(amqp_url) as raw:
        sent = await raw.publish("rv.upsert_many", {"schedules": items}, message_id="k1")
        reply = await raw.wait(sent, 60)
        await asyncio.sleep(1)
        extra = [c for c in raw.replies if c != sent]
    assert reply is not None and reply["ok"], reply
    results = reply["results"]
    assert len(results) == 1000
    wrong = []
    for n, (item, result) in enumerate(zip(items, results, strict=True)):
        expected_id = item.get("id") if isinstance(item, dict) else None
        if result.get("id") != expected_id:
            wrong.append((n, expected_id, result))
        if n % 10 >= 5 and not result.get("ok"):
            wrong.append((n, "refused", result))
        if n % 10 in (0, 2, 3) and result.get("ok"):
            wrong.append((n, "accepted", result))
    assert not extra, "more than one reply"
    assert not wrong, wrong[:5]


async def test_a_router_killed_while_a_split_is_pending_replays_no_later_command(
    partitioned: dict[str, str], stack: Stack, amqp_url: str, database_url: str
) -> None:
    """Commands after a split upsert_many waiting for its parts once stayed unacknowledged
    until it was answered, though routed: a router killed then had them routed again, and a
    command without message_id was applied again after a later one on its schedule. They are
    acknowledged as soon as they are routed now."""
    await stack.start_all(("dispatcher", "dispatcher"))
    a, b = ids_in_distinct_partitions("rv", 2)
    conn = await asyncpg.connect(database_url)
    async with Raw(amqp_url) as raw:
        create = await raw.publish("rv.upsert", {"schedule": schedule("x", every_s=1)})
        assert await raw.wait(create, 15)
        lock = conn.transaction()
        await lock.start()
        await conn.execute("LOCK TABLE schedules IN ACCESS EXCLUSIVE MODE")
        await raw.publish(
            "rv.upsert_many", {"schedules": [schedule(a), schedule(b)]}, message_id="m1"
        )
        with without_message_ids():  # as pika, Go or Java clients publish by default
            await raw.publish("rv.upsert", {"schedule": schedule("x", every_s=2)}, reply=False)
        await raw.publish(
            "rv.upsert", {"schedule": schedule("x", every_s=3)}, reply=False, message_id="x3"
        )
        await asyncio.sleep(1)
        router = router_of(stack)
        assert router is not None
        stack.kill(router, signal.SIGKILL)
        await asyncio.sleep(1)
        await lock.rollback()
        await asyncio.sleep(6)
        got = await raw.publish("rv.get", {"id": "x"})
        final = await raw.wait(got, 20)
    rows = await conn.fetch("SELECT * FROM commands WHERE body::text LIKE '%\"x\"%' ORDER BY 1")
    await conn.close()
    for row in rows:
        print({k: v for k, v in dict(row).items() if k not in ("reply",)})
    print("final", final and final["schedule"]["spec"], final and final["schedule"]["version"])
    assert final is not None
    assert final["schedule"]["spec"]["every_s"] == 3, (
        f"the last upsert sent set every_s 3; now {final['schedule']['spec']['every_s']} "
        f"(version {final['schedule']['version']})"
    )
