"""A throwaway Redis Cluster on free loopback ports (3 masters, with or without a replica
each), stopped by PID afterwards; with replicas, a primary can be failed over to a replica
held back by a controlled lag."""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from redis.crc import key_slot

from tests.support.failover import Promotion, replication_offset
from tests.support.services import port_open

#: With replicas: a node that does not answer for this long is failing (the default, 15 s,
#: would make every failover take that long).
NODE_TIMEOUT_MS = 2000


def _cli(port: int, *args: str) -> str:
    return subprocess.run(
        ["redis-cli", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    ).stdout


@dataclass(frozen=True)
class ClusterNode:
    """One line of CLUSTER NODES."""

    node_id: str
    port: int
    master: bool
    master_id: str
    slots: frozenset[int]


def cluster_nodes(port: int) -> list[ClusterNode]:
    """The cluster as the node at ``port`` sees it (failed nodes left out)."""
    found = []
    for line in _cli(port, "CLUSTER", "NODES").splitlines():
        fields = line.split()
        if len(fields) < 8 or "fail" in fields[2].split(","):
            continue
        slots: set[int] = set()
        for part in fields[8:]:
            if part.startswith("["):
                continue  # a slot being migrated
            low, _, high = part.partition("-")
            slots.update(range(int(low), int(high or low) + 1))
        address = fields[1].split("@")[0]
        found.append(
            ClusterNode(
                fields[0],
                int(address.rsplit(":", 1)[1]),
                "master" in fields[2],
                fields[3],
                frozenset(slots),
            )
        )
    return found


@dataclass
class Cluster:
    ports: list[int]
    processes: list[subprocess.Popen[bytes]]
    #: The primary and the replica of a lagged failover (begin_lag, end_lag).
    _lagging: tuple[int, int, frozenset[int]] = field(init=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    @property
    def settings(self) -> dict[str, str]:
        """The services' Redis settings for this cluster."""
        return {"CRONBUS_REDIS_URL": self.url, "CRONBUS_REDIS_CLUSTER": "true"}

    def flushall(self) -> None:
        for port in self.ports:
            subprocess.run(
                ["redis-cli", "-p", str(port), "FLUSHALL"], check=True, capture_output=True
            )

    def process(self, port: int) -> subprocess.Popen[bytes]:
        return self.processes[self.ports.index(port)]

    def primary_to_fail(self, shards: int) -> tuple[int, int, frozenset[int]]:
        """(primary, its replica, the shards it holds): the primary, other than the node the
        URL names, that holds the most of cronbus's shards (each shard's keys share the hash
        tag ``{shard}``)."""
        nodes = cluster_nodes(self.ports[0])
        primaries = [n for n in nodes if n.master and n.port != self.ports[0]]

        def held(node: ClusterNode) -> frozenset[int]:
            return frozenset(s for s in range(shards) if key_slot(str(s).encode()) in node.slots)

        chosen = max(primaries, key=lambda n: len(held(n)))
        replica = next(n for n in nodes if n.master_id == chosen.node_id)
        return chosen.port, replica.port, held(chosen)

    def begin_lag(self, shards: int = 16) -> None:
        """The replica stops (SIGSTOP) and its primary drops the link: from now on the
        replica receives nothing (stopped alone, it would apply on SIGCONT what the kernel
        kept receiving meanwhile)."""
        self._lagging = self.primary_to_fail(shards)
        primary, replica, _ = self._lagging
        self.process(replica).send_signal(signal.SIGSTOP)
        _cli(primary, "CLIENT", "KILL", "TYPE", "replica")

    def end_lag(self, timeout_s: float = 40) -> Promotion:
        """Kill the primary while the replica is still stopped, let the replica go on and
        wait until the cluster has promoted it and every slot is served again. The replica
        stands for election although it was cut off (cluster-replica-validity-factor 0)."""
        primary, replica, held = self._lagging
        written = replication_offset(primary)
        self.process(primary).send_signal(signal.SIGKILL)
        self.process(primary).wait()
        killed_ms = time.time() * 1000
        self.process(replica).send_signal(signal.SIGCONT)
        behind = written - replication_offset(replica)
        started = time.monotonic()
        living = [p for p in self.ports if p != primary]
        while time.monotonic() - started < timeout_s:
            if _cli(replica, "ROLE").startswith("master") and all(_state_ok(p) for p in living):
                return Promotion(killed_ms, time.monotonic() - started, behind, held)
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not promote {replica} within {timeout_s:g}s")


#: The node ports and their bus ports (port + 10000, up to 32767) stay below Linux's
#: ephemeral range (32768-60999): a port there can be taken at any moment by a client
#: socket of the tests' own traffic, and the node then fails to bind it.
FIRST_PORT, LAST_PORT = 20_000, 22_767


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    while True:
        port = random.randint(FIRST_PORT, LAST_PORT)
        if not port_open("127.0.0.1", port, 0.2) and not port_open("127.0.0.1", port + 10_000, 0.2):
            return port


def _state_ok(port: int) -> bool:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "CLUSTER", "INFO"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return "cluster_state:ok" in out


def _replicas_synced(ports: list[int], replicas: int) -> bool:
    """Every replica known to the cluster and in sync with its primary."""
    if not replicas:
        return True
    nodes = cluster_nodes(ports[0])
    followers = [n.port for n in nodes if not n.master]
    return len(followers) == len(ports) - len(ports) // (1 + replicas) and all(
        "master_link_status:up" in _cli(port, "INFO", "replication") for port in followers
    )


@contextlib.contextmanager
def redis_cluster(masters: int = 3, replicas: int = 0) -> Iterator[Cluster]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RuntimeError("redis-server and redis-cli are needed for a Redis Cluster")
    directory = Path(tempfile.mkdtemp(prefix="cbt-cluster-"))
    ports = [_cluster_port() for _ in range(masters * (1 + replicas))]
    # With replicas, failures are noticed in seconds, and a replica cut off from its primary
    # for longer than that may still be promoted (its data may be behind: that is the test).
    failover = (
        ["--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-replica-validity-factor", "0"]
        if replicas
        else []
    )
    processes = []
    try:
        for port in ports:
            node = directory / str(port)
            node.mkdir()
            processes.append(
                subprocess.Popen(
                    [
                        "redis-server",
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(node / "nodes.conf"),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(node),
                        *failover,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 20
        while not all(port_open("127.0.0.1", p, 0.2) for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster nodes did not start")
            time.sleep(0.1)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        while not all(_state_ok(p) for p in ports) or not _replicas_synced(ports, replicas):
            if time.monotonic() > deadline + 30:
                raise RuntimeError("cluster did not reach state ok")
            time.sleep(0.2)
        yield Cluster(ports, processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()
        shutil.rmtree(directory, ignore_errors=True)
