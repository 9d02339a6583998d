"""Per-schedule stats: folded from the execution rows the executor already batches (pure).

The executor never writes stats per fire: a flush of the audit buffer folds its rows into one
delta per schedule, and PostgreSQL adds the deltas up in one statement.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shared.contract import timefmt
from shared.contract.rows import ExecutionRow

#: The pinned fields of ``"stats"`` in get and list replies, in order.
FIELDS = (
    "fires",
    "succeeded",
    "failed",
    "dead",
    "skipped",
    "excluded",
    "consecutive_failures",
    "last_status",
    "last_error",
    "last_fire_at",
)


@dataclass(slots=True)
class Delta:
    namespace: str
    id: str
    fires: int = 0
    succeeded: int = 0
    failed: int = 0
    dead: int = 0
    skipped: int = 0
    excluded: int = 0
    #: Occurrences ended dead after the batch's last success (or in all of it, if none).
    trailing_dead: int = 0
    last_status: str | None = None
    last_error: str | None = None
    #: Start of the batch's latest attempt.
    last_ms: int | None = None


def _add(delta: Delta, row: ExecutionRow) -> None:
    if row.status != "skipped" and row.attempts == 1:
        delta.fires += 1
    if row.status == "succeeded":
        delta.succeeded += 1
        delta.trailing_dead = 0
    elif row.status in ("retrying", "dead"):
        delta.failed += 1
        if row.status == "dead":
            delta.dead += 1
            delta.trailing_dead += 1
    elif row.status == "skipped":
        delta.skipped += 1
    delta.excluded += row.excluded
    if delta.last_ms is None or row.started_ms >= delta.last_ms:
        delta.last_ms = row.started_ms
        delta.last_status = row.status
        delta.last_error = row.error


def fold(rows: Iterable[ExecutionRow]) -> list[Delta]:
    """One delta per schedule, rows taken in the order they were settled; the deltas in key
    order, so two executors writing the same rows lock them in the same order (no deadlock)."""
    deltas: dict[tuple[str, str], Delta] = {}
    for row in rows:
        key = (row.namespace, row.id)
        delta = deltas.get(key)
        if delta is None:
            delta = deltas[key] = Delta(row.namespace, row.id)
        _add(delta, row)
    return [deltas[key] for key in sorted(deltas)]


@dataclass(slots=True)
class Minute:
    """Deliveries of one namespace in one minute (the console's live rates)."""

    namespace: str
    minute_ms: int
    fires: int = 0
    succeeded: int = 0
    failed_attempts: int = 0
    dead: int = 0


def minutes(rows: Iterable[ExecutionRow]) -> list[Minute]:
    """One entry per namespace and minute an attempt finished in, in key order: every executor
    writes these hot rows, and one order for all of them means no deadlock."""
    found: dict[tuple[str, int], Minute] = {}
    for row in rows:
        if row.status == "skipped":
            continue
        at = row.finished_ms - row.finished_ms % 60_000
        entry = found.get((row.namespace, at))
        if entry is None:
            entry = found[(row.namespace, at)] = Minute(row.namespace, at)
        entry.fires += row.attempts == 1
        entry.succeeded += row.status == "succeeded"
        entry.failed_attempts += row.status in ("retrying", "dead")
        entry.dead += row.status == "dead"
    return [found[key] for key in sorted(found)]


def empty() -> dict[str, Any]:
    return {name: (None if name.startswith("last_") else 0) for name in FIELDS}


def view(record: dict[str, Any] | None) -> dict[str, Any]:
    """The ``stats`` object of a reply from a ``schedule_stats`` row (None: nothing yet)."""
    if record is None:
        return empty()
    out = {name: record[name] for name in FIELDS}
    last = record["last_fire_at"]
    out["last_fire_at"] = None if last is None else timefmt.format_ms(timefmt.datetime_to_ms(last))
    return out


def paused_reason(state: str, version: int, record: dict[str, Any] | None) -> str | None:
    """Why a schedule is paused: "failures" when pause_after_failures paused this very version
    (any later command makes a new version), "command" for a pause or upsert, None if not."""
    if state != "paused":
        return None
    if record is not None and record.get("paused_version") == version:
        return "failures"
    return "command"


def decorate(shown: dict[str, Any], record: dict[str, Any] | None) -> dict[str, Any]:
    """A get or list view with its ``stats`` and ``paused_reason``."""
    shown["stats"] = view(record)
    shown["paused_reason"] = paused_reason(shown["state"], shown["version"], record)
    return shown
