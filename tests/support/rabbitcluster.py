"""A RabbitMQ cluster of three nodes on loopback ports, started for a test and stopped by PID.

Each node has its own node name, AMQP, distribution and management ports and its own data
directory; the second and third join the first (``join_cluster``). Quorum queues declared
once the three are joined have a member on each. ``kill`` ends a node with SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from tests.support.private import PrivateRabbit, _owned_dir, _wait_port
from tests.support.services import free_port


@dataclass
class ClusterNode(PrivateRabbit):
    management_port: int = 0

    def configure(self) -> None:
        (self.directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\n"
            "management.tcp.ip = 127.0.0.1\n"
            f"management.tcp.port = {self.management_port}\n"
        )
        (self.directory / "enabled_plugins").write_text("[rabbitmq_management].\n")

    def pid(self) -> int:
        return int((self.directory / "pid").read_text().strip())

    def kill(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            os.kill(self.pid(), signal.SIGKILL)


@dataclass
class RabbitCluster:
    nodes: list[ClusterNode]

    @property
    def setting(self) -> str:
        """CRONBUS_AMQP_URL: the three nodes, comma-separated."""
        return ",".join(node.url for node in self.nodes)

    def url_of(self, vhost: str) -> str:
        return ",".join(f"{node.url}{vhost}" for node in self.nodes)

    @property
    def management_url(self) -> str:
        return f"http://guest:guest@127.0.0.1:{self.nodes[0].management_port}/"

    def node_named(self, name: str) -> ClusterNode:
        (found,) = [n for n in self.nodes if n.node == name]
        return found

    def alive(self) -> list[ClusterNode]:
        return [n for n in self.nodes if _running(n)]

    def api(self, path: str) -> Any:
        """GET the management API of the first node that answers."""
        error: Exception | None = None
        for node in self.alive():
            request = urllib.request.Request(f"http://127.0.0.1:{node.management_port}{path}")
            request.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")  # guest:guest
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    return json.loads(response.read())
            except OSError as exc:
                error = exc
        raise RuntimeError(f"no management API answered: {error}")

    def leader_of(self, vhost: str, queue: str) -> str:
        found = self.api(f"/api/queues/{quote(vhost, safe='')}/{quote(queue, safe='')}")
        return str(found["leader"])

    def add_vhost(self, vhost: str) -> None:
        self.nodes[0].add_vhost(vhost)


def _running(node: ClusterNode) -> bool:
    try:
        os.kill(node.pid(), 0)
    except (OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def rabbit_cluster(size: int = 3) -> Iterator[RabbitCluster]:
    run = os.urandom(3).hex()
    nodes = [
        ClusterNode(
            free_port(),
            _owned_dir(f"cbt-rmqc{i}-", "rabbitmq"),
            f"cbc{i}{run}@localhost",
            management_port=free_port(),
        )
        for i in range(size)
    ]
    try:
        with ThreadPoolExecutor(size) as pool:
            list(pool.map(ClusterNode.start, nodes))
        first = nodes[0].node
        for node in nodes[1:]:
            node._ctl("stop_app")
            node._ctl("join_cluster", first)
            node._ctl("start_app")
            _wait_port(node.port, 60, "RabbitMQ")
        for node in nodes:
            _wait_port(node.management_port, 60, "RabbitMQ management")
        yield RabbitCluster(nodes)
    finally:
        for node in nodes:
            node.kill()
        time.sleep(0.5)
        for node in nodes:
            shutil.rmtree(node.directory, ignore_errors=True)
