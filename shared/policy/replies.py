"""Where a reply may go (pure): the shape of a ``reply_to``, the broker's word on a queue, and
how long that word is kept.

A reply is a publish cronbus makes with its own credentials into the queue a command names, so
a command could make cronbus write into another tenant's queue. As pinned in the design, a
reply goes only to:

- RabbitMQ's direct reply-to, ``amq.rabbitmq.reply-to`` (the broker rewrites it to a token
  ``amq.rabbitmq.reply-to.<pid>[.<key>]`` naming the sender's channel). A token cronbus did
  not get from the broker is checked for the broker's shape first: publishing to a crafted one
  (``amq.rabbitmq.reply-to.a.b``) makes RabbitMQ close the publishing connection.
- A server-named queue, ``amq.gen-<random>``: nobody can guess the name of another's.
- Any other queue that is exclusive to a connection: only the connection that declared it can
  consume from it, so a reply can land only with whoever declared that queue for themselves
  (aio-pika's robust connection names its own exclusive queues ``amq_<hex>``). The broker
  says so: a passive declare from another connection is refused with RESOURCE_LOCKED (405).
  Not found (404), or declared (a queue anyone may consume, such as a durable shared one),
  is refused: cronbus answers nothing there.

The broker's word is kept per queue name for a short time (``VerdictCache``), so a client
sending many commands costs one check, not one per command.
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from pamqp.constants import DOMAIN_REGEX

from shared.contract import keys

#: The queue names an AMQP client (pamqp, under aio-pika) can declare: cronbus checks a
#: queue with a passive declare, so a name outside these characters cannot be checked.
QUEUE_NAME_CHARACTERS: Final = "letters, digits and - _ . : @ # , / + or space"

#: How long the broker's word on a queue is kept: an answerable queue stays so while its
#: connection lives (10 s of it is little risk); a refused name may be declared a moment later.
ANSWER_TTL_S: Final = 10.0
REFUSE_TTL_S: Final = 2.0
#: The most queue names kept (the least recently used go first).
MAX_CACHED: Final = 10_000
#: RabbitMQ's limit on a queue name (a short string).
MAX_NAME_BYTES: Final = 255
#: What the broker accepts for a direct reply-to token's key (it makes 16 random bytes).
MAX_KEY_BYTES: Final = 64


class Route(enum.Enum):
    """How a ``reply_to`` is answered."""

    #: RabbitMQ's direct reply-to (the bare name or a token of the broker's shape).
    DIRECT = "direct"
    #: A queue the broker named (``amq.gen-*``).
    SERVER_NAMED = "server_named"
    #: Any other name: answered only if the broker says the queue is exclusive.
    CHECK = "check"
    #: Never answered (the reason says why).
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class Shape:
    route: Route
    reason: str = ""


class BrokerAnswer(enum.Enum):
    """What the broker answered a passive declare of the queue from cronbus's own connection."""

    #: RESOURCE_LOCKED (405): the queue is exclusive to another connection.
    LOCKED = "locked"
    #: NOT_FOUND (404): no such queue (yet, or any more).
    NOT_FOUND = "not_found"
    #: DeclareOk: the queue exists and is not exclusive: anyone allowed may consume it.
    DECLARED = "declared"
    #: ACCESS_REFUSED (403) or any other refusal: nothing is known, nothing is answered.
    OTHER = "other"


# Asked several times per command, and clients answer on few queues: judged once per name.
# Bounded: 1024 names of at most a short string's 255 bytes (AMQP's limit on reply_to).
@functools.lru_cache(maxsize=1024)
def shape_of(reply_to: str) -> Shape:
    """Which route a ``reply_to`` takes, from its name alone."""
    if reply_to == keys.DIRECT_REPLY_TO:
        return Shape(Route.DIRECT)
    if reply_to.startswith(keys.DIRECT_REPLY_TO + "."):
        if direct_token_valid(reply_to.removeprefix(keys.DIRECT_REPLY_TO + ".")):
            return Shape(Route.DIRECT)
        return Shape(Route.REFUSED, "is not a direct reply-to token the broker made")
    problem = name_problem(reply_to)
    if problem:
        return Shape(Route.REFUSED, problem)
    if reply_to.startswith(keys.SERVER_NAMED_PREFIX) and len(reply_to) > len(
        keys.SERVER_NAMED_PREFIX
    ):
        return Shape(Route.SERVER_NAMED)
    return Shape(Route.CHECK)


