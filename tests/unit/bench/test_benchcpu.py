"""The bench's CPU arithmetic and its check that the import ended before the measured window."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cronbus.bench import cpu as benchcpu

seconds = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
pid_times = st.dictionaries(st.integers(min_value=1, max_value=50), seconds, max_size=8)


def test_a_process_present_at_both_samples_counts_what_it_spent_between_them() -> None:
    assert benchcpu.cpu_spent({10: 1.5, 11: 2.0}, {10: 2.0, 11: 2.25}) == pytest.approx(0.75)


def test_a_process_started_inside_the_window_counts_fully() -> None:
    # A PostgreSQL backend opened during a herd: all its CPU is the herd's.
    assert benchcpu.cpu_spent({10: 1.0}, {10: 1.0, 12: 0.4}) == pytest.approx(0.4)


def test_a_process_that_exited_inside_the_window_adds_nothing_unknown() -> None:
    assert benchcpu.cpu_spent({10: 1.0, 11: 5.0}, {10: 1.5}) == pytest.approx(0.5)


@given(before=pid_times, extra=pid_times)
def test_cpu_spent_is_never_negative_and_adds_up(
    before: dict[int, float], extra: dict[int, float]
) -> None:
    after = {pid: before.get(pid, 0.0) + more for pid, more in extra.items()}
    # (b + e) - b is e only to within the rounding of b's magnitude
    rounding = 1e-15 * len(after) * max(after.values(), default=0.0)
    assert benchcpu.cpu_spent(before, after) == pytest.approx(
        sum(extra.values()), abs=max(rounding, 1e-12)
    )
    assert benchcpu.cpu_spent(after, before) >= 0


def test_ms_per_fire_divides_each_component_by_the_fires() -> None:
    before = {"executors": {1: 10.0, 2: 10.0}, "redis": {7: 100.0}}
    after = {"executors": {1: 10.5, 2: 10.3}, "redis": {7: 100.2}}
    by_component = benchcpu.ms_per_fire(before, after, 10_000)
    assert by_component == {"executors": 0.08, "redis": 0.02}


def test_services_total_leaves_out_the_servers_and_the_sink() -> None:
    by_component = {
        "executors": 0.08,
        "dispatcher": 0.01,
        "sweeper": 0.002,
        "redis": 0.03,
        "postgresql": 0.02,
        "sink": 0.1,
    }
    assert benchcpu.services_total(by_component) == pytest.approx(0.092)


def test_no_fires_does_not_divide_by_zero() -> None:
    assert benchcpu.ms_per_fire({"sink": {1: 0.0}}, {"sink": {1: 0.001}}, 0) == {"sink": 1.0}


def test_ticks_are_read_after_a_command_name_holding_spaces_and_parentheses() -> None:
    stat = "4242 (we (ird) name) S 1 4242 4242 0 -1 4194560 500 0 0 0 123 45 0 0 20 0 1 0"
    assert benchcpu.ticks_from_stat(stat) == 168


def test_an_import_that_ended_before_the_window_is_accepted() -> None:
    window = benchcpu.ImportWindow(import_end_ms=1_000, window_start_ms=6_000)
    assert window.overlap_ms == 0
    assert window.margin_s == 5.0
    assert window.refusal() is None


def test_an_import_that_ran_into_the_window_is_refused_with_what_to_do() -> None:
    # The steady bench at 1M: the import ended 21 s after the first fire it meant to measure.
    window = benchcpu.ImportWindow(import_end_ms=93_000, window_start_ms=72_000)
    assert window.overlap_ms == 21_000
    assert window.margin_s == -21.0
    refusal = window.refusal()
    assert refusal is not None
    assert "21.0s into the measured window" in refusal
    assert "--lead-s" in refusal


@given(end=st.integers(0, 10**13), start=st.integers(0, 10**13))
def test_refused_exactly_when_the_import_ends_after_the_window_starts(end: int, start: int) -> None:
    window = benchcpu.ImportWindow(end, start)
    assert (window.refusal() is not None) == (end > start)
    assert window.overlap_ms == max(0, end - start)


@pytest.mark.parametrize(
    ("title", "own"),
    [
        ("postgres: 15/main: postgres cronbus_bench_1 127.0.0.1(5555) idle", True),
        ("postgres: 15/main: postgres cronbus_t_other 127.0.0.1(5556) idle", False),
        ("postgres: 15/main: postgres cronbus_t_other [local] idle", False),
        ("postgres: 15/main: postgres cronbus_bench_1 [local] INSERT", True),
        ("postgres: 15/main: checkpointer ", True),
        ("postgres: 15/main: walwriter ", True),
        ("/usr/lib/postgresql/15/bin/postgres -D /var/lib/postgresql/15/main", True),
    ],
)
def test_postgres_backends_of_other_databases_are_not_counted(title: str, own: bool) -> None:
    assert benchcpu.is_own_postgres(title, "cronbus_bench_1") is own
