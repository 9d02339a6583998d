"""Parked deliveries: when the gate of a rate key can let them through again (pure).

Occurrences held by a rate key are parked once (``lua/park.lua``) and released in bulk by the
executors (``lua/unpark.lua``) when the key's wake time comes. What to release then is decided
here from the key's gate as Redis holds it (``gate.lua``'s keys): nothing while a Retry-After
hold or an open breaker lasts (look again when it ends); one occurrence, the probe, when the
breaker is half-open and no probe is in flight; as many as the limit lets through in the next
window for a limited key; and the rest in chunks for a key that is clear (``CHUNK`` a look
over all shards together, so a breaker closing in front of 100,000 parked deliveries lets them
through at a pace the executors can take, not all in one millisecond).

Probes go round: the shard a probe comes from turns with the breaker's own count of probes
(``shares``), and within a shard ``unpark.lua`` releases, as the probe, a schedule that has
never been one, else the one that was one longest ago; so a failing schedule behind a key is
the probe again only once every other schedule parked there has been one since.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

#: How long past its wake a parked occurrence comes due by itself should no executor release
#: it (all stopped, or a registry entry lost): the cost of a key held for hours is one hold
#: per occurrence per this long (``CRONBUS_PARK_SAFETY_S``).
SAFETY_MS = 900_000
#: Each occurrence's safety deadline is moved by up to this share of it, either way, by a hash
#: of its member: what was parked together comes back spread over a fifth of the safety
#: time, not in one millisecond.
SAFETY_SPREAD = 0.1
#: Most occurrences released per rate key and look (over all shards) when the key is clear;
#: the key is looked at again after ``CHUNK_WAKE_MS``, so a large parked set drains at a
#: bounded pace (here 4,000 a second per key).
CHUNK = 1000
CHUNK_WAKE_MS = 250
#: Released occurrences come due spread over this long (not all in the same millisecond).
SPREAD_MS = 250
#: After releasing a probe, look again this late: by then its gate call has set the breaker's
#: probe deadline (look again at its end), or the probe's success has closed the breaker.
PROBE_LOOK_MS = 2000


@dataclass(frozen=True, slots=True)
class Gate:
    """A rate key's gate as Redis holds it (0 for an absent value)."""

    fails: int
    open_until: int
    probe_until: int
    hold_until: int
    #: GCRA's theoretical arrival time of the next slot (ms).
    tat: float
    #: Probes the breaker has let through since it opened (``gate.lua``): the turn of the
    #: shard the next one comes from, the same for every executor.
    probes: int = 0


@dataclass(frozen=True, slots=True)
class Limit:
    """The rate limit of a parked key: ``interval_ms`` 0 for none."""

    interval_ms: float
    burst: int


@dataclass(frozen=True, slots=True)
class Release:
    """Release at most ``count`` of the key's parked occurrences (over all shards), and look
    at the key again at ``next_wake_ms``."""

    count: int
    next_wake_ms: int
    #: The one occurrence released is the half-open breaker's probe: ``unpark.lua`` takes it
    #: from the schedule that has not been the probe for longest.
    probe: bool = False


def parse_limit(text: str) -> Limit:
    """``interval_ms|burst`` as park.lua stores it; anything unreadable counts as no limit."""
    interval, _, burst = text.partition("|")
    try:
        return Limit(max(float(interval), 0.0), max(int(burst), 1))
    except ValueError:
        return Limit(0.0, 1)


def format_limit(interval_ms: float, burst: int) -> str:
    return f"{interval_ms:.3f}|{burst}"


def decide(gate: Gate, limit: Limit, now_ms: int, threshold: int, window_ms: int) -> Release:
    """What to release of a key whose wake came, from its gate at ``now_ms``. ``threshold`` is
    the failures that open a breaker; ``window_ms`` how far ahead the gate reserves slots."""
    if gate.hold_until > now_ms:
        return Release(0, gate.hold_until)
    if gate.open_until > now_ms:
        return Release(0, gate.open_until)
    if gate.fails >= threshold:
        if gate.probe_until > now_ms:
            return Release(0, gate.probe_until)
        return Release(1, now_ms + PROBE_LOOK_MS, probe=True)
    if limit.interval_ms <= 0:
        return Release(CHUNK, now_ms + CHUNK_WAKE_MS)
    return Release(slots_within(gate.tat, limit, now_ms, window_ms), now_ms + window_ms)


def hold_over(gate: Gate, limit: Limit, now_ms: int, threshold: int, window_ms: int) -> bool:
    """Whether the gate, read at ``now_ms``, already lets through some of what is parked
    behind it: a park that lands after its breaker closed (or its hold ended) registered a
    wake for a hold that no longer holds, and must be looked at now rather than then."""
    return decide(gate, limit, now_ms, threshold, window_ms).count > 0


def slots_within(tat: float, limit: Limit, now_ms: int, window_ms: int) -> int:
    """GCRA slots free from now until ``window_ms`` ahead: what the gate would admit or
    reserve, rather than hold, if that many came now."""
    allowed_at = max(tat, now_ms) - limit.interval_ms * (limit.burst - 1)
    horizon = now_ms + window_ms
    if allowed_at > horizon:
        return 0
    return math.floor((horizon - allowed_at) / limit.interval_ms) + 1


def share(count: int, shards: Sequence[int], turn: int) -> dict[int, int]:
    """``count`` split between the shards that park the key, evenly, the remainder going to
    shards in turn (``turn`` rotates it: see ``shares`` for a probe's)."""
    if not shards:
        return {}
    base, extra = divmod(count, len(shards))
    start = turn % len(shards)
    order = list(shards[start:]) + list(shards[:start])
    return {shard: base + (1 if i < extra else 0) for i, shard in enumerate(order)}


def shares(release: Release, gate: Gate, shards: Sequence[int], turn: int) -> dict[int, int]:
    """What each shard that parks the key releases of ``release``. A probe comes from the
    shards in turn by the breaker's count of probes (``gate.probes``: one more per probe, the
    same whichever executor looks), so successive probes come from each shard in turn and a
    shard whose first parked schedule keeps failing takes one probe in ``len(shards)``.
    Anything else rotates its remainder by the executor's own ``turn``."""
    return share(release.count, shards, gate.probes if release.probe else turn)


def safety_ms_of(member: str, safety_ms: int) -> int:
    """``member``'s own safety time: ``safety_ms`` moved by up to ``SAFETY_SPREAD`` of it
    either way, the same for the same member every time (a stable hash, not a random draw, so
    every executor parks it alike)."""
    span = int(safety_ms * SAFETY_SPREAD)
    if span <= 0:
        return safety_ms
    offset = zlib.crc32(member.encode()) % (2 * span + 1) - span
    return safety_ms + offset
