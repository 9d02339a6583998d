"""Every Redis client cronbus makes, from the settings: a standalone server, a Redis Cluster,
or the primary that Redis Sentinel names.

With Sentinel (CRONBUS_REDIS_SENTINELS and CRONBUS_REDIS_SENTINEL_MASTER), each new
connection asks the Sentinels where the primary is; CRONBUS_REDIS_URL gives the database
number, the credentials and TLS (its host and port are not used). During a failover the
connections fail with ``redis.exceptions.ConnectionError`` (``MasterNotFoundError`` while no
primary is known, "the previous master is now a slave" from a demoted one): the same errors as
a Redis outage, which every service waits out (``shared.runtime.transient``) and then finds the
new primary. Scripts the new primary does not know are loaded again on NOSCRIPT
(``shared.redis.lua``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import NodesManager, RedisCluster
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.redis.errors import ClusterUnavailable
from shared.runtime.config import CommonSettings

RedisClient = aioredis.Redis | RedisCluster

#: A Sentinel that does not answer is skipped for the next one after this long.
SENTINEL_TIMEOUT_S = 1.0


class _HiredisPacking:
    """Packs commands with hiredis (C) instead of redis-py's Python packer: the scripts take
    thousands of arguments per call, and packing them was a tenth of a bulk import's time."""

    def pack_command(self, *args: Any) -> list[bytes]:
        first = args[0]
        if isinstance(first, str) and " " in first:
            args = (*first.split(), *args[1:])  # "SCRIPT LOAD" goes as two words
        return [hiredis.pack_command(args)]


class _ClosedWritesFail:
    """A write on a connection the server (or the network) closed fails as a ConnectionError.

    redis-py 8 lets such a write leak the transport's own error: uvloop's RuntimeError ("the
    handler is closed"), an AttributeError once the connection dropped its writer, CPython's
    TypeError (redis/redis-py#4287). Those pass every retry (redis-py's and ours) and stopped
    the services' background tasks during Redis failovers; a ConnectionError is waited out
    like any outage. The transport's state decides, never the error's wording."""

    _writer: asyncio.StreamWriter | None

    async def _send_packed_command(self, command: Iterable[bytes]) -> None:
        writer = self._writer
        if writer is None or writer.transport is None or writer.transport.is_closing():
            raise RedisConnectionError("Error while writing to socket: the connection is closed")
        try:
            writer.writelines(command)
            await writer.drain()
        except (AttributeError, RuntimeError, TypeError) as error:
            if self._writer is writer and not writer.transport.is_closing():
                raise
            raise RedisConnectionError(
                "Error while writing to socket: the connection closed meanwhile"
            ) from error


class SafeConnection(_ClosedWritesFail, aioredis.Connection):
    """A plain connection (pub/sub and the tools' reads)."""


class SafeSSLConnection(_ClosedWritesFail, SSLConnection):
    """A TLS connection."""


class SafeUnixConnection(_ClosedWritesFail, UnixDomainSocketConnection):
    """A connection over a Unix socket (a unix:// URL)."""


class FastConnection(_HiredisPacking, SafeConnection):
    """A plain connection with hiredis packing."""


class FastSentinelConnection(_HiredisPacking, _ClosedWritesFail, SentinelManagedConnection):
    """A connection to the primary Sentinel names, with hiredis packing."""


class SafeSentinelConnection(_ClosedWritesFail, SentinelManagedConnection):
    """A connection to the primary Sentinel names (pub/sub and the tools' reads)."""


class SentinelSSLConnection(_ClosedWritesFail, SentinelManagedConnection, SSLConnection):
    """A TLS connection to the primary Sentinel names."""


class SentinelRedis(aioredis.Redis):
    """The primary's client; closing it closes the connections to the Sentinels as well."""

    sentinels: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinels is not None:
            await self.sentinels.aclose()


def tls_options(settings: CommonSettings) -> dict[str, Any]:
    """For a rediss:// URL (its scheme picks redis-py's SSL connection): the certificate and
    the hostname are verified, against CRONBUS_REDIS_CA_FILE when one is given."""
    if urlsplit(settings.redis_url).scheme != "rediss":
        return {}
    options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    if settings.redis_ca_file:
        options["ssl_ca_certs"] = settings.redis_ca_file
    return options


def _client_options() -> dict[str, Any]:
    return {"socket_timeout": 10, "socket_connect_timeout": 5, "health_check_interval": 15}


def connect(settings: CommonSettings) -> RedisClient:
    """The index's client (standalone, cluster, or Sentinel's primary); it reconnects by
    itself."""
    options = {**_client_options(), **tls_options(settings)}
    if settings.redis_sentinel_master:
        return _sentinel_primary(settings, options, fast=True)
    options["connection_class"] = FastConnection  # the URL's scheme wins (rediss: TLS)
    if settings.redis_cluster:
        return _cluster_client(RedisCluster.from_url(settings.redis_url, **options))
    return _closed_writes_fail(
        aioredis.Redis.from_url(settings.redis_url, retry_on_timeout=True, **options)
    )


