"""Every client is answered on a queue of its own, and no command makes cronbus write into a
queue someone else consumes (docs/commands.md, "Where replies go")."""

from __future__ import annotations

import asyncio
import base64
import re
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from shared.contract import codec, keys
from tests.support import brokerctl, rawamqp
from tests.support.stack import Stack

HOOK = "http://127.0.0.1:9/hook"


def upsert(schedule_id: str) -> bytes:
    return codec.dumps(
        {
            "schedule": {
                "id": schedule_id,
                "spec": {"kind": "interval", "every_s": 3600},
                "target": {"kind": "webhook", "url": HOOK},
            }
        }
    )


async def ask(
    channel: AbstractChannel, queue: AbstractQueue, body: bytes, timeout_s: float = 10
) -> dict[str, Any]:
    """Send one upsert with ``reply_to`` = ``queue`` and wait for its reply there."""
    correlation_id = uuid.uuid4().hex
    got: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def on_reply(message: AbstractIncomingMessage) -> None:
        if message.correlation_id == correlation_id and not got.done():
            got.set_result(codec.loads(message.body))

    tag = await queue.consume(on_reply, no_ack=True)
    try:
        commands = await channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        await commands.publish(
            aio_pika.Message(
                body,
                content_type="application/json",
                reply_to=queue.name,
                correlation_id=correlation_id,
            ),
            routing_key="acme.upsert",
        )
        return await asyncio.wait_for(got, timeout_s)
    finally:
        await queue.cancel(tag)


async def dead_reasons(channel: AbstractChannel, wanted: int) -> list[str]:
    """The reasons of the first ``wanted`` commands dead-lettered (waits up to 10 s)."""
    dlq = await channel.get_queue(keys.dead_letter_queue(keys.COMMANDS_QUEUE), ensure=False)
    reasons: list[str] = []
    for _ in range(100):
        dead = await dlq.get(fail=False, no_ack=True)
        if dead is not None:
            reasons.append(str((dead.headers or {}).get(keys.DEAD_REASON_HEADER)))
            if len(reasons) >= wanted:
                break
            continue
        await asyncio.sleep(0.1)
    return reasons


