"""Which commands partition a command goes to (no I/O).

Commands on one schedule always go to the same partition, so a partition's single consumer
applies them in the order sent, however many dispatchers share the partitions. The schedule's
id is in the body, not in the routing key (``<namespace>.<verb>``, the pinned contract), which
is why a router reads it here rather than RabbitMQ hashing a header. An ``upsert_many`` whose
schedules fall in several partitions is split into one part per partition, each keeping its
schedules in input order; the router puts the parts' results back in input order.

Anything the router cannot make sense of goes whole to the namespace's partition, where the
intake refuses it exactly as it would have before partitions existed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

#: The most schedules an upsert_many may carry (beyond it the intake refuses the command whole).
MAX_MANY = 1000


def partition_of(namespace: str, schedule_id: str, partitions: int) -> int:
    """A stable partition (every process, every version) for one schedule."""
    key = f"{namespace}\x00{schedule_id}".encode("utf-8", "surrogatepass")
    return zlib.crc32(key) % partitions


def schedule_id_of(verb: str, parsed: Any) -> str | None:
    """The schedule a single-schedule command names (None: none a string)."""
    if not isinstance(parsed, dict):
        return None
    holder = parsed.get("schedule") if verb == "upsert" else parsed
    found = holder.get("id") if isinstance(holder, dict) else None
    return found if isinstance(found, str) else None


@dataclass(frozen=True, slots=True)
class Part:
    """Part of an upsert_many: the schedules (by input position) of one partition."""

    partition: int
    positions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Route:
    """Where one command goes: whole to one partition, or split into parts."""

    partition: int
    parts: tuple[Part, ...] = ()

    @property
    def split(self) -> bool:
        return len(self.parts) > 1


def route_of(namespace: str, verb: str, parsed: Any, partitions: int) -> Route:
    """The route of a command whose body parsed as ``parsed`` (None: it did not parse)."""
    whole = Route(partition_of(namespace, "", partitions))
    if verb == "upsert_many":
        return _many_route(namespace, parsed, partitions) or whole
    schedule_id = schedule_id_of(verb, parsed)
    if schedule_id is None:
        return whole
    return Route(partition_of(namespace, schedule_id, partitions))


def _many_route(namespace: str, parsed: Any, partitions: int) -> Route | None:
    """Parts by partition, each in input order; None when the intake will refuse the command
    whole anyway (wrong shape), so that it is refused once, not once per part."""
    if not isinstance(parsed, dict) or set(parsed) != {"schedules"}:
        return None
    schedules = parsed["schedules"]
    if not isinstance(schedules, list) or not 0 < len(schedules) <= MAX_MANY:
        return None
    by_partition: dict[int, list[int]] = {}
    for position, item in enumerate(schedules):
        item_id = item.get("id") if isinstance(item, dict) else None
        # A schedule without a string id is refused on its own: any partition may say so.
        key = item_id if isinstance(item_id, str) else ""
        by_partition.setdefault(partition_of(namespace, key, partitions), []).append(position)
    parts = tuple(Part(p, tuple(positions)) for p, positions in sorted(by_partition.items()))
    return Route(parts[0].partition, parts)


def merged_results(
    parts: tuple[Part, ...], replies: list[dict[str, Any]], items: list[Any]
) -> dict[str, Any]:
    """The reply to a split upsert_many: each part's results back in input order.

    A part refused whole (``{"ok": false, "error": ...}``) answers each of its schedules
    with that error, so every schedule sent is answered once.
    """
    results: list[dict[str, Any] | None] = [None] * len(items)
    for part, reply in zip(parts, replies, strict=True):
        part_results = reply.get("results") if reply.get("ok") else None
        for n, position in enumerate(part.positions):
            if isinstance(part_results, list) and n < len(part_results):
                results[position] = part_results[n]
            else:
                results[position] = {
                    "id": _id_or_none(items[position]),
                    "ok": False,
                    "error": reply.get("error") or _missing_error(),
                }
    merged: dict[str, Any] = {"ok": True, "results": results}
    if all(reply.get("duplicate") for reply in replies):
        # Every part was applied by an earlier delivery of the same command.
        merged["duplicate"] = True
    return merged


def _id_or_none(item: Any) -> str | None:
    found = item.get("id") if isinstance(item, dict) else None
    return found if isinstance(found, str) else None


def _missing_error() -> dict[str, Any]:
    return {
        "code": "internal",
        "message": "cronbus could not handle this schedule; the error is logged",
        "details": [],
    }
