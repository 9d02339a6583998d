"""``cronbus bench intake``'s order check: the violations found in a list of replies (pure)."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from cronbus.bench.intake import ordered_commands
from cronbus.bench.order import Answer, blind_counts, final_seq_of, judge, summary, version_of
from shared.contract import codec

#: Commands sent to each schedule, by schedule id.
Sent = dict[str, int]

sent_counts = st.dictionaries(
    st.integers(0, 999).map(lambda i: f"o{i:06d}"), st.integers(1, 12), min_size=1, max_size=5
)


def in_order(sent: Sent, base: int = 1) -> list[Answer]:
    return [Answer(s, seq, base + seq) for s, count in sent.items() for seq in range(count)]


def last_seqs(sent: Sent) -> dict[str, str | None]:
    return {s: str(count - 1) for s, count in sent.items()}


@given(sent_counts, st.integers(1, 10_000), st.randoms())
def test_versions_that_follow_the_seqs_are_no_violation_in_whatever_order_they_arrive(
    sent: Sent, base: int, shuffler: random.Random
) -> None:
    answers = in_order(sent, base)
    shuffler.shuffle(answers)
    assert judge(sent, answers, last_seqs(sent)) == []


@given(st.data())
def test_each_seq_answered_out_of_its_place_is_one_violation(data: st.DataObject) -> None:
    count = data.draw(st.integers(2, 20))
    versions = data.draw(st.permutations(range(1, count + 1)))
    answers = [Answer("a", seq, version) for seq, version in enumerate(versions)]
    found = judge({"a": count}, answers, {"a": str(count - 1)})
    misplaced = [seq for seq, version in enumerate(versions) if version != seq + 1]
    assert [v.seq for v in found] == misplaced
    assert {v.kind for v in found} <= {"version"}


def test_two_commands_applied_in_swapped_order_are_both_named() -> None:
    answers = [Answer("a", 0, 1), Answer("a", 1, 3), Answer("a", 2, 2)]
    found = judge({"a": 3}, answers, {"a": "1"})
    assert [(v.seq, v.kind) for v in found] == [(1, "version"), (2, "version"), (2, "final")]
    assert found[0].detail == "answered with version 3, expected 2"
    assert found[2].detail == "the final state carries seq 1"


@given(st.integers(2, 20), st.data())
def test_a_gap_in_the_versions_flags_every_seq_after_it(count: int, data: st.DataObject) -> None:
    gap_at = data.draw(st.integers(1, count - 1))
    answers = [Answer("a", seq, 1 + seq + (seq >= gap_at)) for seq in range(count)]
    found = judge({"a": count}, answers, {"a": str(count - 1)})
    assert [v.seq for v in found] == list(range(gap_at, count))


@given(sent_counts, st.data())
def test_a_missing_reply_is_one_unanswered_violation(sent: Sent, data: st.DataObject) -> None:
    answers = in_order(sent)
    dropped = answers.pop(data.draw(st.integers(0, len(answers) - 1)))
    found = judge(sent, answers, last_seqs(sent))
    assert [(v.schedule, v.seq, v.kind) for v in found] == [
        (dropped.schedule, dropped.seq, "unanswered")
    ]


@given(sent_counts, st.data())
def test_a_seq_answered_twice_is_one_repeated_violation(sent: Sent, data: st.DataObject) -> None:
    answers = in_order(sent)
    again = data.draw(st.sampled_from(answers))
    found = judge(sent, [*answers, again], last_seqs(sent))
    assert [(v.schedule, v.seq, v.kind) for v in found] == [(again.schedule, again.seq, "repeated")]


@given(sent_counts, st.data())
def test_a_final_state_without_the_last_seq_is_one_violation(
    sent: Sent, data: st.DataObject
) -> None:
    schedule = data.draw(st.sampled_from(sorted(sent)))
    finals = last_seqs(sent)
    finals[schedule] = data.draw(st.sampled_from([None, "-1", str(sent[schedule])]))
    found = judge(sent, in_order(sent), finals)
    assert [(v.schedule, v.seq, v.kind) for v in found] == [(schedule, sent[schedule] - 1, "final")]


def test_a_refusal_or_a_reply_to_nothing_sent_is_a_violation() -> None:
    answers = [
        Answer("a", 0, 1),
        Answer("a", 1, None),
        Answer("a", 2, 3),
        Answer("a", 7, 8),
        Answer("b", 0, 1),
    ]
    found = judge({"a": 3}, answers, {"a": "2"})
    assert [(v.schedule, v.seq, v.kind) for v in found] == [
        ("b", 0, "unexpected"),
        ("a", 7, "unexpected"),
        ("a", 1, "unanswered"),
    ]


def test_the_summary_counts_all_and_shows_the_first_few() -> None:
    found = judge({"a": 10}, [Answer("a", seq, 10 - seq) for seq in range(10)], {"a": "0"})
    shown = summary(found, examples=2)
    assert shown["count"] == len(found) == 11
    assert (shown["schedules"], shown["by_kind"]) == (1, {"version": 10, "final": 1})
    assert shown["examples"] == [
        {
            "schedule": "a",
            "seq": 0,
            "kind": "version",
            "detail": "answered with version 10, expected 1",
        },
        {
            "schedule": "a",
            "seq": 1,
            "kind": "version",
            "detail": "answered with version 9, expected 2",
        },
    ]
    assert summary([]) == {"count": 0, "schedules": 0, "by_kind": {}, "examples": []}


def test_the_version_and_the_seq_are_read_from_the_replies_a_user_gets() -> None:
    reply = {"ok": True, "schedule": {"id": "a", "version": 4, "labels": {"seq": "3"}}}
    assert (version_of(reply), final_seq_of(reply)) == (4, "3")
    refusal = {"ok": False, "error": {"code": "not_found"}}
    assert (version_of(refusal), final_seq_of(refusal)) == (None, None)
    assert (version_of(None), final_seq_of(None)) == (None, None)


def test_the_ordered_commands_interleave_the_schedules_and_label_each_seq() -> None:
    commands = ordered_commands(schedules=3, each=2)
    assert [(s, seq) for s, seq, _ in commands] == [
        ("o000000", 0),
        ("o000001", 0),
        ("o000002", 0),
        ("o000000", 1),
        ("o000001", 1),
        ("o000002", 1),
    ]
    body = codec.loads(commands[4][2])["schedule"]
    assert (body["id"], body["labels"]) == ("o000001", {"seq": "1"})


def test_a_count_of_schedules_that_a_dispatcher_count_divides_is_named() -> None:
    assert blind_counts(100, [1, 2, 4]) == [2, 4]
    assert blind_counts(101, [1, 2, 4, 8]) == []
    assert blind_counts(30, [3, 3, 7]) == [3]