async def refused_count(stack: Stack) -> float:
    status, text = await asyncio.to_thread(stack.running("dispatcher")[0].get, "/metrics")
    assert status == 200
    found = re.search(r"^cronbus_reply_to_refused_total ([0-9.e+]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
async def dispatcher(stack: Stack) -> AsyncIterator[Stack]:
    await stack.start_all(("dispatcher",))
    yield stack


async def test_a_robust_connection_s_exclusive_queue_is_answered(
    dispatcher: Stack, amqp_url: str
) -> None:
    connection = await aio_pika.connect_robust(amqp_url)
    async with connection:
        channel = await connection.channel()
        replies = await channel.declare_queue(exclusive=True)
        assert replies.name.startswith("amq_")  # aio-pika names it, not the broker
        for n in range(3):  # the first asks the broker, the next ones its kept answer
            reply = await ask(channel, replies, upsert(f"robust-{n}"))
            assert reply["ok"] is True, reply
    assert await refused_count(dispatcher) == 0


async def test_a_plain_connection_s_named_exclusive_queue_and_direct_reply_to_are_answered(
    dispatcher: Stack, amqp_url: str
) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        named = await channel.declare_queue(f"acme.replies.{uuid.uuid4().hex}", exclusive=True)
        assert (await ask(channel, named, upsert("named")))["ok"] is True
        server_named = await channel.declare_queue(exclusive=True)
        assert server_named.name.startswith("amq.gen-")
        assert (await ask(channel, server_named, upsert("server-named")))["ok"] is True
        direct = await channel.declare_queue(keys.DIRECT_REPLY_TO, passive=True)
        assert (await ask(channel, direct, upsert("direct")))["ok"] is True
    assert await refused_count(dispatcher) == 0


async def test_a_queue_others_consume_is_never_written_into(
    dispatcher: Stack, amqp_url: str
) -> None:
    """Another tenant's durable queue, a queue that does not exist, a crafted direct reply-to
    token: each command is refused unanswered, dead-lettered with why, and counted; nothing
    lands in the victim's queue, and the next command is answered."""
    victim_connection = await aio_pika.connect(amqp_url)
    attacker = await aio_pika.connect(amqp_url)
    async with victim_connection, attacker:
        victim_channel = await victim_connection.channel()
        victim = await victim_channel.declare_queue("billing.inbox", durable=True)
        channel = await attacker.channel()
        commands = await channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        hostile = [
            "billing.inbox",
            "no.such.queue",
            "amq.rabbitmq.reply-to.a.b",
            "amq_\u00e9t\u00e9",  # a name AMQP clients cannot declare, passively or not
            "q!",
        ]
        for n, reply_to in enumerate(hostile):
            await commands.publish(
                aio_pika.Message(upsert(f"hostile-{n}"), reply_to=reply_to, correlation_id="c"),
                routing_key="acme.upsert",
            )
        reasons = await dead_reasons(channel, len(hostile))
        assert len(reasons) == len(hostile), (reasons, dispatcher.tails())
        for reply_to in hostile:
            assert any(f"reply_to {reply_to!r}" in reason for reason in reasons), reasons
        assert await refused_count(dispatcher) == len(hostile)
        # The attacker's connection was not closed by the broker (a crafted token is never
        # published to), the victim's queue holds nothing, and the intake goes on.
        mine = await channel.declare_queue(exclusive=True)
        assert (await ask(channel, mine, upsert("after")))["ok"] is True
        assert await victim.get(fail=False) is None


async def test_a_queue_exclusive_to_another_connection_is_answered(
    dispatcher: Stack, amqp_url: str
) -> None:
    """What the broker cannot tell: the exclusive queue's owner need not be the sender. The
    reply then lands in a queue only its owner consumes, who declared it for themselves; no
    queue anyone else consumes is reached (docs/security.md)."""
    owner = await aio_pika.connect(amqp_url)
    sender = await aio_pika.connect(amqp_url)
    async with owner, sender:
        owner_channel = await owner.channel()
        owned = await owner_channel.declare_queue(f"owner.{uuid.uuid4().hex}", exclusive=True)
        sender_channel = await sender.channel()
        commands = await sender_channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        await commands.publish(
            aio_pika.Message(upsert("elsewhere"), reply_to=owned.name, correlation_id="c-x"),
            routing_key="acme.upsert",
        )
        landed = None
        for _ in range(100):
            landed = await owned.get(fail=False, no_ack=True)
            if landed is not None:
                break
            await asyncio.sleep(0.1)
        assert landed is not None and landed.correlation_id == "c-x"


async def test_properties_that_are_not_utf8_are_refused_and_the_intake_goes_on(
    dispatcher: Stack, amqp_url: str
) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        mine = await channel.declare_queue(exclusive=True)
        answers: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        tag = await mine.consume(answers.put, no_ack=True)
        commands = await channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        hostile: list[dict[str, Any]] = [
            {"reply_to": mine.name, "correlation_id": "c-\udcff"},
            {
                "reply_to": mine.name,
                "correlation_id": "c-h",
                "headers": {rawamqp.RAW_HEADERS_MARK: "1"},
            },
            {"reply_to": "amq_\udcff\udcfe", "correlation_id": "c-r"},
        ]
        with rawamqp.raw_strings():
            for n, properties in enumerate(hostile):
                await commands.publish(
                    aio_pika.Message(upsert(f"raw-{n}"), **properties),
                    routing_key="acme.upsert",
                )
        got = {}
        for _ in range(2):
            answer = await asyncio.wait_for(answers.get(), 10)
            got[answer.correlation_id] = codec.loads(answer.body)
        assert got["c-\ufffd"]["error"]["details"] == [
            {"field": "correlation_id", "reason": "is not UTF-8"}
        ]
        assert got["c-h"]["error"]["details"] == [{"field": "headers", "reason": "is not UTF-8"}]
        reasons = await dead_reasons(channel, 1)
        assert len(reasons) == 1 and "is not UTF-8" in reasons[0], reasons
        assert await refused_count(dispatcher) == 1
        await mine.cancel(tag)
        started = time.monotonic()
        assert (await ask(channel, mine, upsert("after"), timeout_s=5))["ok"] is True
        assert time.monotonic() - started < 2.0


async def test_a_token_the_broker_cannot_place_costs_its_own_reply_only(
    dispatcher: Stack, amqp_url: str
) -> None:
    """A direct reply-to token of the broker's shape on a node it does not know: RabbitMQ
    closes the connection that publishes to it. That is the replies connection, never the
    intake's: the command is applied, its reply given up and counted, and the next commands
    are answered, on direct reply-to too."""
    node = b"reply@1"
    pid = b"\x83Xv" + struct.pack(">H", len(node)) + node + struct.pack(">III", 1, 2, 3)
    token = f"{keys.DIRECT_REPLY_TO}.{base64.b64encode(pid).decode()}.{'A' * 22}=="
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        commands = await channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        await commands.publish(
            aio_pika.Message(upsert("unplaced"), reply_to=token, correlation_id="c-u"),
            routing_key="acme.upsert",
        )
        for _ in range(100):
            if await refused_count(dispatcher) == 1:
                break
            await asyncio.sleep(0.1)
        assert await refused_count(dispatcher) == 1, dispatcher.tails()
        mine = await channel.declare_queue(exclusive=True)
        started = time.monotonic()
        assert (await ask(channel, mine, upsert("next"), timeout_s=5))["ok"] is True
        assert time.monotonic() - started < 2.0
        direct = await channel.declare_queue(keys.DIRECT_REPLY_TO, passive=True)
        assert (await ask(channel, direct, upsert("direct"), timeout_s=10))["ok"] is True
    assert "reply_to_unplaceable" in dispatcher.tails()


async def test_a_queue_declared_durable_after_its_exclusive_owner_left_is_never_written_into(
    dispatcher: Stack, amqp_url: str
) -> None:
    """The broker's word is kept a while, but a reply is published only where the broker still
    says, at that moment, that the queue is exclusive: an exclusive queue answered once, its
    owner gone, and a durable queue of the same name declared by another tenant at once gets
    no reply (the command is dead-lettered with why and counted)."""
    name = f"acme.replies.{uuid.uuid4().hex}"
    first = await aio_pika.connect(amqp_url)
    async with first:
        channel = await first.channel()
        owned = await channel.declare_queue(name, exclusive=True)
        assert (await ask(channel, owned, upsert("while-owned")))["ok"] is True
    victim_connection = await aio_pika.connect(amqp_url)
    attacker = await aio_pika.connect(amqp_url)
    async with victim_connection, attacker:
        victim = await (await victim_connection.channel()).declare_queue(name, durable=True)
        channel = await attacker.channel()
        commands = await channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        await commands.publish(
            aio_pika.Message(upsert("after-owner-left"), reply_to=name, correlation_id="c-l"),
            routing_key="acme.upsert",
        )
        reasons = await dead_reasons(channel, 1)
        assert len(reasons) == 1 and f"reply_to {name!r}" in reasons[0], reasons
        assert await victim.get(fail=False) is None
        assert await refused_count(dispatcher) == 1


async def test_replies_go_on_after_the_broker_closes_the_replies_connection(
    dispatcher: Stack, amqp_url: str
) -> None:
    """The connection cronbus checks reply queues on is closed by the broker between two
    commands: the next commands are still answered (no `internal`), on an exclusive queue
    and on direct reply-to."""
    connection = await aio_pika.connect_robust(amqp_url)
    async with connection:
        channel = await connection.channel()
        replies = await channel.declare_queue(exclusive=True)
        assert (await ask(channel, replies, upsert("before")))["ok"] is True
        closed = await asyncio.to_thread(
            brokerctl.close_connections, amqp_url, "cronbus-dispatcher-replies"
        )
        assert closed == 1
        for n in range(3):
            reply = await ask(channel, replies, upsert(f"after-{n}"), timeout_s=15)
            assert reply["ok"] is True, reply
        direct = await channel.declare_queue(keys.DIRECT_REPLY_TO, passive=True)
        assert (await ask(channel, direct, upsert("direct"), timeout_s=15))["ok"] is True
    assert "command_internal_error" not in dispatcher.tails()


async def test_tokens_the_broker_cannot_place_cost_no_one_else_s_reply(
    dispatcher: Stack, amqp_url: str
) -> None:
    """Unplaceable tokens sent among other commands answered by direct reply-to: each closes
    the replies connection, yet every other direct reply arrives."""
    node = b"reply@1"
    pid = b"\x83Xv" + struct.pack(">H", len(node)) + node + struct.pack(">III", 1, 2, 3)
    token = f"{keys.DIRECT_REPLY_TO}.{base64.b64encode(pid).decode()}.{'A' * 22}=="
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        got: set[str] = set()

        async def on_reply(message: AbstractIncomingMessage) -> None:
            got.add(str(message.correlation_id))

        direct = await channel.declare_queue(keys.DIRECT_REPLY_TO, passive=True)
        await direct.consume(on_reply, no_ack=True)
        commands = await channel.get_exchange(keys.COMMANDS_EXCHANGE, ensure=False)
        wanted: set[str] = set()
        for n in range(15):
            unplaceable = n % 3 == 0
            if not unplaceable:
                wanted.add(f"c-{n}")
            await commands.publish(
                aio_pika.Message(
                    upsert(f"mixed-{n}"),
                    reply_to=token if unplaceable else keys.DIRECT_REPLY_TO,
                    correlation_id=f"c-{n}",
                ),
                routing_key="acme.upsert",
            )
        for _ in range(300):
            if wanted <= got:
                break
            await asyncio.sleep(0.1)
        assert wanted - got == set(), dispatcher.tails()
    assert await refused_count(dispatcher) == 5
