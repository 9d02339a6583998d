"""The ledger's sink: targets of several behaviours on one local HTTP server, every request kept.

The first path segment picks the behaviour of a target:

- ``/fast/<id>``: 200 at once;
- ``/slow/<id>``: 200 after ``SLOW_S`` (deliveries are in flight long enough to overlap);
- ``/burst/<id>``: 200 after ``BURST_S`` (an overload keeps the executors' slots full);
- ``/err/<id>``: 503 every time (each occurrence ends dead after its attempts);
- ``/flaky<N>/<id>``: 503 for attempts 1..N of an occurrence, then 200.

Each request is recorded with its headers (``Idempotency-Key``, ``X-Cronbus-Schedule``,
``X-Cronbus-Fire-Time``, ``X-Cronbus-Attempt``, ``X-Cronbus-Trigger``), when it arrived, the
status answered and when the answer went out.
"""

from __future__ import annotations

from cronbus.cli.sink import Received, Sink
from shared.contract import timefmt
from tests.ledger import oracle

SLOW_S = 1.2
BURST_S = 0.5
DELAYS = {"slow": SLOW_S, "burst": BURST_S}


def behaviour_of(path: str) -> str:
    return path.lstrip("/").partition("/")[0]


def status_for(request: Received) -> int:
    behaviour = behaviour_of(request.path)
    if behaviour == "err":
        return 503
    if behaviour.startswith("flaky"):
        failures = int(behaviour.removeprefix("flaky") or 1)
        return 503 if request.attempt <= failures else 200
    return 200


def delay_for(request: Received) -> float:
    return DELAYS.get(behaviour_of(request.path), 0.0)


def ledger_sink() -> Sink:
    return Sink(respond=status_for, delay_for=delay_for)


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
