"""What a parked rate key releases when its wake comes, from its gate (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.policy import holds
from shared.policy.holds import Gate, Limit, Release

NOW = 1_800_000_000_000
NONE = Limit(0.0, 1)
THRESHOLD = 5
CLEAR = Gate(0, 0, 0, 0, 0.0)


def decide(gate: Gate, limit: Limit = NONE) -> Release:
    return holds.decide(gate, limit, NOW, threshold=20, window_ms=2000)


def test_a_retry_after_hold_or_an_open_breaker_releases_nothing_until_it_ends() -> None:
    assert decide(Gate(0, 0, 0, NOW + 5000, 0.0)) == Release(0, NOW + 5000)
    assert decide(Gate(25, NOW + 30_000, 0, 0, 0.0)) == Release(0, NOW + 30_000)
    # Both: the hold is looked at first, and the breaker at the hold's end.
    assert decide(Gate(25, NOW + 30_000, 0, NOW + 1000, 0.0)) == Release(0, NOW + 1000)


def test_a_half_open_breaker_releases_one_probe_then_waits_for_it() -> None:
    assert decide(Gate(25, NOW - 1, 0, 0, 0.0)) == Release(1, NOW + holds.PROBE_LOOK_MS, True)
    assert decide(Gate(25, NOW - 1, NOW + 15_000, 0, 0.0)) == Release(0, NOW + 15_000)


def test_a_clear_key_releases_in_chunks() -> None:
    assert decide(CLEAR) == Release(holds.CHUNK, NOW + holds.CHUNK_WAKE_MS)
    # Failures under the threshold do not hold anything back.
    assert decide(Gate(3, 0, 0, 0, 0.0)).count == holds.CHUNK


@given(shards=st.lists(st.integers(0, 1023), min_size=1, max_size=1024, unique=True))
def test_a_clear_key_releases_one_chunk_a_look_whatever_the_shards(shards: list[int]) -> None:
    # A breaker closing in front of many parked deliveries: one look lets at most a chunk
    # through over all the shards that park them (not a chunk in each).
    release = decide(CLEAR)
    assert sum(holds.share(release.count, shards, 0).values()) == holds.CHUNK


def test_only_a_half_open_breaker_releases_a_probe() -> None:
    limited = Limit(200.0, 1)
    assert decide(Gate(25, NOW - 1, 0, 0, 0.0), limited).probe  # one, and it is the probe
    for gate in (CLEAR, Gate(3, 0, 0, 0, 0.0), Gate(25, NOW + 1, 0, 0, 0.0)):
        assert not decide(gate).probe and not decide(gate, limited).probe


@given(
    shards=st.lists(st.integers(0, 1023), min_size=1, max_size=64, unique=True),
    probes=st.integers(0, 10**6),
    turn=st.integers(0, 10**6),
)
def test_successive_probes_come_from_each_shard_in_turn(
    shards: list[int], probes: int, turn: int
) -> None:
    # Whatever executor looks and however often (its own turn), the breaker's count of probes
    # picks the shard: as many successive probes as shards take one from each.
    probe = Release(1, NOW + holds.PROBE_LOOK_MS, True)
    chosen = []
    for n in range(probes, probes + len(shards)):
        found = holds.shares(probe, Gate(25, NOW - 1, 0, 0, 0.0, n), shards, turn + 7 * n)
        assert sum(found.values()) == 1 and set(found) == set(shards)
        chosen += [shard for shard, count in found.items() if count]
    assert sorted(chosen) == sorted(shards)


@given(
    shards=st.lists(st.integers(0, 1023), min_size=1, max_size=64, unique=True),
    count=st.integers(0, 5000),
    probes=st.integers(0, 100),
    turn=st.integers(0, 10**6),
)
def test_other_releases_are_shared_by_the_executors_turn(
    shards: list[int], count: int, probes: int, turn: int
) -> None:
    release = Release(count, NOW + 250)
    gate = Gate(3, 0, 0, 0, 0.0, probes)
    assert holds.shares(release, gate, shards, turn) == holds.share(count, shards, turn)
    assert sum(holds.shares(release, gate, shards, turn).values()) == count


def test_a_limited_key_releases_the_slots_of_the_next_window() -> None:
    five_per_s = Limit(200.0, 1)
    assert decide(CLEAR, five_per_s) == Release(11, NOW + 2000)  # now, +200 ... +2000
    assert decide(Gate(0, 0, 0, 0, NOW + 1000.0), five_per_s).count == 6
    assert decide(Gate(0, 0, 0, 0, NOW + 5000.0), five_per_s).count == 0
    assert decide(CLEAR, Limit(200.0, 10)).count == 20  # the burst too


@given(
    tat=st.floats(NOW - 10_000, NOW + 10_000),
    interval=st.floats(1, 5000),
    burst=st.integers(1, 100),
)
def test_slots_never_exceed_what_the_gate_would_take_without_holding(
    tat: float, interval: float, burst: int
) -> None:
    limit = Limit(interval, burst)
    slots = holds.slots_within(tat, limit, NOW, 2000)
    # The gate reserves slot k (0-based) at allowed_at + k * interval; all must be <= window.
    allowed_at = max(tat, NOW) - interval * (burst - 1)
    if slots:
        assert allowed_at + (slots - 1) * interval <= NOW + 2000 + 1e-3
    # 1e-3: a float near 1.8e12 ms is only exact to about 2.4e-4.
    assert allowed_at + slots * interval > NOW + 2000 - 1e-3


def test_share_splits_the_count_and_rotates_the_remainder() -> None:
    assert holds.share(1, [3, 5, 7], 0) == {3: 1, 5: 0, 7: 0}
    assert holds.share(1, [3, 5, 7], 1) == {5: 1, 7: 0, 3: 0}
    assert holds.share(7, [3, 5], 0) == {3: 4, 5: 3}
    assert holds.share(5, [], 0) == {}


def test_limits_round_trip_and_bad_text_is_no_limit() -> None:
    assert holds.parse_limit(holds.format_limit(200.0, 10)) == Limit(200.0, 10)
    assert holds.parse_limit("") == NONE
    assert holds.parse_limit("x|y") == NONE


@given(member=st.text(max_size=300), safety=st.integers(1, 86_400_000))
def test_a_members_safety_time_is_stable_and_within_a_tenth_either_way(
    member: str, safety: int
) -> None:
    own = holds.safety_ms_of(member, safety)
    assert own == holds.safety_ms_of(member, safety)
    span = int(safety * holds.SAFETY_SPREAD)
    assert safety - span <= own <= safety + span
    assert own > 0


def test_members_parked_together_come_back_spread_over_the_window() -> None:
    # 10,000 members parked behind one key in the same millisecond: their safety deadlines
    # cover the whole +-10% window, at most a handful in any one millisecond.
    safety = holds.SAFETY_MS
    times = [holds.safety_ms_of(f"acme/s{i}", safety) for i in range(10_000)]
    span = int(safety * holds.SAFETY_SPREAD)
    assert min(times) < safety - span * 0.9 and max(times) > safety + span * 0.9
    per_second: dict[int, int] = {}
    for t in times:
        per_second[t // 1000] = per_second.get(t // 1000, 0) + 1
    # 10,000 over 180 s: about 56 a second; a fair hash stays well under twice that.
    assert max(per_second.values()) < 120
    assert max(times.count(t) for t in set(times[:200])) <= 3


@given(
    fails=st.integers(0, 10),
    open_for=st.integers(-5000, 5000),
    probe_for=st.integers(-5000, 5000),
    hold_for=st.integers(-5000, 5000),
)
def test_a_hold_is_over_exactly_when_no_hold_breaker_or_probe_in_flight_still_holds(
    fails: int, open_for: int, probe_for: int, hold_for: int
) -> None:
    # A park landing now may wait for its wake only while something still holds its key.
    now = 1_000_000
    gate = Gate(fails, now + open_for, now + probe_for, now + hold_for, 0.0)
    held = hold_for > 0 or open_for > 0 or (fails >= THRESHOLD and probe_for > 0)
    assert holds.hold_over(gate, NONE, now, THRESHOLD, 1000) is not held


def test_a_rate_limited_key_with_no_slot_in_the_window_is_still_held() -> None:
    now = 1_000_000
    limit = Limit(100.0, 1)
    assert not holds.hold_over(Gate(0, 0, 0, 0, now + 5000.0), limit, now, THRESHOLD, 1000)
    assert holds.hold_over(Gate(0, 0, 0, 0, now + 500.0), limit, now, THRESHOLD, 1000)
