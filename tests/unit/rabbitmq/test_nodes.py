"""Which RabbitMQ node a service dials next, and how long it waits first."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.rabbitmq import nodes

NODES = st.lists(
    st.from_regex(r"amqp://n[0-9]{1,3}/", fullmatch=True), min_size=1, max_size=5, unique=True
)


@given(listed=NODES, start=st.integers(0, 10), losses=st.integers(0, 20))
def test_each_failure_moves_to_the_next_node_round_the_ring(
    listed: list[str], start: int, losses: int
) -> None:
    ring = nodes.NodeRing(listed, start)
    first = ring.index
    for _ in range(losses):
        ring.failed()
    assert ring.current == listed[(first + losses) % len(listed)]


@given(listed=NODES, start=st.integers(0, 10))
def test_no_wait_within_a_round_then_half_a_second_one_and_two(
    listed: list[str], start: int
) -> None:
    ring = nodes.NodeRing(listed, start)
    size = len(listed)
    waits = [ring.failed() for _ in range(size * 5)]
    round_ends = waits[size - 1 :: size]
    assert round_ends == [0.5, 1.0, 2.0, 2.0, 2.0]
    assert all(wait == 0 for i, wait in enumerate(waits) if (i + 1) % size)


def test_a_connection_made_starts_the_backoff_again() -> None:
    ring = nodes.NodeRing(["amqp://a/"], 0)
    assert [ring.failed(), ring.failed()] == [0.5, 1.0]
    ring.connected()
    assert ring.failed() == 0.5


def test_the_start_is_spread_over_the_nodes() -> None:
    starts = {nodes.NodeRing(["a", "b", "c"]).current for _ in range(200)}
    assert starts == {"a", "b", "c"}


def test_in_order_is_every_node_once_from_the_current() -> None:
    assert nodes.NodeRing(["a", "b", "c"], 1).in_order() == ["b", "c", "a"]


def test_a_heartbeat_of_ten_seconds_unless_the_url_names_one() -> None:
    assert nodes.with_heartbeat("amqp://u:p@h/v") == "amqp://u:p@h/v?heartbeat=10"
    assert (
        nodes.with_heartbeat("amqps://h/v?cafile=/ca.pem")
        == "amqps://h/v?cafile=/ca.pem&heartbeat=10"
    )
    assert nodes.with_heartbeat("amqp://h/v?heartbeat=30") == "amqp://h/v?heartbeat=30"
