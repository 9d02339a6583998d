"""The ledger's schedules: a seeded mix covering every spec kind, misfire policy, jitter, window
and target behaviour, the changes made to them during a run, and the no-fault herds.

Pure: builds the public contract's JSON bodies (and their ``Plan``), does no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from shared.contract import models, timefmt
from shared.rules.plan import Plan, plan_of

NAMESPACE = "ledger"
KINDS = ("cron", "cron_tz", "interval", "after_completion", "once")
#: Zones with daylight saving time (their transitions do not fall in a run, but the nominal
#: times are still computed in the zone by the project's own cron math).
ZONES = ("Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "America/Santiago")
POLICIES: dict[str, dict[str, Any]] = {
    "skip": {"policy": "skip"},
    "fire_once": {"policy": "fire_once"},
    "fire_all": {"policy": "fire_all", "window_s": 3600, "limit": 10_000},
    "fire_all(limit)": {"policy": "fire_all", "window_s": 30, "limit": 1},
}
#: Jitter above the misfire grace (1 s): on time although later than nominal + grace.
JITTER_S = 3
TARGETS = ("fast", "fast", "fast", "slow", "e404", "flaky1", "flaky2", "ra")
#: The share of the mix whose targets live on the other host (the one ``host-down`` stops).
OTHER_HOST_SHARE = 0.25
HERD_KINDS = ("once", "interval", "cron", "after_completion", "trigger")


@dataclass(frozen=True)
class Item:
    """One schedule of the mix."""

    id: str
    kind: str
    body: dict[str, Any]

    @property
    def plan(self) -> Plan:
        return plan_of_body(self.body)

    @property
    def commandable(self) -> bool:
        """Pause, resume and reset apply to grid schedules (interval and cron); a fixed-delay
        chain and a one-shot are only triggered and deleted."""
        return self.kind in ("cron", "cron_tz", "interval")


def plan_of_body(body: dict[str, Any]) -> Plan:
    return plan_of(models.Schedule.model_validate(body), 1)


def _grid_spec(kind: str, jitter_s: int, rng: random.Random) -> dict[str, Any]:
    if kind == "interval":
        every = rng.randint(4, 6) if jitter_s else rng.randint(2, 3)
        return {"kind": "interval", "every_s": every}
    step = rng.choice((5, 6)) if jitter_s else rng.choice((3, 4))
    spec: dict[str, Any] = {"kind": "cron", "expr": f"*/{step} * * * * *"}
    if kind == "cron_tz":
        spec["timezone"] = rng.choice(ZONES)
    return spec


def _spec(
    kind: str, jitter_s: int, now_ms: int, run_s: float, rng: random.Random
) -> dict[str, Any]:
    if kind == "once":
        at = now_ms + rng.randint(8_000, max(9_000, int(run_s * 1000)))
        return {"kind": "once", "at": timefmt.format_ms(at)}
    if kind == "after_completion":
        return {"kind": "after_completion", "delay_s": rng.randint(2, 4)}
    return _grid_spec(kind, jitter_s, rng)


def _bounds(spec: dict[str, Any], now_ms: int, run_s: float, rng: random.Random) -> None:
    """Sometimes a start, an end or a count (not on one-shots)."""
    if spec["kind"] == "once":
        return
    roll = rng.random()
    if roll < 0.15:
        spec["start_at"] = timefmt.format_ms(now_ms + rng.randint(5_000, 20_000))
    elif roll < 0.3:
        spec["end_at"] = timefmt.format_ms(
            now_ms + rng.randint(15_000, max(16_000, int(run_s * 500)))
        )
    elif roll < 0.45:
        spec["max_fires"] = rng.randint(2, 5)


def _target(sink_url: str, behaviour: str, schedule_id: str) -> dict[str, Any]:
    return {"kind": "webhook", "url": f"{sink_url}/{behaviour}/{schedule_id}", "timeout_s": 5}


def _retry(behaviour: str) -> dict[str, Any]:
    attempts = {"e404": 2, "flaky2": 4}.get(behaviour, 3)
    return {"max_attempts": attempts, "initial_backoff_s": 0.2, "max_backoff_s": 0.5}


def item(
    index: int,
    kind: str,
    policy: str,
    jitter_s: int,
    behaviour: str,
    now_ms: int,
    run_s: float,
    rng: random.Random,
    sink_url: str,
) -> Item:
    schedule_id = f"s{index:03d}-{kind}-{policy.replace('(limit)', '-limit')}-j{jitter_s}"
    spec = _spec(kind, jitter_s, now_ms, run_s, rng)
    _bounds(spec, now_ms, run_s, rng)
    body = {
        "id": schedule_id,
        "spec": spec,
        "target": _target(sink_url, behaviour, schedule_id),
        "retry": _retry(behaviour),
        "misfire": POLICIES[policy],
        "jitter_s": jitter_s,
    }
    return Item(schedule_id, kind, body)


def mix(
    seed: int, count: int, now_ms: int, run_s: float, sink_url: str, other_url: str = ""
) -> list[Item]:
    """Every (kind, policy, jitter) combination once, then random ones up to ``count``; a
    share of them (``OTHER_HOST_SHARE``) on the other host when ``other_url`` is given."""
    rng = random.Random(seed)
    combos = [
        (kind, policy, jitter)
        for kind in KINDS
        for policy in POLICIES
        for jitter in ((0, JITTER_S) if kind in ("cron", "cron_tz", "interval") else (0,))
    ]
    while len(combos) < count:
        kind = rng.choice(KINDS)
        jitter = rng.choice((0, JITTER_S)) if kind in ("cron", "cron_tz", "interval") else 0
        combos.append((kind, rng.choice(list(POLICIES)), jitter))
    items = []
    for index, (kind, policy, jitter) in enumerate(combos):
        behaviour = rng.choice(TARGETS)
        url = other_url if other_url and rng.random() < OTHER_HOST_SHARE else sink_url
        items.append(item(index, kind, policy, jitter, behaviour, now_ms, run_s, rng, url))
    return items


def reset_body(current: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The same schedule with other fire times (an upsert that starts a new rotation)."""
    spec = dict(current["spec"])
    jitter = int(current.get("jitter_s", 0))
    if spec["kind"] == "interval":
        low, high = (4, 6) if jitter else (2, 3)
        spec["every_s"] = rng.choice([n for n in range(low, high + 1) if n != spec["every_s"]])
    else:
        steps = (5, 6) if jitter else (3, 4)
        old = spec["expr"]
        spec["expr"] = next(f"*/{s} * * * * *" for s in steps if f"*/{s} * * * * *" != old)
    for bound in ("start_at", "end_at", "max_fires"):
        spec.pop(bound, None)
    return {**current, "spec": spec}


