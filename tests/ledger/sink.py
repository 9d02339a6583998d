"""The ledger's sinks: targets of several behaviours on two local HTTP servers, every request kept.

Two hosts, so two rate keys (and two circuit breakers) per namespace: the *main* host, where
most targets live, and the *other* host, which the ``host-down`` fault stops for a while.
The first path segment picks the behaviour of a target:

- ``/fast/<id>``: 200 at once;
- ``/slow/<id>``: 200 after ``SLOW_S`` (deliveries are in flight long enough to overlap);
- ``/burst/<id>``: 200 after ``BURST_S`` (an overload keeps the executors' slots full);
- ``/e404/<id>``: 404 every time (a missing path beside healthy ones on the same host: each
  occurrence ends dead after its attempts, and the breaker must not hold its neighbours);
- ``/flaky<N>/<id>``: 503 for attempts 1..N of an occurrence, then 200;
- ``/ra/<id>``: while the ``retry-after-429`` fault lasts, 429 with ``Retry-After:
  RETRY_AFTER_S`` (the whole host's rate key is held), else 200.

Each request is recorded with its headers (``Idempotency-Key``, ``X-Cronbus-Schedule``,
``X-Cronbus-Fire-Time``, ``X-Cronbus-Attempt``, ``X-Cronbus-Trigger``), when it arrived, the
status answered and when the answer went out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cronbus.cli.sink import Received, Sink
from shared.contract import timefmt
from tests.ledger import oracle

SLOW_S = 1.2
BURST_S = 0.5
RETRY_AFTER_S = 2
DELAYS = {"slow": SLOW_S, "burst": BURST_S}


def behaviour_of(path: str) -> str:
    return path.lstrip("/").partition("/")[0]


@dataclass
class Sinks:
    """The main host and the other one; the ``ra`` targets answer 429 while ``throttling``."""

    main: Sink = field(init=False)
    other: Sink = field(init=False)
    throttling: bool = False

    def __post_init__(self) -> None:
        self.main = self._sink()
        self.other = self._sink()

    def _sink(self) -> Sink:
        return Sink(
            respond=self.status_for,
            delay_for=delay_for,
            headers_by_status={429: {"Retry-After": str(RETRY_AFTER_S)}},
        )

    def status_for(self, request: Received) -> int:
        behaviour = behaviour_of(request.path)
        if behaviour == "e404":
            return 404
        if behaviour == "ra":
            return 429 if self.throttling else 200
        if behaviour.startswith("flaky"):
            failures = int(behaviour.removeprefix("flaky") or 1)
            return 503 if request.attempt <= failures else 200
        return 200

    async def start(self) -> None:
        await self.main.start()
        await self.other.start()

    async def stop(self) -> None:
        await self.main.stop()
        await self.other.stop()

    async def other_down(self) -> None:
        """The other host stops answering: connections to it are refused."""
        await self.other.stop()

    async def other_up(self) -> None:
        received = self.other.received
        await self.other.start(port=self.other.port)
        self.other.received = received

    @property
    def other_scope(self) -> str:
        """The URL prefix of the other host's targets (a fault on it is scoped to them)."""
        return f"{self.other.url}/"

    def requests(self) -> list[oracle.Request]:
        return requests(self.main) + requests(self.other)


def delay_for(request: Received) -> float:
    return DELAYS.get(behaviour_of(request.path), 0.0)


def ledger_sink() -> Sink:
    """One host of the main behaviours (the herds)."""
    return Sinks().main


def as_request(received: Received) -> oracle.Request | None:
    """The oracle's view of one request (None: not a cronbus delivery)."""
    if not received.schedule or not received.fire_time:
        return None
    return oracle.Request(
        schedule=received.schedule,
        key=received.key,
        fire_time_ms=timefmt.parse_rfc3339_ms(received.fire_time),
        attempt=received.attempt,
        trigger=received.headers.get("x-cronbus-trigger", "") == "manual",
        arrived_ms=received.at_ms,
        # Not answered yet: still in flight at the end of the run.
        answered_ms=received.answered_ms or received.at_ms + 60_000,
        status=received.status,
    )


def requests(sink: Sink) -> list[oracle.Request]:
    found = [as_request(r) for r in list(sink.received)]
    return [r for r in found if r is not None]
