"""The ledger: every policy keeps its promise under every fault, proven end to end.

A seeded mix of schedules (every spec kind, every misfire policy, jitter above the grace,
windows, counts, retries, targets fast, slow, failing and flaky) fires into a recording sink
while commands (pause, resume, trigger, delete, resets) and faults (kill -9 of each service,
broker restart, Redis flushed, Redis restarted from an old snapshot, PostgreSQL restarted,
triggers accepted with no executor and then Redis flushed, 429s with Retry-After, a second
host down for a while, an overload burst) take turns, with the circuit breaker in reach (two
hosts, one with paths answering 404 beside healthy ones). The
oracle (tests/ledger/oracle.py) judges what arrived. Then a no-fault herd of each spec kind
must arrive without a single duplicate.

Profile: ``CRONBUS_TEST_LEDGER_MINUTES`` (0, the default: the short CI profile, one pass of
every fault), ``CRONBUS_TEST_LEDGER_SEED``, ``CRONBUS_TEST_LEDGER_REPORT`` (the JSON report;
default ``ledger-report.json`` in the test's temporary directory). ``scripts/ledger`` sets
them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cronbus.cli.sink import Sink
from shared.policy import netpolicy
from tests.ledger import report, run
from tests.ledger import sink as ledger_sink
from tests.support import private, services
from tests.support.stack import Stack

MINUTES = float(os.environ.get("CRONBUS_TEST_LEDGER_MINUTES", "0") or 0)
SEED = int(os.environ.get("CRONBUS_TEST_LEDGER_SEED", "") or 0) or int.from_bytes(os.urandom(2))
PROFILE = run.profile(MINUTES, SEED)

# The long profile ends its last pass of every fault (about four minutes) after the deadline,
# then drains up to three minutes; a loaded machine stretches every step.
pytestmark = [pytest.mark.ledger, pytest.mark.timeout(int(MINUTES * 60) + 900)]


@pytest.fixture(scope="module")
def servers() -> Iterator[private.PrivateServices]:
    reason = private.available()
    if reason:
        pytest.fail(f"the ledger needs private servers: {reason}")
    with private.private_services() as found:
        yield found


@pytest.fixture
def env(servers: private.PrivateServices) -> dict[str, str]:
    vhost = services.unique("ledger-")
    servers.rabbit.add_vhost(vhost)
    return {
        "CRONBUS_REDIS_URL": servers.redis.url,
        "CRONBUS_REDIS_PREFIX": services.unique("ledger"),
        # Long profile: the one node under two names, a list of two as a cluster's would be
        # (the rabbitmq-node-failover fault makes every service move to the other).
        "CRONBUS_AMQP_URL": ",".join(
            services.with_vhost(url, vhost)
            for url in (servers.rabbit.urls_of_one_node if MINUTES > 0 else [servers.rabbit.url])
        ),
        "CRONBUS_DATABASE_URL": services.with_database(
            servers.postgres.url, services.unique("ledger_")
        ),
        "CRONBUS_SHARDS": "4",
        "CRONBUS_LEASE_S": "3",
        "CRONBUS_SWEEP_INTERVAL_S": "1",
        "CRONBUS_SHUTDOWN_GRACE_S": "5",
        # Frequent drift checks: drift repair must never touch an occurrence in flight.
        "CRONBUS_DRIFT_CHECK_INTERVAL_S": "1",
        "CRONBUS_EVENTS": "failures",
        # The breaker in reach: a few attempts that say a host is unhealthy (the other host
        # down, 429s, flaky 503s) open it, and a short cooldown lets a run see it open, hold,
        # probe and close many times. Held is delayed, never lost; a 404 (the e404 targets
        # beside healthy ones on the main host) must never open it.
        "CRONBUS_BREAKER_FAILURES": "5",
        "CRONBUS_BREAKER_COOLDOWN_S": "4",
        "CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS,
        "CRONBUS_LOG_LEVEL": "INFO",
    }


@pytest.fixture
def stack(env: dict[str, str], tmp_path: Path) -> Iterator[Stack]:
    found = Stack(env, tmp_path)
    yield found
    found.stop_all()


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    found = ledger_sink.ledger_sink()
    await found.start()
    yield found
    await found.stop()


@pytest.fixture
async def sinks() -> AsyncIterator[ledger_sink.Sinks]:
    found = ledger_sink.Sinks()
    await found.start()
    yield found
    await found.stop()


@pytest.fixture
def report_path(tmp_path: Path) -> Path:
    configured = os.environ.get("CRONBUS_TEST_LEDGER_REPORT")
    return Path(configured) if configured else tmp_path / "ledger-report.json"


async def start_services(stack: Stack) -> None:
    await stack.start_all(("dispatcher", "sweeper"))
    for _ in range(2):
        await stack.wait_ready(stack.start("executor"))


async def test_herd_of_each_kind_has_no_duplicates(
    stack: Stack, sink: Sink, env: dict[str, str], report_path: Path
) -> None:
    """Issue 15: with no fault at all, a herd of each spec kind (once, interval, cron,
    after_completion, and triggers) is delivered once per occurrence."""
    await start_services(stack)
    verdict = await run.herd(env, sink, PROFILE.herd_per_kind, stack.logs)
    table = report.table(f"ledger herd ({PROFILE.herd_per_kind} per kind)", verdict)
    print("\n" + table)
    report.write_json(report_path, "herd", report.section(verdict, per_kind=PROFILE.herd_per_kind))
    assert verdict.total("lost") == 0, verdict.findings[:20]
    assert verdict.total("duplicates") == 0, table
    assert verdict.total("bad_keys") == 0, table


async def test_every_policy_keeps_its_promise_under_every_fault(
    stack: Stack,
    sinks: ledger_sink.Sinks,
    env: dict[str, str],
    servers: private.PrivateServices,
    report_path: Path,
) -> None:
    # Fewer delivery slots than the overload burst needs: occurrences wait for a slot longer
    # than their lease (the lease must be re-checked when the delivery starts).
    stack.env["CRONBUS_CONCURRENCY"] = "64"
    await start_services(stack)
    ledger = run.Ledger(stack, servers, env, sinks, PROFILE)
    verdict = await ledger.run()
    breakers = ledger.breaker_transitions()
    title = (
        f"ledger mix: seed {PROFILE.seed}, {len(ledger.items)} schedules "
        f"(+{len(ledger.timelines) - len(ledger.items)} one-shots of the overload), "
        f"faults {len(ledger.applied)}, commands {ledger.commands}, breakers {breakers}"
    )
    print("\n" + report.table(title, verdict))
    for line in verdict.findings[:40]:
        print("  " + line)
    report.write_json(
        report_path,
        "mix",
        report.section(
            verdict,
            seed=PROFILE.seed,
            minutes=PROFILE.minutes,
            commands=ledger.commands,
            breakers=breakers,
            excluded=ledger.excluded,
            faults=[[f.name, f.start_ms, f.end_ms] for f in ledger.applied],
            history=ledger.history(),
            requests=[dataclasses.asdict(r) for r in sinks.requests()],
        ),
    )
    print(f"report: {report_path}")
    assert not ledger.excluded, ledger.excluded
    # The breaker was in reach: the other host down opened it (and its probe closed it).
    assert breakers["open"] > 0, breakers
    assert verdict.total("lost") == 0, verdict.findings[:20]
    assert verdict.total("unexpected") == 0, verdict.findings[:20]
    assert verdict.total("overlaps") == 0, verdict.findings[:20]
    assert verdict.total("bad_keys") == 0, verdict.findings[:20]
