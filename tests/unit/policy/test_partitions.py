"""Which partition a command goes to, how an upsert_many is split, and how its parts' results
are put back together."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from shared.policy import partitions
from shared.policy.partitions import Part, Route

#: partition_of("acme", "s0".."s7", 8) as computed when partitions were introduced.
PINNED = [7, 1, 3, 5, 6, 0, 2, 4]

ids = st.text(min_size=0, max_size=20)
counts = st.integers(min_value=1, max_value=64)


@given(st.text(max_size=10), ids, counts)
def test_every_single_schedule_verb_sends_one_schedule_to_the_same_partition(
    namespace: str, schedule_id: str, k: int
) -> None:
    expected = partitions.partition_of(namespace, schedule_id, k)
    assert 0 <= expected < k
    upsert = partitions.route_of(namespace, "upsert", {"schedule": {"id": schedule_id}}, k)
    assert upsert == Route(expected)
    for verb in ("delete", "pause", "resume", "trigger", "get", "backfill"):
        assert partitions.route_of(namespace, verb, {"id": schedule_id}, k) == Route(expected)


def test_the_partition_is_the_one_every_version_computes() -> None:
    # A changed hash would move schedules between partitions at an upgrade (and reorder the
    # commands in flight): these values are pinned.
    assert [partitions.partition_of("acme", f"s{i}", 8) for i in range(8)] == PINNED


def test_the_partition_does_not_depend_on_python_s_hash_seed() -> None:
    code = "from shared.policy import partitions; print(partitions.partition_of('a', 'b', 97))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": str(seed), "PYTHONPATH": "."},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(seen) == 1


@given(st.sampled_from(["upsert", "delete", "list", "upsert_many", "nope"]), counts)
def test_a_body_that_names_no_schedule_goes_whole_to_the_namespace_s_partition(
    verb: str, k: int
) -> None:
    whole = Route(partitions.partition_of("acme", "", k))
    parsed: Any
    for parsed in (None, [], "x", 3, {}, {"id": 5}, {"schedule": "s"}, {"schedules": []}):
        assert partitions.route_of("acme", verb, parsed, k) == whole


def test_an_upsert_many_of_the_wrong_shape_is_never_split() -> None:
    items = [{"id": f"s{i}"} for i in range(50)]
    for parsed in (
        {"schedules": items, "extra": 1},
        {"schedules": [{"id": "x"}] * 1001},
        {"schedules": {"id": "x"}},
    ):
        assert not partitions.route_of("acme", "upsert_many", parsed, 8).split


items_strategy = st.lists(
    st.one_of(
        st.fixed_dictionaries({"id": ids}),
        st.fixed_dictionaries({"id": st.integers()}),
        st.just({}),
        st.just("not an object"),
    ),
    min_size=1,
    max_size=80,
)


@given(items_strategy, counts)
def test_an_upsert_many_s_parts_hold_every_schedule_once_in_input_order(
    items: list[Any], k: int
) -> None:
    route = partitions.route_of("acme", "upsert_many", {"schedules": items}, k)
    if not route.parts:
        return
    positions = [p for part in route.parts for p in part.positions]
    assert sorted(positions) == list(range(len(items)))
    for part in route.parts:
        assert list(part.positions) == sorted(part.positions)
        for position in part.positions:
            item = items[position]
            item_id = item.get("id") if isinstance(item, dict) else None
            key = item_id if isinstance(item_id, str) else ""
            assert part.partition == partitions.partition_of("acme", key, k)
    assert len({part.partition for part in route.parts}) == len(route.parts)


@given(items_strategy, counts)
def test_merged_results_answer_every_schedule_once_in_input_order(items: list[Any], k: int) -> None:
    route = partitions.route_of("acme", "upsert_many", {"schedules": items}, k)
    if not route.split:
        return
    replies = [
        {"ok": True, "results": [{"position": p} for p in part.positions]} for part in route.parts
    ]
    merged = partitions.merged_results(route.parts, replies, items)
    assert merged["ok"] is True and "duplicate" not in merged
    assert [r["position"] for r in merged["results"]] == list(range(len(items)))


def test_a_part_refused_whole_answers_each_of_its_schedules_with_that_error() -> None:
    items = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    parts = (Part(0, (0, 2)), Part(1, (1,)))
    error = {"code": "internal", "message": "m", "details": []}
    merged = partitions.merged_results(
        parts,
        [{"ok": False, "error": error}, {"ok": True, "results": [{"id": "b", "ok": True}]}],
        items,
    )
    assert merged["results"] == [
        {"id": "a", "ok": False, "error": error},
        {"id": "b", "ok": True},
        {"id": "c", "ok": False, "error": error},
    ]


def test_a_reply_that_lacks_results_still_answers_every_schedule() -> None:
    parts = (Part(0, (0,)), Part(1, (1,)))
    merged = partitions.merged_results(parts, [{}, {"ok": True, "results": []}], [{"id": 1}, {}])
    assert [r["ok"] for r in merged["results"]] == [False, False]
    assert merged["results"][0]["id"] is None


def test_a_split_command_is_a_duplicate_only_when_every_part_is() -> None:
    parts = (Part(0, (0,)), Part(1, (1,)))
    one = {"ok": True, "results": [{"id": "a"}], "duplicate": True}
    other = {"ok": True, "results": [{"id": "b"}]}
    items = [{"id": "a"}, {"id": "b"}]
    assert "duplicate" not in partitions.merged_results(parts, [one, other], items)
    both = partitions.merged_results(parts, [one, {**other, "duplicate": True}], items)
    assert both["duplicate"] is True
