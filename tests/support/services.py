"""Where the tests find Redis, RabbitMQ and PostgreSQL, and how each test gets its own corner.

Defaults are the local services; ``CRONBUS_TEST_REDIS_URL``, ``CRONBUS_TEST_AMQP_URL`` and
``CRONBUS_TEST_DATABASE_URL`` point elsewhere. When a default is not answering and Docker is
available, testcontainers starts the service instead. Isolation: a key prefix per test in
Redis, a vhost per test in RabbitMQ, a database per test in PostgreSQL.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import random
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

HOW_TO_START = {
    "redis": "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save '' "
    "--appendonly no",
    "amqp": "rabbitmq-server -detached",
    "postgres": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
}


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections for as long as the block runs: a socket bound
    to it without listening holds it, so no other process (the other pytest worker's servers
    included) can start listening there meanwhile."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port: int = holder.getsockname()[1]
        yield port


#: Ports for services that bind them some time after the test picks them. They stay below
#: Linux's ephemeral range (32768-60999), where the other pytest worker's client sockets and
#: free_port() keep taking ports, and apart from the Redis Cluster nodes' (support/cluster.py).
QUIET_FIRST, QUIET_LAST = 23_000, 29_999


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def quiet_ports(count: int) -> int:
    """The first of ``count`` consecutive ports, all free now, outside the ephemeral range."""
    rng = random.Random()
    while True:
        first = rng.randint(QUIET_FIRST, QUIET_LAST - count)
        if all(_bindable(first + i) for i in range(count)):
            return first


@dataclass
class Endpoints:
    redis_url: str
    amqp_url: str
    database_url: str
    #: Runs rabbitmqctl (locally, or inside the RabbitMQ container).
    rabbitmqctl: list[str]


def _answering(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    return port_open(parts.hostname or "127.0.0.1", parts.port or default_port)


@contextlib.contextmanager
def endpoints() -> Iterator[Endpoints]:
    """The services for this test session (local, configured, or started in containers)."""
    redis_url = os.environ.get("CRONBUS_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    amqp_url = os.environ.get("CRONBUS_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    database_url = os.environ.get(
        "CRONBUS_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
    )
    with contextlib.ExitStack() as stack:
        checks = (
            ("redis", redis_url, 6379),
            ("amqp", amqp_url, 5672),
            ("postgres", database_url, 5432),
        )
        down = [name for name, url, port in checks if not _answering(url, port)]
        if down and shutil.which("docker") and _docker_works():
            started = _start_containers(stack, down)
            redis_url = started.get("redis", redis_url)
            amqp_url = started.get("amqp", amqp_url)
            database_url = started.get("postgres", database_url)
            down = []
        if down:
            hints = "; ".join(f"{name}: {HOW_TO_START[name]}" for name in down)
            raise RuntimeError(f"test services not answering: {', '.join(down)}. Start: {hints}")
        yield Endpoints(redis_url, amqp_url, database_url, ["rabbitmqctl", "-q"])


def _docker_works() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def _start_containers(stack: contextlib.ExitStack, names: list[str]) -> dict[str, str]:
    """Start the missing services with testcontainers (only where Docker runs)."""
    started = {}
    if "redis" in names:
        from testcontainers.redis import RedisContainer  # noqa: PLC0415

        redis = stack.enter_context(RedisContainer("redis:7"))
        started["redis"] = f"redis://{redis.get_container_host_ip()}:{redis.get_exposed_port(6379)}"
    if "postgres" in names:
        from testcontainers.postgres import PostgresContainer  # noqa: PLC0415

        pg = stack.enter_context(PostgresContainer("postgres:16", driver=None))
        started["postgres"] = pg.get_connection_url()
    if "amqp" in names:
        from testcontainers.rabbitmq import RabbitMqContainer  # noqa: PLC0415

        rabbit = stack.enter_context(RabbitMqContainer("rabbitmq:3.13"))
        host, port = rabbit.get_container_host_ip(), rabbit.get_exposed_port(5672)
        started["amqp"] = f"amqp://guest:guest@{host}:{port}/"
    return started


def with_vhost(amqp_url: str, vhost: str) -> str:
    parts = urlsplit(amqp_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + quote(vhost, safe=""), "", ""))


def with_database(database_url: str, name: str) -> str:
    parts = urlsplit(database_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


#: How long one ``rabbitmqctl`` call may take. A broker busy deleting a vhost can leave the
#: CLI waiting for many minutes; a bounded call fails its one test (adding) or leaves the vhost
#: behind (deleting) instead of holding up every test that waits for the pool's thread.
CTL_TIMEOUT_S = 90


def add_vhost(ctl: list[str], vhost: str, user: str = "guest") -> None:
    subprocess.run(
        [*ctl, "add_vhost", vhost], check=True, capture_output=True, timeout=CTL_TIMEOUT_S
    )
    subprocess.run(
        [*ctl, "set_permissions", "-p", vhost, user, ".*", ".*", ".*"],
        check=True,
        capture_output=True,
        timeout=CTL_TIMEOUT_S,
    )


def delete_vhost(ctl: list[str], vhost: str) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(
            [*ctl, "delete_vhost", vhost], check=False, capture_output=True, timeout=CTL_TIMEOUT_S
        )


class VhostPool:
    """Fresh RabbitMQ vhosts made ahead of need and deleted behind, on a thread of their own.

    Each ``rabbitmqctl`` call starts an Erlang VM (a second or two on a busy machine); three
    per test added minutes to the suite, spent waiting. Every vhost is still new, unique and
    used by one test only: only the waiting moves off the test's path.
    """

    _ADD, _DELETE, _STOP = 0, 1, 2

    def __init__(self, ctl: list[str], prefix: str = "cronbus-t-", ahead: int = 1) -> None:
        self._ctl = ctl
        self._prefix = prefix
        self._ahead = ahead
        self._ready: queue.Queue[str | BaseException] = queue.Queue()
        # Creations before deletions: a test may be waiting for the next vhost.
        self._jobs: queue.PriorityQueue[tuple[int, int, str]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._worker: threading.Thread | None = None

    def _put(self, kind: int, vhost: str = "") -> None:
        self._jobs.put((kind, next(self._order), vhost))

    def _work(self) -> None:
        while True:
            kind, _, vhost = self._jobs.get()
            if kind == self._STOP:
                return
            if kind == self._DELETE:
                delete_vhost(self._ctl, vhost)
                continue
            try:
                add_vhost(self._ctl, vhost)
            except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                self._ready.put(exc)
            else:
                self._ready.put(vhost)

    def take(self, timeout_s: float = 120) -> str:
        """A vhost of the caller's own, with the guest user's permissions."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="vhost-pool", daemon=True)
            self._worker.start()
            for _ in range(self._ahead):
                self._put(self._ADD, unique(self._prefix))
        self._put(self._ADD, unique(self._prefix))
        found = self._ready.get(timeout=timeout_s)
        if isinstance(found, BaseException):
            raise RuntimeError(f"rabbitmqctl could not add a vhost: {found!r}") from found
        return found

    def give_back(self, vhost: str) -> None:
        """Delete ``vhost`` (later, on the pool's thread)."""
        self._put(self._DELETE, vhost)

    def close(self) -> None:
        """Finish every pending deletion and delete the vhosts made ahead but never taken."""
        if self._worker is None:
            return
        self._put(self._STOP)
        self._worker.join()
        while not self._ready.empty():
            left = self._ready.get_nowait()
            if isinstance(left, str):
                delete_vhost(self._ctl, left)
