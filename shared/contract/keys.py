"""Every Redis key and RabbitMQ name cronbus uses, in one place (pure: no I/O).

Each shard's keys share the hash tag ``{s}`` so that a shard lives in one Redis Cluster slot
and every Lua script touches a single slot.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Final

DEFAULT_PREFIX: Final = "cronbus"

#: Separates a schedule's member from a trigger's fire time: ``ns/id#1767258000000``.
TRIGGER_SEPARATOR: Final = "#"


def member(namespace: str, schedule_id: str) -> str:
    """The index member of a schedule: ``namespace/id`` (neither part holds ``/`` or ``#``)."""
    return f"{namespace}/{schedule_id}"


#: What follows the separator in a schedule's backfill member: ``ns/id#b``.
BACKFILL_MARK: Final = "b"


def split_member(value: str) -> tuple[str, str, int | None]:
    """``ns/id``, ``ns/id#trigger_ms`` or ``ns/id#b`` -> (namespace, id, trigger_ms or None)."""
    base, _, trigger = value.partition(TRIGGER_SEPARATOR)
    namespace, _, schedule_id = base.partition("/")
    return namespace, schedule_id, int(trigger) if trigger and trigger != BACKFILL_MARK else None


def backfill_member(namespace: str, schedule_id: str) -> str:
    """The one index member that carries a schedule's backfill, one occurrence at a time."""
    return f"{member(namespace, schedule_id)}{TRIGGER_SEPARATOR}{BACKFILL_MARK}"


def is_backfill_member(value: str) -> bool:
    return value.endswith(TRIGGER_SEPARATOR + BACKFILL_MARK)


def trigger_member(namespace: str, schedule_id: str, fire_ms: int) -> str:
    return f"{member(namespace, schedule_id)}{TRIGGER_SEPARATOR}{fire_ms}"


def shard_of(namespace: str, schedule_id: str, shards: int) -> int:
    """Stable shard of a schedule: CRC-32 of ``namespace/id`` modulo the shard count.

    CRC-32 is stable across processes, versions and platforms (unlike ``hash()``), and fast.
    """
    return zlib.crc32(member(namespace, schedule_id).encode()) % shards


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key names under one prefix (tests and side-by-side installs use their own prefix)."""

    prefix: str = DEFAULT_PREFIX

    def due(self, shard: int) -> str:
        """ZSET member -> fire time (ms, jitter applied)."""
        return f"{self.prefix}:{{{shard}}}:due"

    def lease(self, shard: int) -> str:
        """ZSET member -> lease deadline (ms) of the occurrence in flight."""
        return f"{self.prefix}:{{{shard}}}:lease"

    def sched(self, shard: int) -> str:
        """HASH ``ns/id`` -> compact schedule."""
        return f"{self.prefix}:{{{shard}}}:sched"

    def occ(self, shard: int) -> str:
        """HASH member -> current occurrence ``nominal|attempt|token|fires[|flags]``."""
        return f"{self.prefix}:{{{shard}}}:occ"

    def fails(self, shard: int) -> str:
        """HASH ``ns/id`` -> consecutive occurrences ended dead (pause_after_failures only)."""
        return f"{self.prefix}:{{{shard}}}:fails"

    def rate(self, rate_key: str) -> tuple[str, str, str]:
        """(tat, hold, breaker) of a namespaced rate key: its GCRA slot, its Retry-After hold
        and its circuit breaker. All rate keys share one hash tag, so a batch is one call."""
        base = f"{self.prefix}:{{rate}}:"
        return (base + "tat:" + rate_key, base + "hold:" + rate_key, base + "brk:" + rate_key)

    def parked(self, shard: int) -> str:
        """ZSET rate key -> wake (ms): rate keys with occurrences of the shard parked behind
        them (``lua/park.lua``), and when to look at their gate again."""
        return f"{self.prefix}:{{{shard}}}:parked"

    def parked_rates(self, shard: int) -> str:
        """HASH rate key -> ``interval_ms|burst``: the limit of each parked rate key."""
        return f"{self.prefix}:{{{shard}}}:parkrate"

    def parked_marks(self, shard: int) -> str:
        """HASH member -> its parked deadline in due (ms): the occurrences of the shard parked
        behind some rate key, so that a write of their schedule releases them (upsert.lua)."""
        return f"{self.prefix}:{{{shard}}}:pkm"

    def parked_on_pattern(self, shard: int) -> str:
        """A SCAN pattern of every ``parked_on`` set of the shard."""
        return f"{self.prefix}:{{{shard}}}:pk:*"

    def parked_on(self, shard: int, rate_key: str) -> str:
        """ZSET member -> its parked deadline in due (ms): the occurrences of the shard parked
        behind one rate key."""
        return f"{self.prefix}:{{{shard}}}:pk:{rate_key}"

    def probed_pattern(self, shard: int) -> str:
        """A SCAN pattern of every ``probed`` set of the shard."""
        return f"{self.prefix}:{{{shard}}}:pq:*"

    def probed(self, shard: int, rate_key: str) -> str:
        """ZSET schedule (``ns/id``) -> its turn: when each schedule of the shard parked behind
        a rate key was last released as its probe (``lua/unpark.lua``): the next probe is one
        never the probe, else the one whose turn is the oldest."""
        return f"{self.prefix}:{{{shard}}}:pq:{rate_key}"

    def gone(self, shard: int) -> str:
        """HASH ``ns/id`` -> ``version|ms|kind``: tombstones of schedules deleted (``d``) or
        finished (``f``) at that version, so no write of an older one (a rebuild, a repair)
        brings them back, and a finished one is not restarted by a continuing write."""
        return f"{self.prefix}:{{{shard}}}:gone"

    def rebuild_witness(self, shard: int) -> str:
        """STRING: the running rebuild's token, set in every shard as it starts. Missing (or
        another's) when it ends, Redis lost data meanwhile: what it wrote before may be gone."""
        return f"{self.prefix}:{{{shard}}}:rebuilding"

    def backfill(self, shard: int) -> str:
        """HASH ``ns/id`` -> ``generation|to_ms|remaining|start|paused``: the schedule's running
        backfill (see ``lua/backfill.lua``); its current occurrence is the member ``ns/id#b``."""
        return f"{self.prefix}:{{{shard}}}:bf"

    def seq(self, shard: int) -> str:
        """STRING counter that mints fencing tokens."""
        return f"{self.prefix}:{{{shard}}}:seq"

    def position(self, shard: int) -> str:
        """STRING the shard's position: the last change of PostgreSQL (``index_positions``)
        whose writes the shard holds, every earlier one included (``lua/advance.lua``)."""
        return f"{self.prefix}:{{{shard}}}:pos"

    def ahead(self, shard: int) -> str:
        """ZSET positions of the shard applied past a gap (written out of order)."""
        return f"{self.prefix}:{{{shard}}}:ahead"

    def shard_owner(self, shard: int) -> str:
        """STRING dispatcher id holding the shard's claim lease (expires by itself)."""
        return f"{self.prefix}:{{{shard}}}:owner"

    def partition_owner(self, partition: int) -> str:
        """STRING dispatcher id holding the lease on a commands partition (expires by itself)."""
        return f"{self.prefix}:meta:partition:{partition}:owner"

    @property
    def dispatchers(self) -> str:
        """ZSET dispatcher id -> last heartbeat (ms): how many share the shards."""
        return f"{self.prefix}:meta:dispatchers"

    @property
    def epoch(self) -> str:
        """STRING set when the index is complete; missing means Redis lost data."""
        return f"{self.prefix}:meta:epoch"

    @property
    def database(self) -> str:
        """STRING ``<system identifier>/<database name>`` of the PostgreSQL database the index
        belongs to: an index of another database is never fired."""
        return f"{self.prefix}:meta:database"

    @property
    def rebuild_lock(self) -> str:
        return f"{self.prefix}:meta:rebuild-lock"

    @property
    def sweep_lock(self) -> str:
        return f"{self.prefix}:meta:sweep-lock"

    @property
    def wake_channel(self) -> str:
        """Pub/sub channel: a schedule came due sooner than dispatchers may be sleeping."""
        return f"{self.prefix}:wake"

    def shard_keys(self, shard: int) -> tuple[str, str, str, str, str]:
        """(due, lease, occ, sched, seq): the KEYS every shard script takes, in this order."""
        return (
            self.due(shard),
            self.lease(shard),
            self.occ(shard),
            self.sched(shard),
            self.seq(shard),
        )


# RabbitMQ names (the first three are the pinned public contract).
COMMANDS_EXCHANGE: Final = "cronbus.commands"
COMMANDS_QUEUE: Final = "cronbus.commands"
EVENTS_EXCHANGE: Final = "cronbus.events"
DELIVERIES_EXCHANGE: Final = "cronbus.deliveries"
DELIVERIES_QUEUE: Final = "cronbus.deliveries"
DEAD_LETTER_EXCHANGE: Final = "cronbus.dead"
#: Commands routed to their partitions (direct, routing key = the partition's number).
PARTITIONS_EXCHANGE: Final = "cronbus.commands.partitions"
#: Declared exclusive by the dispatcher that routes ``cronbus.commands`` to the partitions: the
#: broker lets one connection hold it, and drops it with that connection.
ROUTER_LOCK_QUEUE: Final = "cronbus.commands.router"
#: On a routed command: what the broker told the router and a republish cannot carry as is
#: (the routing key is the partition's; ``user_id`` must be the publisher's own; a message id
#: absent stays absent).
ROUTED_KEY_HEADER: Final = "x-cronbus-routing-key"
ROUTED_USER_HEADER: Final = "x-cronbus-user-id"
ROUTED_MESSAGE_ID_HEADER: Final = "x-cronbus-message-id"
#: The properties of a routed command that were not UTF-8 (comma-separated names): republished
#: readable (U+FFFD), the intake still refuses them by name.
ROUTED_UNDECODABLE_HEADER: Final = "x-cronbus-undecodable-properties"
#: Header carrying why a message went to a dead-letter queue.
DEAD_REASON_HEADER: Final = "x-cronbus-error"
#: Names a user-supplied exchange may not start with: cronbus's own and the broker's.
RESERVED_EXCHANGE_PREFIXES: Final = ("cronbus.", "amq.")


def dead_letter_queue(queue: str) -> str:
    """The dead-letter queue of ``queue``: ``cronbus.commands`` -> ``cronbus.commands.dead``."""
    return f"{queue}.dead"


def partition_queue(partition: int) -> str:
    """``cronbus.commands.p<k>``: one of the command partitions (docs/scaling.md)."""
    return f"{COMMANDS_QUEUE}.p{partition}"


def quorum_queue_arguments(queue: str, *, delivery_limit: int | None = None) -> dict[str, Any]:
    """Arguments of a quorum queue whose rejected (or over-delivered) messages go to its DLQ."""
    arguments: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
        "x-dead-letter-routing-key": dead_letter_queue(queue),
    }
    if delivery_limit is not None:
        arguments["x-delivery-limit"] = delivery_limit
    return arguments


#: Reply queues that need no check: RabbitMQ's direct reply-to (the broker rewrites it to
#: ``amq.rabbitmq.reply-to.<token>``) and a queue the broker named (``amq.gen-<random>``).
#: Any other name is answered only if exclusive (``shared.policy.replies``).
DIRECT_REPLY_TO: Final = "amq.rabbitmq.reply-to"
SERVER_NAMED_PREFIX: Final = "amq.gen-"


def command_routing_key(namespace: str, verb: str) -> str:
    return f"{namespace}.{verb}"


def event_routing_key(namespace: str, outcome: str) -> str:
    return f"{namespace}.{outcome}"
