"""Configuration from ``CRONBUS_*`` environment variables (pydantic-settings), per service.

The configuration reference (docs/configuration.md) is written from this module: each field's
``#:`` comment is its meaning there (``python -m cronbus.reference``; a test keeps them in step).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.contract import urls
from shared.contract.validation import TargetPolicy
from shared.policy import exchanges, netpolicy
from shared.rules import compact


def _csv(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


class CommonSettings(BaseSettings):
    """Settings every service reads."""

    model_config = SettingsConfigDict(env_prefix="CRONBUS_", extra="ignore", frozen=True)

    #: Redis (any node of a cluster when CRONBUS_REDIS_CLUSTER is set); rediss:// for TLS. With
    #: Sentinel, only its database number, credentials and scheme (TLS) are used.
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Talk to a Redis Cluster: each shard's keys share a hash tag, so scripts touch one slot.
    redis_cluster: bool = False
    #: Redis Sentinels, comma-separated host:port ([v6]:port for IPv6): every service asks them
    #: for the primary and follows its failovers. Needs CRONBUS_REDIS_SENTINEL_MASTER; empty:
    #: no Sentinel (CRONBUS_REDIS_URL names the server).
    redis_sentinels: str = ""
    #: The name the Sentinels monitor the primary under (sentinel monitor NAME ...).
    redis_sentinel_master: str = Field(default="", pattern=r"^[A-Za-z0-9_.:-]{0,128}$")
    #: Prefix of every Redis key (side-by-side installs and tests use their own).
    redis_prefix: str = Field(default="cronbus", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    #: CA bundle that signed the Redis server's certificate (rediss:// only); empty: the
    #: system's trust store. The hostname is always verified.
    redis_ca_file: str = ""
    #: RabbitMQ; amqps:// for TLS (with ?cafile=... for a private CA). The nodes of a cluster
    #: as several URLs separated by commas: a service connects to one (starting at random) and
    #: moves to the next when its node is lost (see High availability).
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    #: RabbitMQ's management API (HTTP), which cronbus doctor asks for the cluster's nodes and
    #: each quorum queue's members and leader; empty: doctor skips those checks.
    amqp_management_url: str = "http://guest:guest@127.0.0.1:15672/"
    #: PostgreSQL; add ?sslmode=verify-full (and sslrootcert=...) for TLS.
    database_url: str = "postgresql://postgres@127.0.0.1:5432/cronbus"
    #: Logical shards of the index; fixed at install (changing it needs a rebuild).
    shards: int = Field(default=16, ge=1, le=1024)
    #: How schedules are written to Redis and PostgreSQL: binary (msgpack, about half the
    #: bytes) or json, what versions before 2026-11-26 wrote and read. Both are always read;
    #: json is for the length of a rolling upgrade from such a version (see Upgrading).
    compact_form: compact.Form = "binary"
    #: Port of /metrics, /healthz and /readyz (0: any free port, logged at start).
    metrics_port: int = Field(default=9100, ge=0, le=65535)
    #: How long a claimed occurrence may stay in flight before the sweeper reclaims it.
    lease_s: float = Field(default=30, gt=0, le=3600)
    #: How often the sweeper reclaims expired leases and checks the index.
    sweep_interval_s: float = Field(default=5, gt=0, le=3600)
    #: How often each shard's position in Redis is compared with PostgreSQL's (the sweeper
    #: replays what an index that went back lacks) and dispatchers re-read which positions
    #: were answered (they claim nothing from a shard behind them). See Guarantees, invariant 9.
    position_check_s: float = Field(default=0.5, gt=0, le=60)
    #: On SIGTERM, the most time a service takes to stop, whatever is unreachable (see
    #: Guarantees).
    shutdown_grace_s: float = Field(default=20, ge=0, le=600)
    #: Apply pending database migrations when the service starts.
    migrate_on_start: bool = True
    #: OpenTelemetry collector (OTLP over HTTP, e.g. http://otel-collector:4318) that receives
    #: claim, publish, deliver and settle spans; empty: no export (and no cost). Needs
    #: pip install 'cronbus[otel]'.
    otlp_endpoint: str = ""
    #: DEBUG, INFO, WARNING or ERROR.
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    #: json: one JSON object per line; text: for people at a terminal.
    log_format: Literal["json", "text"] = "json"
    #: JSON file of per-namespace max_schedules and max_fires_per_s (see Quotas); empty: no
    #: quotas.
    quotas_file: str = ""
    #: Comma-separated exchange globs AMQP targets may publish to; {namespace} stands for the
    #: schedule's namespace. The default exchange (""), amq.* and cronbus.* are refused
    #: whatever this says. Checked at upsert, at every delivery and by cronbus doctor.
    amqp_allowed_exchanges: str = exchanges.DEFAULT

    @field_validator("redis_url", "amqp_url", "database_url")
    @classmethod
    def _ports_are_numbers(cls, value: str) -> str:
        # The drivers would fail at start with a traceback; the message must not repeat the
        # URL (it may hold a password).
        hosts = value.partition("://")[2].partition("/")[0].rpartition("@")[2]
        for host in hosts.split(","):  # PostgreSQL takes several hosts
            port = host.rpartition(":")[2] if ":" in host and not host.endswith("]") else ""
            if port and not (port.isdigit() and 0 < int(port) < 65536):
                raise ValueError("the port must be a number from 1 to 65535")
        return value

    @field_validator("amqp_url")
    @classmethod
    def _amqp_nodes_parse(cls, value: str) -> str:
        urls.amqp_urls(value)
        return value

    @field_validator("amqp_management_url")
    @classmethod
    def _management_url_parses(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https:// (or be empty)")
        return value

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinels_parse(cls, value: str) -> str:
        host_ports(value)
        return value

    @model_validator(mode="after")
    def _sentinel_pair(self) -> CommonSettings:
        # A model-level error names no single field: its message names the settings.
        if bool(self.redis_sentinels.strip()) != bool(self.redis_sentinel_master):
            raise ValueError(
                "CRONBUS_REDIS_SENTINELS and CRONBUS_REDIS_SENTINEL_MASTER go together: "
                "set both (Sentinel) or neither"
            )
        if self.redis_sentinel_master and self.redis_cluster:
            raise ValueError(
                "CRONBUS_REDIS_SENTINELS and CRONBUS_REDIS_CLUSTER exclude each other: a Redis "
                "Cluster fails over by itself"
            )
        return self

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """The Sentinels' (host, port), in the order given; empty without Sentinel."""
        return host_ports(self.redis_sentinels)

    def exchange_policy(self) -> exchanges.ExchangePolicy:
        return exchanges.ExchangePolicy.from_text(self.amqp_allowed_exchanges)


