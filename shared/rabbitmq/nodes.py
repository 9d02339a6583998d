"""Connections to a RabbitMQ cluster given as several URLs: one node at a time, the next one
when it is lost.

Where to try next is pure (``NodeRing``); the connection is aio-pika's robust connection with
the node it dials taken from the ring, so every channel, consumer and declaration it restores
after a loss is restored on the next node.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import aio_pika
import aiormq
from yarl import URL

from shared.contract import urls

log = logging.getLogger(__name__)

#: Waits after a whole round of nodes failed, then the last one again and again.
BACKOFF_S = (0.5, 1.0, 2.0)
#: Seconds of silence after which a node is taken for lost (RabbitMQ's own default is 60: a
#: node cut off without a reset would hold a service for minutes).
HEARTBEAT_S = 10


class NodeRing:
    """The nodes in a ring, entered at a random place (so services spread over the cluster),
    each failure moving on to the next; a wait only after a whole round failed."""

    def __init__(self, nodes: Sequence[str], start: int | None = None) -> None:
        if not nodes:
            raise ValueError("no node")
        self.nodes = tuple(nodes)
        self.index = random.randrange(len(self.nodes)) if start is None else start % len(nodes)
        self.failures = 0

    @property
    def current(self) -> str:
        return self.nodes[self.index]

    def failed(self) -> float:
        """Move past the current node; how long to wait before dialling the next."""
        self.failures += 1
        self.index = (self.index + 1) % len(self.nodes)
        rounds, within = divmod(self.failures, len(self.nodes))
        if within or not rounds:
            return 0.0
        return BACKOFF_S[min(rounds, len(BACKOFF_S)) - 1]

    def connected(self) -> None:
        self.failures = 0

    def in_order(self) -> list[str]:
        """Every node once, from the current one."""
        return [self.nodes[(self.index + i) % len(self.nodes)] for i in range(len(self.nodes))]


def with_heartbeat(url: str, seconds: int = HEARTBEAT_S) -> str:
    """``url`` asking for a heartbeat every ``seconds``, unless it names its own."""
    parts = urlsplit(url)
    if any(key == "heartbeat" for key, _ in parse_qsl(parts.query)):
        return url
    query = f"{parts.query}&heartbeat={seconds}" if parts.query else f"heartbeat={seconds}"
    return urlunsplit(parts._replace(query=query))


class FailoverConnection(aio_pika.RobustConnection):
    """aio-pika's robust connection, dialling the ring's current node at every attempt.

    aio-pika reads ``url`` once per dial, calls ``_on_connection_close`` when a connection
    (or a dial) ends, and reads ``reconnect_interval`` after each attempt, sometimes twice:
    the ring moves at most once per dial, whichever of those notices the failure first."""

    ring: NodeRing

    def __init__(self, ring: NodeRing, **kwargs: Any) -> None:
        self.ring = ring
        self._dials = 0
        self._moved_at = -1
        self._wait = 0.0
        #: Until ``connect`` has one node, its caller reports why none answered: a move
        #: during those first dials is no news to an operator (the CLI prints one line).
        self.established = False
        super().__init__(URL(ring.current), **kwargs)

    def __str__(self) -> str:
        return urls.masked(self.ring.current)

    @property
    def url(self) -> URL:
        self._dials += 1
        return URL(self.ring.current)

    @url.setter
    def url(self, value: URL) -> None:
        pass  # the ring says where to dial

    def _move_on(self, why: str) -> None:
        if self._moved_at == self._dials:
            return
        self._moved_at = self._dials
        left = urls.host_port(self.ring.current)
        self._wait = self.ring.failed()
        log.log(
            logging.WARNING if self.established else logging.DEBUG,
            "RabbitMQ node lost or unreachable, moving to the next",
            extra={
                "action": "amqp_node_next",
                "why": why,
                "node": left,
                "next": urls.host_port(self.ring.current),
                "wait_s": self._wait,
            },
        )

    @property
    def reconnect_interval(self) -> float:
        if self.connected.is_set():
            self.ring.connected()
            return 0.0
        self._move_on("dial failed")
        return self._wait

    @reconnect_interval.setter
    def reconnect_interval(self, value: float) -> None:
        pass  # the ring's backoff decides

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        if not self._close_called:
            self._move_on("connection closed")
        await super()._on_connection_close(closing)


async def connect(
    setting: str, name: str, *, connect_timeout_s: float = 10, start: int | None = None
) -> FailoverConnection:
    """A robust connection to one of the nodes ``setting`` lists (one URL, or several separated
    by commas), named so operators can tell who is who.

    Each node is tried once, from a random one; the last error is raised when none answers
    (the caller's retry waits), at once when a node refuses the login or the virtual host (the
    others share them).
    """
    ring = NodeRing([with_heartbeat(url) for url in urls.amqp_urls(setting)], start)
    error: BaseException | None = None
    for _ in ring.nodes:
        tried = ring.current
        connection = FailoverConnection(ring, client_properties={"connection_name": name})
        try:
            await connection.connect(timeout=connect_timeout_s)
        except Exception as exc:
            await connection.close()
            if _refused(exc):
                raise
            error = exc
            if ring.current == tried:  # the connection's own close may have moved it already
                ring.failed()
            continue
        ring.connected()
        connection.established = True
        return connection
    assert error is not None
    raise error


async def connect_plain(
    setting: str, name: str, *, connect_timeout_s: float = 10
) -> aiormq.Connection:
    """A plain (not robust) connection to the first node of ``setting`` that answers, from a
    random one: for a holder that must notice the loss itself (the router's lock)."""
    ring = NodeRing([with_heartbeat(url) for url in urls.amqp_urls(setting)])
    error: BaseException | None = None
    for url in ring.in_order():
        try:
            connection = await asyncio.wait_for(
                aiormq.connect(url, client_properties={"connection_name": name}),
                connect_timeout_s,
            )
        except (OSError, TimeoutError, aiormq.exceptions.AMQPConnectionError) as exc:
            error = exc
            continue
        return connection
    assert error is not None
    raise error


#: What a node answers that the others would answer too (they share users and virtual hosts).
_REFUSALS = (
    aiormq.exceptions.ProbableAuthenticationError,
    aiormq.exceptions.AuthenticationError,
    aiormq.exceptions.ConnectionNotAllowed,
)


def _refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if isinstance(seen, _REFUSALS):
            return True
        if isinstance(seen, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in str(
            seen
        ):
            return True  # a virtual host the user may not open (see transient.refusal)
        seen = seen.__cause__ or seen.__context__
    return False
