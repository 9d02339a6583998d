"""What the executor counts, logs and records of its occurrences, and small helpers of its
batched calls (no I/O beyond metrics, logs and spans)."""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from services.executor.settle import Outcome, Settlement
from shared.contract.delivery import Occurrence
from shared.contract.entries import Completion
from shared.contract.rows import BackfillProgress
from shared.runtime import metrics
from shared.runtime.spans import Spans

#: The executor's logger: its records keep the name they always had.
log = logging.getLogger("services.executor.executor")

T = TypeVar("T")


def by_shard(items: Sequence[tuple[int, T]]) -> dict[int, list[T]]:
    grouped: dict[int, list[T]] = defaultdict(list)
    for shard, item in items:
        grouped[shard].append(item)
    return grouped


def in_order(items: Sequence[tuple[int, object]], codes: dict[int, list[int]]) -> list[int]:
    """Per-shard results back into the order the items were submitted in."""
    cursors = dict.fromkeys(codes, 0)
    ordered = []
    for shard, _ in items:
        ordered.append(codes[shard][cursors[shard]])
        cursors[shard] += 1
    return ordered


@functools.lru_cache(maxsize=4096)
def _namespace_outcomes(labels: metrics.NamespaceLabels, namespace: str, event: str) -> Any:
    """The counter's child of a namespace and outcome: labels() costs a lookup per call, and
    a namespace keeps its label once given (``labels`` is in the key: it is replaced when an
    executor starts)."""
    return metrics.NAMESPACE_OUTCOMES.labels(labels(namespace), event)


@functools.lru_cache(maxsize=64)
def delivered(kind: str, result: str) -> Any:
    return metrics.DELIVERED.labels(kind, result)


@functools.lru_cache(maxsize=8)
def delivery_duration(kind: str) -> Any:
    return metrics.DELIVERY_DURATION.labels(kind)


def count_outcome(namespace: str, settlement: Settlement) -> None:
    _namespace_outcomes(metrics.NAMESPACES, namespace, settlement.event).inc()
    if settlement.row.excluded:
        _namespace_outcomes(metrics.NAMESPACES, namespace, "excluded").inc(settlement.row.excluded)


def backfill_progress(occ: Occurrence, completion: Completion, code: int) -> BackfillProgress:
    """complete.lua answers a backfill member with 1 + the occurrences its backfill has left."""
    left = code - 1
    return BackfillProgress(
        occ.namespace,
        occ.id,
        occ.backfill_generation,
        completion.next_fire_ms if left > 0 else None,
        left,
    )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def poison_reason(headers: Mapping[str, Any]) -> str:
    why = _text(headers.get("x-first-death-reason", "rejected"))
    count = _text(headers.get("x-delivery-count", "too many"))
    return f"delivery message dead-lettered ({why}, delivered {count} times)"


def log_misfire(occ: Occurrence, chosen: int | None) -> None:
    metrics.MISFIRES.labels(occ.plan.misfire.policy).inc()
    log.info(
        "missed occurrence skipped by its misfire policy",
        extra={
            "action": "misfire",
            "schedule": occ.member,
            "nominal_ms": occ.nominal_ms,
            "next_ms": chosen,
            "policy": occ.plan.misfire.policy,
        },
    )


def record_spans(
    spans: Spans, occ: Occurrence, key: str, outcome: Outcome, started: int, finished: int
) -> None:
    where: dict[str, str | int | bool] = {"cronbus.schedule": f"{occ.namespace}/{occ.id}"}
    if outcome.http_status is not None:
        where["http.response.status_code"] = outcome.http_status
    start_ns, end_ns = started * 1_000_000, finished * 1_000_000
    spans.record("deliver", key, occ.attempt, start_ns, end_ns, where, outcome.error)
    spans.record("settle", key, occ.attempt, end_ns, time.time_ns(), where)


def log_settlement(occ: Occurrence, settlement: Settlement) -> None:
    if settlement.event == "succeeded" and not log.isEnabledFor(logging.DEBUG):
        return
    row = settlement.row
    level = logging.WARNING if settlement.event in ("failed", "dead") else logging.DEBUG
    log.log(
        level,
        "occurrence %s",
        settlement.event,
        extra={
            "action": f"occurrence_{settlement.event}",
            "schedule": occ.member,
            "nominal_ms": occ.nominal_ms,
            "attempt": occ.attempt,
            "idempotency_key": row.idempotency_key,
            "http_status": row.http_status,
            "error": row.error,
            "retry_in_ms": settlement.retry_delay_ms,
        },
    )