def host_ports(value: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` (``[v6]:port`` for IPv6) as pairs; ValueError naming the entry
    and what is wrong with it."""
    found = []
    for entry in _csv(value):
        host, colon, port = entry.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not colon or not host or any(c in host for c in "/@[] "):
            raise ValueError(f"{entry!r} is not host:port")
        if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"{entry!r}: the port must be a number from 1 to 65535")
        if ":" in host and not entry.startswith("["):
            raise ValueError(f"{entry!r}: write an IPv6 address in brackets, [{host}]:{port}")
        found.append((host, int(port)))
    return found


class WebhookPolicySettings(CommonSettings):
    """Where webhooks may go: checked at upsert (literal addresses, host globs) by the
    dispatcher, and at every delivery (every resolved address) by the executor."""

    #: Comma-separated host globs webhook targets may call.
    webhook_allowed_hosts: str = "*"
    #: Comma-separated CIDRs of restricted addresses (loopback, private, link-local, ...)
    #: webhooks may reach nevertheless; empty: none.
    webhook_allowed_networks: str = ""
    #: Comma-separated CIDRs webhooks may never reach, even when allowed above.
    webhook_denied_networks: str = ""

    @field_validator("webhook_allowed_networks", "webhook_denied_networks")
    @classmethod
    def _networks_parse(cls, value: str) -> str:
        netpolicy.parse_networks(_csv(value))
        return value

    def allowed_hosts(self) -> tuple[str, ...]:
        return _csv(self.webhook_allowed_hosts)

    def address_policy(self) -> netpolicy.AddressPolicy:
        return netpolicy.AddressPolicy.from_text(
            _csv(self.webhook_allowed_networks), _csv(self.webhook_denied_networks)
        )


class DispatcherSettings(WebhookPolicySettings):
    """The dispatcher service: command intake and claiming due occurrences."""

    metrics_port: int = Field(default=9101, ge=0, le=65535)
    #: Most occurrences one claim.lua call takes from a shard.
    claim_batch: int = Field(default=1000, ge=1, le=10_000)
    #: Most occurrences carried by one message on cronbus.deliveries.
    delivery_batch: int = Field(default=100, ge=1, le=1000)
    #: Stop claiming while cronbus.deliveries holds more ready messages than this: overload
    #: waits in Redis; a short queue is also cheaper for the broker to run.
    deliveries_high_water: int = Field(default=50, ge=1)
    #: Longest sleep between claims when nothing is due sooner.
    max_sleep_s: float = Field(default=1.0, gt=0, le=60)
    #: Shortest sleep between claims that took less than a full batch (ms): fires due within
    #: it go out together, in one message, instead of one claim and one message each. Adds
    #: at most this much lateness; 0 claims each as it comes due.
    claim_coalesce_ms: int = Field(default=5, ge=0, le=1000)
    #: Lease of a dispatcher on the shards it claims from; several dispatchers split the
    #: shards and a dead one's are taken over after this long (0: claim from every shard).
    shard_lease_s: float = Field(default=5, ge=0, le=300)
    #: Partitions of the command intake: commands on one schedule go to one partition, which
    #: one dispatcher at a time consumes, in order. Every dispatcher must use the same number;
    #: see docs/partitions.md before changing it on a running install.
    command_partitions: int = Field(default=8, ge=1, le=256)
    #: Unacknowledged commands the intake works on at once, per partition it consumes.
    commands_prefetch: int = Field(default=512, ge=1, le=10_000)
    #: Most upserts written in one PostgreSQL transaction (group commit).
    commands_batch: int = Field(default=500, ge=1, le=10_000)
    #: Group commits under way at once (each holds a PostgreSQL connection).
    commands_commit_workers: int = Field(default=2, ge=1, le=32)
    #: Replicas that must acknowledge a command's index writes before its reply (Redis WAIT;
    #: 0: do not wait). Makes a failover that undoes them rare; the positions make it harmless
    #: either way (see Guarantees, invariant 9). Not used with CRONBUS_REDIS_CLUSTER.
    redis_wait_replicas: int = Field(default=0, ge=0, le=16)
    #: How long a reply waits for those replicas at most (ms); it is sent after that anyway.
    redis_wait_timeout_ms: int = Field(default=100, ge=1, le=60_000)
    #: Largest command body accepted; a larger one is refused with code too_large.
    max_command_bytes: int = Field(default=262_144, ge=1024, le=64 * 1024 * 1024)
    #: Largest JSON body a target may carry.
    max_body_bytes: int = Field(default=65_536, ge=0)

    def target_policy(self) -> TargetPolicy:
        return TargetPolicy(
            allowed_hosts=_csv(self.webhook_allowed_hosts),
            denied_networks=_csv(self.webhook_denied_networks),
            allowed_networks=_csv(self.webhook_allowed_networks),
            allowed_exchanges=self.exchange_policy().globs,
            max_body_bytes=self.max_body_bytes,
        )


class ExecutorSettings(WebhookPolicySettings):
    """The executor service: delivering occurrences and rescheduling the next ones."""

    metrics_port: int = Field(default=9102, ge=0, le=65535)
    #: Delivery messages held unacknowledged at once.
    prefetch: int = Field(default=64, ge=1, le=65_535)
    #: Deliveries (HTTP calls or publishes) in flight at once.
    concurrency: int = Field(default=512, ge=1, le=100_000)
    #: Webhook calls in flight per host (each on its own keep-alive connection).
    http_connections_per_host: int = Field(default=256, ge=1)
    #: Webhook calls in flight, and idle keep-alive connections kept, across all hosts.
    http_connections_total: int = Field(default=1024, ge=1)
    #: An idle keep-alive connection is closed after this long.
    http_idle_s: float = Field(default=15, gt=0, le=3600)
    #: JSON file: namespace (or "*") -> list of "whsec_..." secrets webhooks are signed with
    #: (Standard Webhooks); re-read when it changes. Empty: deliveries are not signed.
    signing_secrets_file: str = ""
    #: Directory of secrets named by target.secret_headers: <dir>/<namespace>/<name>.
    secrets_dir: str = ""
    #: Longest wait before completions and retries are written to Redis in a batch: they
    #: come after the delivery, so a longer wait shares each round trip among more of them
    #: (a steady load's CPU) at no lateness. The fencing and rate calls before a delivery
    #: wait at most 5 ms of it.
    complete_flush_ms: int = Field(default=20, ge=0, le=10_000)
    #: Longest wait before execution rows are written to PostgreSQL in a batch.
    audit_flush_ms: int = Field(default=500, ge=1, le=60_000)
    #: Execution rows kept in memory while PostgreSQL is away; when full, delivering pauses
    #: (nothing is dropped).
    audit_buffer_max: int = Field(default=200_000, ge=1000)
    #: Which outcomes go to cronbus.events: all, failures (failed, dead, paused) or none.
    events: Literal["all", "failures", "none"] = "all"
    #: Longest hold a Retry-After (of a 429 or 503) puts on its rate key; also the longest
    #: delay a Retry-After gives the next attempt.
    max_retry_after_s: float = Field(default=3600, ge=0, le=86_400)
    #: Consecutive failed attempts to a rate key that open its circuit breaker.
    breaker_failures: int = Field(default=20, ge=1, le=1_000_000)
    #: How long an open breaker holds its rate key before one probe is let through.
    breaker_cooldown_s: float = Field(default=30, gt=0, le=86_400)
    #: How long past its rate key's wake a parked delivery comes due by itself should no
    #: executor release it (each one's own time differs by up to a tenth either way): the
    #: cost of a target down for hours is one hold per parked delivery per this long.
    park_safety_s: float = Field(default=900, ge=1, le=86_400)
    #: Namespaces that get their own label in per-namespace metrics; the rest are 'other'.
    metrics_max_namespaces: int = Field(default=100, ge=0, le=10_000)


class SweeperSettings(CommonSettings):
    """The sweeper service: reclaiming leases, rebuilding the index, drift repair, retention."""

    metrics_port: int = Field(default=9103, ge=0, le=65535)
    #: Most leases one reclaim.lua call takes from a shard.
    reclaim_batch: int = Field(default=1000, ge=1, le=100_000)
    #: Schedules written to Redis per pipeline during a rebuild.
    rebuild_batch: int = Field(default=2000, ge=1, le=100_000)
    #: Longest wait of a rebuild for the live executors to write the completions Redis had
    #: acknowledged before it lost its data (the audit barrier), before it reads PostgreSQL.
    rebuild_audit_wait_s: float = Field(default=10, ge=0, le=300)
    #: How often schedules changed recently are compared between PostgreSQL and the index.
    drift_check_interval_s: float = Field(default=30, gt=0)
    #: Everything compared both ways within this long: a rolling pass, each drift check
    #: comparing the next slice (entries / (this / check interval), at least 2000) of rows and
    #: of index entries, so no check is a burst.
    drift_full_interval_s: float = Field(default=900, gt=0)
    #: Executions older than this many days are dropped (a whole day partition at a time).
    retention_days: int = Field(default=7, ge=1, le=3650)
    #: Daily execution partitions created ahead of time.
    partitions_ahead_days: int = Field(default=3, ge=1, le=60)


class ConsoleSettings(CommonSettings):
    """The console: web pages over PostgreSQL and Redis, and (optionally) actions as commands."""

    metrics_port: int = Field(default=9104, ge=0, le=65535)
    #: Port of the web pages (the health server stays on metrics_port).
    console_port: int = Field(default=8080, ge=0, le=65535)
    #: Address the pages listen on.
    console_host: str = "0.0.0.0"
    #: Show the action buttons (pause, resume, trigger, backfill, delete, edit, retry, bulk) and
    #: accept them, sent as commands. Off by default; ``cronbus dev`` turns it on.
    console_actions: bool = False
    #: The console's own broker user for actions, so broker permissions apply to it
    #: (empty: CRONBUS_AMQP_URL).
    console_amqp_url: str = ""
    #: Rows per page of schedules, executions and failures.
    console_page_size: int = Field(default=50, ge=1, le=500)

    def actions_amqp_url(self) -> str:
        return self.console_amqp_url or self.amqp_url
