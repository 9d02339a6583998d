"""Which deliveries one channel may acknowledge, several in one frame (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.dispatcher.intake.ack_window import Ack, AckWindow


class Broker:
    """The broker's side of one channel: the deliveries still unsettled, and its refusals."""

    def __init__(self) -> None:
        self.unsettled: set[int] = set()
        self.settled: list[int] = []

    def apply(self, ack: Ack) -> None:
        # A tag the broker does not hold unsettled closes the channel (PRECONDITION_FAILED).
        assert ack.tag in self.unsettled, f"tag {ack.tag} is not unsettled"
        covered = {t for t in self.unsettled if t <= ack.tag} if ack.multiple else {ack.tag}
        assert covered == set(ack.settles), f"{ack} settles {sorted(covered)}"
        self.unsettled -= covered
        self.settled += sorted(covered)


def test_commands_finished_together_share_one_ack() -> None:
    window = AckWindow()
    for tag in (1, 2, 3):
        window.begin(tag)
    window.finish(2)
    window.finish(1)
    window.finish(3)
    assert window.take() == [Ack(3, True, (2, 1, 3))]
    assert window.idle()


def test_a_command_in_progress_holds_back_the_acks_after_it() -> None:
    window = AckWindow()
    for tag in (1, 2, 3):
        window.begin(tag)
    window.finish(1)
    window.finish(3)
    assert window.take() == [Ack(1, True, (1,))]
    assert window.take() == []
    window.finish(2)
    assert window.take() == [Ack(3, True, (3, 2))]


def test_a_stuck_command_holds_back_at_most_max_held() -> None:
    window = AckWindow(max_held=2)
    for tag in (1, 2, 3, 4):
        window.begin(tag)
    window.finish(2)
    window.finish(3)
    assert window.take() == []
    window.finish(4)
    assert window.take() == [Ack(2, False, (2,)), Ack(3, False, (3,)), Ack(4, False, (4,))]


def test_deliveries_begun_out_of_order_are_acknowledged_one_by_one() -> None:
    window = AckWindow()
    window.begin(2)
    window.begin(1)
    window.finish(2)
    assert window.take() == [Ack(2, False, (2,))]


def test_a_nacked_delivery_no_longer_holds_back_the_others() -> None:
    window = AckWindow()
    window.begin(1)
    window.begin(2)
    window.finish(2)
    assert window.take() == []
    window.drop(1)
    assert window.take() == [Ack(2, True, (2,))]


def test_an_abandoned_delivery_is_never_covered_and_those_after_it_go_one_by_one() -> None:
    window = AckWindow()
    for tag in (1, 2, 3, 4):
        window.begin(tag)
    window.finish(1)
    assert window.abandon(2)
    window.finish(4)
    assert window.take() == [Ack(1, True, (1,)), Ack(4, False, (4,))]
    window.finish(3)
    assert window.take() == [Ack(3, False, (3,))]
    assert not window.abandon(3)  # it had its ack


@st.composite
def runs(draw: st.DrawFn) -> tuple[int, list[tuple[str, int]]]:
    """Deliveries 1..n begun in order, each finished (or nacked) at some later step, with
    takes in between."""
    n = draw(st.integers(1, 30))
    steps: list[tuple[str, int]] = []
    begun: list[int] = []
    next_tag = 1
    while next_tag <= n or begun:
        # Only the moves that make progress are offered first: every run ends.
        offered = ["begin"] if next_tag <= n else []
        offered += ["end"] if begun else []
        choice = draw(st.sampled_from([*offered, "take"]))
        if choice == "begin":
            steps.append(("begin", next_tag))
            begun.append(next_tag)
            next_tag += 1
        elif choice == "end":
            tag = begun.pop(draw(st.integers(0, len(begun) - 1)))
            steps.append((draw(st.sampled_from(["finish", "drop", "abandon"])), tag))
        else:
            steps.append(("take", 0))
    return draw(st.integers(1, 5)), steps


@given(runs())
def test_no_ack_settles_a_command_in_progress_or_abandoned_and_every_finished_one_once(
    run: tuple[int, list[tuple[str, int]]],
) -> None:
    max_held, steps = run
    window = AckWindow(max_held=max_held)
    broker = Broker()
    in_progress: set[int] = set()
    finished: set[int] = set()
    abandoned: set[int] = set()
    for kind, tag in steps:
        if kind == "begin":
            window.begin(tag)
            broker.unsettled.add(tag)
            in_progress.add(tag)
        elif kind == "finish":
            window.finish(tag)
            in_progress.discard(tag)
            finished.add(tag)
        elif kind == "abandon":
            window.abandon(tag)
            in_progress.discard(tag)
            abandoned.add(tag)
        elif kind == "drop":
            window.drop(tag)
            in_progress.discard(tag)
            broker.unsettled.discard(tag)  # the nack went out first
        else:
            for ack in window.take():
                broker.apply(ack)
                assert not set(ack.settles) & (in_progress | abandoned)
    for ack in window.take():
        broker.apply(ack)
    assert sorted(broker.settled) == sorted(finished)
    assert broker.unsettled == abandoned
    assert window.idle()
