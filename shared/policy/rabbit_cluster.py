"""What ``cronbus doctor`` says of a RabbitMQ cluster, judged from what its nodes and its
management API answered. No I/O: the answers come in, findings go out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

#: Quorum queues survive the loss of a minority of their members: three survive one.
SAFE_MEMBERS = 3
AMQP_SETTING = "CRONBUS_AMQP_URL"
MANAGEMENT_SETTING = "CRONBUS_AMQP_MANAGEMENT_URL"

Severity = Literal["ok", "warning", "error"]


@dataclass(frozen=True)
class Finding:
    """One thing doctor checked: what it found, and the setting or command that fixes it."""

    check: str
    severity: Severity
    message: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.severity == "ok"


def node_findings(dialled: Mapping[str, str | None]) -> list[Finding]:
    """Each URL of CRONBUS_AMQP_URL (by host:port) and the error dialling it gave, if any."""
    findings = []
    for where, error in dialled.items():
        if error is None:
            findings.append(Finding("rabbitmq-node", "ok", f"{where} answers"))
        else:
            findings.append(
                Finding(
                    "rabbitmq-node",
                    "error",
                    f"{where} does not answer ({error}): the services pass it over, but a "
                    "cluster missing a node survives one loss fewer",
                    f"start the node, or remove it from {AMQP_SETTING}",
                )
            )
    if len(dialled) < SAFE_MEMBERS:
        findings.append(
            Finding(
                "rabbitmq-nodes",
                "warning",
                f"{AMQP_SETTING} lists {len(dialled)} node(s): when it is lost, the services "
                "wait for it to come back",
                f"run three RabbitMQ nodes and list them all in {AMQP_SETTING}, "
                "comma-separated (see High availability)",
            )
        )
    return findings


def cluster_findings(nodes: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """The cluster's members as GET /api/nodes lists them (name, running, partitions)."""
    running = [n["name"] for n in nodes if n.get("running")]
    stopped = [n["name"] for n in nodes if not n.get("running")]
    findings = [
        Finding(
            "rabbitmq-cluster",
            "ok" if len(running) >= SAFE_MEMBERS and not stopped else "warning",
            f"{len(running)} of {len(nodes)} cluster member(s) running"
            + (f"; stopped: {', '.join(stopped)}" if stopped else ""),
            ""
            if len(running) >= SAFE_MEMBERS and not stopped
            else "run three nodes, all running (rabbitmqctl cluster_status)",
        )
    ]
    for node in nodes:
        if node.get("partitions"):
            findings.append(
                Finding(
                    "rabbitmq-partition",
                    "error",
                    f"{node['name']} is partitioned from {', '.join(node['partitions'])}",
                    "heal the network partition (rabbitmq-diagnostics cluster_status)",
                )
            )
    return findings


def queue_findings(queues: Sequence[Mapping[str, Any]], prefix: str = "cronbus.") -> list[Finding]:
    """cronbus's queues as GET /api/queues/VHOST lists them (name, type, members, leader,
    online): each a quorum queue with three members online and a leader."""
    findings = []
    for queue in sorted(queues, key=lambda q: str(q.get("name"))):
        name = str(queue.get("name"))
        if not name.startswith(prefix) or name.startswith(f"{prefix}router"):
            continue
        if queue.get("type") != "quorum":
            findings.append(
                Finding(
                    "rabbitmq-queue",
                    "error",
                    f"{name} is a {queue.get('type')} queue: it does not survive its node",
                    "delete it while the services are stopped; they declare it again as a "
                    "quorum queue (see Upgrading)",
                )
            )
            continue
        members = list(queue.get("members") or [])
        online = set(queue.get("online") or [])
        leader = queue.get("leader")
        offline = [m for m in members if m not in online]
        if not leader or leader not in online or len(members) - len(offline) <= len(members) // 2:
            findings.append(
                Finding(
                    "rabbitmq-queue",
                    "error",
                    f"{name} has no leader online with a majority "
                    f"(members {', '.join(members) or 'none'}): it takes no message",
                    "bring a majority of its members back (rabbitmq-queues quorum_status)",
                )
            )
        elif len(members) < SAFE_MEMBERS or offline:
            spare = len(members) - len(offline) - (len(members) // 2 + 1)
            findings.append(
                Finding(
                    "rabbitmq-queue",
                    "warning",
                    f"{name}: {len(members) - len(offline)} of {len(members)} member(s) "
                    f"online, leader {leader}: it survives the loss of {spare} more node(s)",
                    "bring the offline members back, or add members "
                    "(rabbitmq-queues grow NODE all)",
                )
            )
        else:
            findings.append(
                Finding(
                    "rabbitmq-queue",
                    "ok",
                    f"{name}: {len(members)} members online, leader {leader}",
                )
            )
    return findings