def name_problem(name: str) -> str:
    """Why ``name`` cannot be a queue's name ("" when it can)."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "must not contain control characters"
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        return "is not UTF-8"
    if size > MAX_NAME_BYTES:
        return f"is longer than {MAX_NAME_BYTES} bytes"
    if not DOMAIN_REGEX["queue-name"].fullmatch(name):
        return f"may hold only {QUEUE_NAME_CHARACTERS}"
    return ""


def refusal_reason(reply_to: str, detail: str) -> str:
    """The reason a refused ``reply_to`` is dead-lettered with."""
    return (
        f"reply_to {reply_to[:MAX_NAME_BYTES]!r} {detail}: replies go only to "
        "amq.rabbitmq.reply-to, a server-named amq.gen-* queue or a queue exclusive to the "
        "sender's connection"
    )


def verdict_of(answer: BrokerAnswer) -> tuple[bool, str]:
    """(answer it?, why not) from the broker's answer to the passive declare."""
    if answer is BrokerAnswer.LOCKED:
        return True, ""
    if answer is BrokerAnswer.NOT_FOUND:
        return False, "names no queue"
    if answer is BrokerAnswer.DECLARED:
        return False, "names a queue that is not exclusive (others may consume it)"
    return False, "names a queue the broker would not tell about"


# --- direct reply-to tokens -------------------------------------------------------------------

#: The Erlang external term format: its version byte, the two pid tags and the atom tags with
#: the size of their length field.
_TERM_VERSION: Final = 131
_NEW_PID_EXT: Final = ord("X")  # node, then ID, Serial and Creation, 4 bytes each
_PID_EXT: Final = ord("g")  # node, then ID and Serial (4 bytes each), Creation (1 byte)
_ATOM_LENGTH_BYTES: Final = {ord("d"): 2, ord("v"): 2, ord("s"): 1, ord("w"): 1}
_PID_TAIL_BYTES: Final = {_NEW_PID_EXT: 12, _PID_EXT: 9}


def direct_token_valid(token: str) -> bool:
    """Whether ``token`` (after ``amq.rabbitmq.reply-to.``) has the shape the broker gives:
    the base64 of an Erlang pid, then optionally ``.`` and the base64 of a key.

    RabbitMQ decodes the token itself when a reply is published to it, and a token it cannot
    decode closes the publishing connection; this refuses what would not decode. A well-formed
    pid on a node the broker does not know is not caught here: answers to direct reply-to
    go out on a connection of their own, so that costs the replies a reconnect, not the intake.
    """
    pid_part, dot, key_part = token.partition(".")
    pid = _base64(pid_part)
    if pid is None or not _is_pid_term(pid):
        return False
    if not dot or not key_part:
        return True
    key = _base64(key_part)
    return key is not None and 0 < len(key) <= MAX_KEY_BYTES


def _base64(text: str) -> bytes | None:
    if not text.isascii():
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _is_pid_term(term: bytes) -> bool:
    """Exactly one pid in the external term format, nothing before or after it."""
    if len(term) < 4 or term[0] != _TERM_VERSION or term[1] not in _PID_TAIL_BYTES:
        return False
    length_bytes = _ATOM_LENGTH_BYTES.get(term[2])
    if length_bytes is None:
        return False
    start = 3 + length_bytes
    if len(term) < start:
        return False
    length = term[3] if length_bytes == 1 else struct.unpack(">H", term[3:5])[0]
    node = term[start : start + length]
    if len(node) != length or b"@" not in node.strip(b"@"):
        return False
    return len(term) == start + length + _PID_TAIL_BYTES[term[1]]


# --- the broker's word, kept a while ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    answer: bool
    reason: str
    until_s: float


class VerdictCache:
    """The broker's word per queue name, for ``ANSWER_TTL_S`` or ``REFUSE_TTL_S``; at most
    ``MAX_CACHED`` names, the least recently used dropped first. The clock comes in."""

    def __init__(
        self,
        max_names: int = MAX_CACHED,
        answer_ttl_s: float = ANSWER_TTL_S,
        refuse_ttl_s: float = REFUSE_TTL_S,
    ) -> None:
        self.max_names = max_names
        self.answer_ttl_s = answer_ttl_s
        self.refuse_ttl_s = refuse_ttl_s
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()

    def __len__(self) -> int:
        return len(self._verdicts)

    def get(self, name: str, now_s: float) -> Verdict | None:
        """The verdict on ``name`` if it is still fresh."""
        verdict = self._verdicts.get(name)
        if verdict is None:
            return None
        if now_s >= verdict.until_s:
            del self._verdicts[name]
            return None
        self._verdicts.move_to_end(name)
        return verdict

    def put(self, name: str, answer: bool, reason: str, now_s: float) -> Verdict:
        ttl = self.answer_ttl_s if answer else self.refuse_ttl_s
        verdict = Verdict(answer, reason, now_s + ttl)
        self._verdicts[name] = verdict
        self._verdicts.move_to_end(name)
        while len(self._verdicts) > self.max_names:
            self._verdicts.popitem(last=False)
        return verdict
