"""Every Prometheus metric cronbus exports, declared once. Labels stay low-cardinality:
never a schedule id or a namespace, only kinds, outcomes, verbs, shards and dependencies."""

from __future__ import annotations

import contextlib

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

#: Seconds; fire lateness spans milliseconds (steady state) to minutes (outage recovery).
LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# --- dispatcher ---------------------------------------------------------------------------
CLAIMED = Counter("cronbus_claimed_total", "Occurrences claimed from the due index.")
PUBLISHED = Counter(
    "cronbus_published_total", "Occurrences published to cronbus.deliveries (confirmed)."
)
DELIVERY_MESSAGES = Counter(
    "cronbus_delivery_messages_total", "Messages published to cronbus.deliveries (confirmed)."
)
PUBLISH_FAILURES = Counter(
    "cronbus_publish_failures_total", "Occurrences whose publish failed and were released."
)
ORPHANS = Counter(
    "cronbus_orphans_total", "Due entries dropped because their schedule no longer exists."
)
SIBLING_WAITS = Counter(
    "cronbus_sibling_waits_total",
    "Due entries put back a moment because another occurrence of their schedule (regular or "
    "backfill) was in flight.",
)
BACKPRESSURE = Gauge(
    "cronbus_backpressure", "1 while claiming is paused because cronbus.deliveries is too full."
)
DELIVERIES_READY = Gauge(
    "cronbus_deliveries_ready", "Ready messages in cronbus.deliveries at the last check."
)
DUE_BACKLOG = Gauge(
    "cronbus_due_backlog", "Occurrences due now or earlier still waiting in a shard.", ["shard"]
)
SHARDS_OWNED = Gauge("cronbus_shards_owned", "Shards this dispatcher claims from.")
PARTITIONS_OWNED = Gauge(
    "cronbus_command_partitions_owned", "Commands partitions this dispatcher consumes."
)
COMMANDS_ROUTED = Counter(
    "cronbus_commands_routed_total",
    "Commands the active router moved from cronbus.commands to their partitions, by how: "
    "whole, or split (an upsert_many over several partitions).",
    ["how"],
)
ROUTER_ACTIVE = Gauge(
    "cronbus_command_router_active", "1 while this dispatcher routes cronbus.commands."
)

