"""Probes go round the schedules of a rate key (issue 34): one path of a host answering 503
forever must not take every probe of the host's breaker while nine healthy paths of the same
host (one rate key) wait behind it.

The host first fails everything: the breaker opens and all ten are parked behind it. The host
recovers, except the failing path, just as that path takes a probe (it is first in the parked
order: its safety offset, a hash of its schedule, is the lowest of the ten, as it would be for
one schedule in ten). The next probe, one cooldown later, must be a healthy schedule's: it
closes the breaker and every healthy schedule is delivered within one cooldown of the
recovery. Before, the failing path was parked again a cooldown later, still first by its
offset (up to 180 s ahead at the default CRONBUS_PARK_SAFETY_S), and took the next probes
too: the healthy ones waited for as many cooldowns."""

from __future__ import annotations

import time

from cronbus.cli.sink import Received, Sink
from shared.contract import keys, timefmt
from shared.policy.holds import SAFETY_MS, safety_ms_of
from tests.e2e.test_operations import webhook
from tests.e2e.test_parked import SHARDS, parked_now, until
from tests.support import services
from tests.support.commands import CommandClient
from tests.support.stack import Stack

COOLDOWN_S = 5
#: On top of the cooldown: the look, the probe's delivery, the release of the rest and their
#: deliveries, on a loaded 2-core machine. Before the fix the next healthy probe came many
#: cooldowns later (the failing path's offset is more than 100 s ahead of the others').
SLACK_S = 10
ENV = {
    "CRONBUS_BREAKER_FAILURES": "3",
    "CRONBUS_BREAKER_COOLDOWN_S": str(COOLDOWN_S),
}
HEALTHY = 9


def ten_schedules_of_one_shard() -> tuple[str, list[str]]:
    """The failing schedule's id and nine healthy ones, all in one shard (so the parked order
    alone decides the probe), the failing one first in that order by more than 100 s."""
    in_shard = [f"path{i}" for i in range(400) if keys.shard_of("acme", f"path{i}", SHARDS) == 0]
    by_offset = sorted(in_shard, key=lambda s: safety_ms_of(keys.member("acme", s), SAFETY_MS))
    failing, healthy = by_offset[0], by_offset[-HEALTHY:]
    gap = safety_ms_of(keys.member("acme", healthy[0]), SAFETY_MS) - safety_ms_of(
        keys.member("acme", failing), SAFETY_MS
    )
    assert gap > 100_000, gap
    return failing, healthy


class Host:
    """The sink's answers: every path 503 until the host recovers, the failing path 503
    forever. Once armed (all ten parked behind the open breaker), the failing path's next
    request is its probe: the host recovers then."""

    def __init__(self, failing_path: str) -> None:
        self.failing_path = failing_path
        self.armed = False
        self.recovered_at_ms: float | None = None

    def __call__(self, request: Received) -> int:
        if request.path == self.failing_path:
            if self.armed and self.recovered_at_ms is None:
                self.recovered_at_ms = request.at_ms
            return 503
        return 503 if self.recovered_at_ms is None else 200


async def test_one_failing_path_does_not_starve_the_healthy_paths_of_its_host(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
) -> None:
    failing, healthy = ten_schedules_of_one_shard()
    host = Host(f"/{failing}")
    sink.respond = host
    await stack.start_all(("dispatcher", "executor", "sweeper"), **ENV)
    due_ms = (int(time.time()) + 2) * 1000
    schedules = [
        {
            "id": schedule_id,
            "spec": {"kind": "once", "at": timefmt.format_ms(due_ms)},
            "target": webhook(sink, f"/{schedule_id}"),  # one host: one rate key
            "retry": {"max_attempts": 20, "initial_backoff_s": 0.2, "full_jitter": False},
        }
        for schedule_id in [failing, *healthy]
    ]
    reply = await client.send("acme", "upsert_many", {"schedules": schedules})
    assert reply["ok"] and all(r["ok"] for r in reply["results"]), reply

    async def all_parked() -> bool:
        return await parked_now(endpoints.redis_url, redis_prefix) >= 1 + HEALTHY

    assert await until(all_parked, 30), stack.tails()
    host.armed = True
    assert await sink.wait_for(lambda _: host.recovered_at_ms is not None, 4 * COOLDOWN_S), (
        "the failing path's probe never came",
        stack.tails(),
    )
    recovered_at = host.recovered_at_ms
    assert recovered_at is not None
    wanted = {f"acme/{s}" for s in healthy}

    def healthy_delivered(s: Sink) -> bool:
        return wanted <= {r.schedule for r in s.received if r.status == 200}

    await sink.wait_for(healthy_delivered, COOLDOWN_S + SLACK_S + 2)
    first_ok: dict[str, float] = {}
    for r in sink.received:
        if r.status == 200:
            first_ok.setdefault(r.schedule, r.at_ms - recovered_at)
    print("healthy delivered after the recovery (ms):", sorted(round(v) for v in first_ok.values()))
    after = [(r.path, r.status) for r in sink.received if r.at_ms > recovered_at]
    assert set(first_ok) == wanted, (sorted(first_ok), after[:5], stack.tails())
    assert max(first_ok.values()) <= (COOLDOWN_S + SLACK_S) * 1000, first_ok
    # The probe after the failing path's was a healthy path's, not the failing path's again.
    assert after[0][0] != f"/{failing}", after[:5]
