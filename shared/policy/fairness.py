"""Fair order of claimed occurrences between namespaces (pure).

A claim round takes from every shard; flattened shard after shard, one namespace's herd would
fill the first delivery messages and push another namespace's few occurrences to the back of
the broker's queue. Interleaving the namespaces puts each namespace's first occurrences in the
first messages. Within a namespace the order is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def namespace_of(member: str) -> str:
    return member.partition("/")[0]


def interleave(items: Sequence[T], namespace: Callable[[T], str]) -> list[T]:
    """``items`` round robin by namespace (a, b, c, a, b, a, ...), each namespace in order."""
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(namespace(item), []).append(item)
    if len(groups) <= 1:
        return list(items)
    lists = list(groups.values())
    out: list[T] = []
    for position in range(max(len(group) for group in lists)):
        out.extend(group[position] for group in lists if position < len(group))
    return out