def _closed_writes_fail(client: aioredis.Redis) -> aioredis.Redis:
    """The client's connections, TLS ones included (a rediss:// URL picks redis-py's own
    class over the one given), fail a write on a closed connection as a ConnectionError."""
    pool = client.connection_pool
    if pool.connection_class is SSLConnection:
        pool.connection_class = SafeSSLConnection
    elif pool.connection_class is aioredis.Connection:
        pool.connection_class = SafeConnection
    elif pool.connection_class is UnixDomainSocketConnection:
        pool.connection_class = SafeUnixConnection
    return client


def _cluster_client(client: RedisCluster) -> RedisCluster:
    """The cluster's node connections fail a write on a closed connection as a
    ConnectionError, and a refresh of its layout that fails for an outage raises
    ClusterUnavailable. RedisCluster takes neither a connection class (its from_url drops
    the one given) nor a class for its NodesManager: every node it learns of later copies the
    shared connection_kwargs, the startup nodes, made already, are told here, and the manager
    it made takes on a subclass that adds behaviour only, no state."""
    tls = client.connection_kwargs.get("connection_class") is SSLConnection
    safe: type[aioredis.Connection] = SafeSSLConnection if tls else FastConnection
    client.connection_kwargs["connection_class"] = safe
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = safe
    client.nodes_manager.__class__ = _OutageAwareNodes
    return client


def cluster_outage(error: RedisClusterException) -> bool:
    """Whether redis-py's refresh of the cluster's layout failed because the cluster is away
    for now: no node answered (the error is raised from a connection error), some slots have
    no primary, or the nodes disagree on the slots (a failover under way; redis-py says these
    two only in words). Other refusals of that kind (a node not in cluster mode) are the
    operator's to fix."""
    reached: BaseException | None = error.__cause__
    if isinstance(reached, (RedisConnectionError, RedisTimeoutError, OSError)):
        return True
    said = str(error)
    return said.startswith("All slots are not covered") or "could not agree" in said


class _OutageAwareNodes(NodesManager):
    """A refresh of the layout that fails for an outage raises ClusterUnavailable, which the
    services wait out; redis-py raises a bare RedisClusterException, which stopped them
    during a failover (all slots not covered for a moment) or a whole cluster's restart."""

    __slots__ = ()

    async def initialize(
        self,
        additional_startup_nodes_info: list[tuple[str, int]] | None = None,
        last_failed_node_name: str | None = None,
    ) -> None:
        try:
            await super().initialize(additional_startup_nodes_info, last_failed_node_name)
        except RedisClusterException as error:
            if not cluster_outage(error):
                raise
            raise ClusterUnavailable(f"Redis Cluster unavailable: {error}") from error


def connect_node(settings: CommonSettings) -> aioredis.Redis:
    """A plain client of one server: the primary Sentinel names, else the URL's node (of a
    cluster too). For pub/sub (a cluster node relays it) and the tools' own reads."""
    options = {**_client_options(), **tls_options(settings)}
    if settings.redis_sentinel_master:
        return _sentinel_primary(settings, options, fast=False)
    return _closed_writes_fail(aioredis.Redis.from_url(settings.redis_url, **options))


def sentinel_url_options(url: str) -> dict[str, Any]:
    """What CRONBUS_REDIS_URL gives a Sentinel-found primary: database, credentials, query
    options, TLS (``ssl``); its host and port are Sentinel's to tell."""
    options: dict[str, Any] = dict(parse_url(url))
    for name in ("host", "port", "connection_class", "path"):
        options.pop(name, None)
    options["ssl"] = urlsplit(url).scheme == "rediss"
    return options


def _sentinel_primary(
    settings: CommonSettings, options: dict[str, Any], *, fast: bool
) -> SentinelRedis:
    url_options = sentinel_url_options(settings.redis_url)
    tls = url_options.pop("ssl")
    # The Sentinels are reached as the servers are (TLS or not), without the servers'
    # credentials: a Sentinel has its own.
    sentinel_options: dict[str, Any] = {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        **tls_options(settings),
    }
    if tls:
        sentinel_options["ssl"] = True
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        settings.sentinel_addresses(), sentinel_kwargs=sentinel_options
    )
    for asked in sentinel.sentinels:
        _closed_writes_fail(asked)  # the Sentinels' own connections
    if tls:
        connection_class: type[SentinelManagedConnection] = SentinelSSLConnection
    else:
        connection_class = FastSentinelConnection if fast else SafeSentinelConnection
    client: SentinelRedis = sentinel.master_for(
        settings.redis_sentinel_master,
        redis_class=SentinelRedis,
        connection_class=connection_class,
        retry_on_timeout=True,
        **url_options,
        **options,
    )
    client.sentinels = sentinel
    return client