# --- herds ---------------------------------------------------------------------------------


def herd_namespace(kind: str, round_: int = 0) -> str:
    """The namespace of a herd kind (a retried herd, ``round_`` > 0, gets fresh ones)."""
    suffix = f"-r{round_}" if round_ else ""
    return f"herd-{kind.replace('_', '-')}{suffix}"


def herd_body(
    kind: str, index: int, at_ms: int, sink_url: str, behaviour: str = "slow"
) -> dict[str, Any]:
    """One schedule of a herd whose occurrence is due at ``at_ms`` (a whole second); trigger
    herds get a far-off schedule that only their triggers fire. A slow target keeps the herd
    in flight for a while (long enough for the sweeper's drift checks to run meanwhile)."""
    at = timefmt.format_ms(at_ms)
    spec: dict[str, Any]
    if kind == "once":
        spec = {"kind": "once", "at": at}
    elif kind == "interval":
        spec = {"kind": "interval", "every_s": 3600, "start_at": at}
    elif kind == "cron":
        moment = timefmt.ms_to_datetime(at_ms)
        spec = {"kind": "cron", "expr": f"{moment.second} {moment.minute} {moment.hour} * * *"}
    elif kind == "after_completion":
        spec = {"kind": "after_completion", "delay_s": 3600, "start_at": at}
    else:
        spec = {
            "kind": "interval",
            "every_s": 3600,
            "start_at": timefmt.format_ms(at_ms + 86_400_000),
        }
    schedule_id = f"h{index:05d}"
    return {
        "id": schedule_id,
        "spec": spec,
        "target": _target(sink_url, behaviour, f"{kind}-{schedule_id}"),
    }