# --- intake -------------------------------------------------------------------------------
COMMANDS = Counter(
    "cronbus_commands_total", "Commands handled, by verb and outcome.", ["verb", "outcome"]
)
DEAD_LETTERED = Counter(
    "cronbus_dead_lettered_total", "Messages sent to a dead-letter queue.", ["queue"]
)
COMMAND_BATCH = Histogram(
    "cronbus_command_batch_size",
    "Upserts written per group commit (one PostgreSQL transaction).",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
REPLY_TO_REFUSED = Counter(
    "cronbus_reply_to_refused_total",
    "Commands refused unanswered (dead-lettered): reply_to was not direct reply-to, a "
    "server-named queue or a queue exclusive to a connection; or the broker could not place "
    "a direct reply-to token.",
)

# --- executor -----------------------------------------------------------------------------
DELIVERED = Counter(
    "cronbus_delivered_total",
    "Delivery attempts by target kind and outcome (succeeded, failed, dead).",
    ["target", "outcome"],
)
WEBHOOK_REFUSED = Counter(
    "cronbus_webhook_refused_total",
    "Webhook attempts refused: the host resolved to an address not allowed, or the host "
    "is not in CRONBUS_WEBHOOK_ALLOWED_HOSTS.",
)
AMQP_TARGET_REFUSED = Counter(
    "cronbus_amqp_target_refused_total",
    "AMQP deliveries refused, nothing published: the exchange is not allowed for the "
    "schedule's namespace (CRONBUS_AMQP_ALLOWED_EXCHANGES, or reserved), per namespace "
    "(bounded by CRONBUS_METRICS_MAX_NAMESPACES).",
    ["namespace"],
)
RETRIES = Counter("cronbus_retries_total", "Occurrences put back for another attempt.")
BACKFILL_DELIVERED = Counter(
    "cronbus_backfill_delivered_total",
    "Backfill delivery attempts by outcome (succeeded, failed, dead); also counted in "
    "cronbus_delivered_total.",
    ["outcome"],
)
DEAD = Counter("cronbus_dead_total", "Occurrences that failed every attempt.")
STALE = Counter(
    "cronbus_stale_total",
    "Occurrences skipped because their token was no longer current, by stage.",
    ["stage"],
)
MISFIRES = Counter(
    "cronbus_misfires_total", "Missed occurrences handled by their misfire policy.", ["policy"]
)
FIRE_LATENESS = Histogram(
    "cronbus_fire_lateness_seconds",
    "Start of an occurrence's first delivery attempt minus its due time (nominal plus jitter); "
    "backfills excluded.",
    buckets=LATENESS_BUCKETS,
)
DELIVERY_DURATION = Histogram(
    "cronbus_delivery_duration_seconds",
    "Time one delivery attempt took, by target kind.",
    ["target"],
    buckets=DURATION_BUCKETS,
)
IN_FLIGHT = Gauge("cronbus_deliveries_in_flight", "Deliveries in progress in this executor.")
AUDIT_BUFFERED = Gauge(
    "cronbus_audit_buffered_rows", "Execution rows waiting to be written to PostgreSQL."
)
AUDIT_WRITTEN = Counter("cronbus_audit_rows_written_total", "Execution rows written.")
EVENTS = Counter("cronbus_events_total", "Events published to cronbus.events.", ["outcome"])
NAMESPACE_OUTCOMES = Counter(
    "cronbus_namespace_outcomes_total",
    "Occurrence outcomes per namespace: succeeded, failed (an attempt), dead, skipped, "
    "excluded. Namespaces past CRONBUS_METRICS_MAX_NAMESPACES count as 'other'.",
    ["namespace", "outcome"],
)
AUTO_PAUSED = Counter(
    "cronbus_auto_paused_total",
    "Schedules paused by pause_after_failures, per namespace (bounded as above).",
    ["namespace"],
)

RATE_WAITS = Counter(
    "cronbus_rate_waits_total",
    "Deliveries that waited for a reserved slot of their rate limit, per namespace.",
    ["namespace"],
)
RATE_HELD = Counter(
    "cronbus_rate_held_total",
    "Occurrences held back by their rate key (Retry-After hold, open breaker, or a "
    "rate limit far ahead) and parked until it can let them through, per namespace; their "
    "attempt is kept.",
    ["namespace"],
)
RATE_RELEASED = Counter(
    "cronbus_rate_released_total",
    "Parked occurrences released back into due because their rate key's gate could let them "
    "through (the hold or cooldown ended, a probe, the breaker closed, or free slots).",
)
BREAKER_TRANSITIONS = Counter(
    "cronbus_breaker_transitions_total",
    "Circuit breakers of rate keys opened or closed, per namespace and new state.",
    ["namespace", "state"],
)


class NamespaceLabels:
    """Bounded label values for namespaces: the first ``limit`` namespaces seen keep their
    name, the rest are 'other', so a tenant creating namespaces cannot blow up the series."""

    OTHER = "other"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.named: set[str] = set()

    def __call__(self, namespace: str) -> str:
        if namespace in self.named:
            return namespace
        if len(self.named) < self.limit and namespace != self.OTHER:
            self.named.add(namespace)
            return namespace
        return self.OTHER


#: Set from CRONBUS_METRICS_MAX_NAMESPACES when the executor starts.
NAMESPACES = NamespaceLabels(100)

# --- sweeper ------------------------------------------------------------------------------
RECLAIMED = Counter("cronbus_reclaimed_total", "Expired leases put back into due.")
REBUILDS = Counter("cronbus_rebuilds_total", "Index rebuilds from PostgreSQL completed.")
REBUILD_PROGRESS = Gauge(
    "cronbus_rebuild_schedules", "Schedules written by the rebuild in progress (0 when idle)."
)
REBUILD_DURATION = Gauge(
    "cronbus_rebuild_duration_seconds", "How long the last completed rebuild took."
)
REBUILD_RUNNING = Gauge("cronbus_rebuild_running", "1 while a rebuild is in progress.")
REBUILD_AUDIT_WAIT = Gauge(
    "cronbus_rebuild_audit_wait_seconds",
    "How long the last rebuild waited for the executors' audit writes before reading PostgreSQL.",
)
STALE_INDEX = Counter(
    "cronbus_stale_index_total",
    "Indexes found behind PostgreSQL's generation (restored from an older snapshot) and rebuilt.",
)
STALE_INDEX_WAITS = Counter(
    "cronbus_stale_index_waits_total",
    "Claim rounds skipped because the index generation went back (an older snapshot restored).",
)
FENCED_CLAIMS = Counter(
    "cronbus_fenced_claims_total",
    "Claims refused because the shard's position in Redis is behind a command already answered "
    "(a failover to a lagging replica, an older snapshot): until the sweeper replays it.",
)
POSITION_REPLAYS = Counter(
    "cronbus_position_replays_total",
    "Shards whose index lacked changes PostgreSQL committed, brought up to date by replaying "
    "exactly the rows changed after their position.",
)
POSITION_REPLAYED_ROWS = Counter(
    "cronbus_position_replayed_rows_total",
    "Schedules re-indexed by position replays.",
)
TOMBSTONES_TRIMMED = Counter(
    "cronbus_tombstones_trimmed_total",
    "Tombstones of deleted or finished schedules dropped once PostgreSQL agreed with them.",
)
INDEX_EPOCH_PRESENT = Gauge(
    "cronbus_index_epoch_present", "1 when the index is complete (cronbus:meta:epoch is set)."
)
DRIFT_REPAIRED = Counter(
    "cronbus_drift_repaired_total",
    "Index entries repaired from PostgreSQL, by kind (stale, missing, orphan, pending, backfill).",
    ["kind"],
)
PARTITIONS_DROPPED = Counter(
    "cronbus_partitions_dropped_total", "Execution partitions dropped by retention."
)

# --- every service ------------------------------------------------------------------------
DEPENDENCY_UP = Gauge(
    "cronbus_dependency_up", "1 when the dependency answered its last check.", ["dependency"]
)


#: The metrics each service exports (the others are left out of its /metrics).
OWNERS: dict[str, tuple[object, ...]] = {
    "dispatcher": (
        CLAIMED,
        PUBLISHED,
        DELIVERY_MESSAGES,
        PUBLISH_FAILURES,
        ORPHANS,
        SIBLING_WAITS,
        BACKPRESSURE,
        DELIVERIES_READY,
        DUE_BACKLOG,
        SHARDS_OWNED,
        PARTITIONS_OWNED,
        COMMANDS_ROUTED,
        ROUTER_ACTIVE,
        COMMANDS,
        DEAD_LETTERED,
        REPLY_TO_REFUSED,
        COMMAND_BATCH,
        STALE_INDEX_WAITS,
        FENCED_CLAIMS,
        DEPENDENCY_UP,
    ),
    "executor": (
        DELIVERED,
        AMQP_TARGET_REFUSED,
        BACKFILL_DELIVERED,
        RETRIES,
        DEAD,
        STALE,
        MISFIRES,
        FIRE_LATENESS,
        DELIVERY_DURATION,
        IN_FLIGHT,
        AUDIT_BUFFERED,
        AUDIT_WRITTEN,
        EVENTS,
        NAMESPACE_OUTCOMES,
        AUTO_PAUSED,
        RATE_WAITS,
        RATE_HELD,
        RATE_RELEASED,
        BREAKER_TRANSITIONS,
        DEAD_LETTERED,
        DEPENDENCY_UP,
    ),
    "sweeper": (
        RECLAIMED,
        REBUILDS,
        REBUILD_PROGRESS,
        REBUILD_DURATION,
        REBUILD_RUNNING,
        REBUILD_AUDIT_WAIT,
        INDEX_EPOCH_PRESENT,
        STALE_INDEX,
        TOMBSTONES_TRIMMED,
        DRIFT_REPAIRED,
        POSITION_REPLAYS,
        POSITION_REPLAYED_ROWS,
        PARTITIONS_DROPPED,
        DEPENDENCY_UP,
    ),
    "console": (DEPENDENCY_UP,),
}


def export_only(service: str) -> None:
    """Unregister the metrics another service owns, so that a gauge this service never sets
    (say the sweeper's epoch gauge) is not exported as a misleading 0."""
    keep = {id(metric) for metric in OWNERS[service]}
    for metrics in OWNERS.values():
        for metric in metrics:
            if id(metric) not in keep:
                with contextlib.suppress(KeyError):
                    REGISTRY.unregister(metric)  # type: ignore[arg-type]
