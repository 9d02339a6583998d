"""The failover tests' oracle (tests/support/failover.py) finds each kind of violation of
invariant 9, and excepts only the occurrences that may have been in flight at the reply."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.support.failover import Delivery, Verdict, judge

REPLY = 10_000.0


def old(i: str) -> str:
    return f"/old/{i}"


def verdict_of(deliveries: list[Delivery], owed: set[tuple[str, int]] | None = None) -> Verdict:
    return judge(
        deliveries,
        deleted={"d0": REPLY},
        paused={"p0": REPLY},
        moved={"m0": REPLY},
        old_path=old,
        created={"c0": 11_000},
        owed=owed if owed is not None else set(),
    )


def test_a_quiet_run_after_the_replies_has_no_violation() -> None:
    found = verdict_of(
        [
            Delivery("d0", 10_000, 12_500, "/d0"),  # due at the reply: may have been in flight
            Delivery("p0", 9_000, 13_000, "/p0"),
            Delivery("m0", 10_000, 10_050, old("m0")),
            Delivery("m0", 11_000, 11_010, "/new/m0"),
            Delivery("c0", 11_000, 11_200, "/c0"),
        ],
        owed={("m0", 11_000), ("c0", 11_000)},
    )
    assert found.violations == 0
    assert found.duplicates == 0
    assert found.created_late_ms == [200]


def test_each_kind_of_undone_command_is_found() -> None:
    found = verdict_of(
        [
            Delivery("d0", 11_000, 11_000, "/d0"),
            Delivery("p0", 12_000, 12_000, "/p0"),
            Delivery("m0", 11_000, 11_000, old("m0")),
            Delivery("k0", 5_000, 5_000, "/k0"),
            Delivery("k0", 5_000, 8_000, "/k0"),
        ],
        owed={("k0", 5_000), ("k0", 6_000)},
    )
    assert [d.schedule_id for d in found.fired_after_delete] == ["d0"]
    assert [d.schedule_id for d in found.fired_after_pause] == ["p0"]
    assert [d.schedule_id for d in found.old_url_after_move] == ["m0"]
    assert found.created_silent == ["c0"]
    assert found.lost == [("k0", 6_000)]
    assert found.duplicates == 1


@given(
    st.lists(
        st.tuples(st.sampled_from(["d0", "p0", "k0"]), st.integers(0, 20), st.booleans()),
        max_size=40,
    )
)
def test_only_occurrences_due_after_the_reply_count_against_it(
    fired: list[tuple[str, int, bool]],
) -> None:
    deliveries = [
        Delivery(i, second * 1000, second * 1000 + (5_000 if late else 10), f"/{i}")
        for i, second, late in fired
    ]
    found = verdict_of(deliveries)
    # However late a delivery arrives, only its occurrence's time decides.
    assert len(found.fired_after_delete) == sum(
        1 for i, second, _ in fired if i == "d0" and second * 1000 > REPLY
    )
    assert len(found.fired_after_pause) == sum(
        1 for i, second, _ in fired if i == "p0" and second * 1000 > REPLY
    )
    assert found.duplicates == len(deliveries) - len({(i, s) for i, s, _ in fired})
