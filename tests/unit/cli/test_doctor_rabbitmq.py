"""What cronbus doctor says of the RabbitMQ nodes, the cluster and cronbus's quorum queues."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.policy import rabbit_cluster as rc

NODES = ["rabbit@a", "rabbit@b", "rabbit@c"]


def _queue(**fields: object) -> dict[str, object]:
    return {
        "name": "cronbus.deliveries",
        "type": "quorum",
        "members": NODES,
        "online": NODES,
        "leader": "rabbit@a",
        **fields,
    }


def test_three_answering_nodes_are_all_ok() -> None:
    found = rc.node_findings({"a:5672": None, "b:5672": None, "c:5672": None})
    assert [f.severity for f in found] == ["ok", "ok", "ok"]


def test_a_node_that_does_not_answer_is_an_error_naming_it_and_the_setting() -> None:
    found = rc.node_findings({"a:5672": None, "b:5672": "refused", "c:5672": None})
    (bad,) = [f for f in found if not f.ok]
    assert bad.severity == "error" and "b:5672" in bad.message and "refused" in bad.message
    assert "CRONBUS_AMQP_URL" in bad.fix


def test_a_single_node_is_a_warning_pointing_at_high_availability() -> None:
    found = rc.node_findings({"a:5672": None})
    assert [f.severity for f in found] == ["ok", "warning"]
    assert "three" in found[1].fix


def test_the_cluster_with_a_stopped_member_or_a_partition() -> None:
    nodes = [
        {"name": "rabbit@a", "running": True, "partitions": ["rabbit@b"]},
        {"name": "rabbit@b", "running": True, "partitions": []},
        {"name": "rabbit@c", "running": False, "partitions": []},
    ]
    found = rc.cluster_findings(nodes)
    assert found[0].severity == "warning" and "stopped: rabbit@c" in found[0].message
    assert found[1].severity == "error" and "rabbit@a is partitioned" in found[1].message
    healthy = [{"name": n, "running": True, "partitions": []} for n in NODES]
    assert [f.severity for f in rc.cluster_findings(healthy)] == ["ok"]


def test_a_queue_with_three_members_online_and_a_leader_is_ok() -> None:
    (found,) = rc.queue_findings([_queue()])
    assert found.ok and "leader rabbit@a" in found.message


def test_a_queue_without_a_leader_online_is_an_error() -> None:
    (found,) = rc.queue_findings([_queue(leader="rabbit@a", online=["rabbit@b"])])
    assert found.severity == "error" and "no leader online" in found.message


def test_a_classic_queue_of_cronbus_is_an_error_and_other_queues_are_not_judged() -> None:
    found = rc.queue_findings(
        [_queue(name="cronbus.commands", type="classic"), _queue(name="app.jobs", type="classic")]
    )
    assert [(f.severity, f.message.split()[0]) for f in found] == [("error", "cronbus.commands")]


@given(
    members=st.integers(1, 5),
    offline=st.integers(0, 5),
)
def test_a_queue_says_how_many_more_losses_it_survives(members: int, offline: int) -> None:
    names = [f"rabbit@n{i}" for i in range(members)]
    online = names[min(offline, members) :]
    (found,) = rc.queue_findings([_queue(members=names, online=online, leader=names[-1])])
    majority = members // 2 + 1
    if len(online) < majority:
        assert found.severity == "error" and "no leader online" in found.message
    elif members >= 3 and len(online) == members:
        assert found.ok
    else:
        assert found.severity == "warning"
        assert f"survives the loss of {len(online) - majority} more" in found.message
