"""Whether a Redis may evict cronbus's keys, judged from what its INFO says (no I/O here).

An evicted index key is a schedule that stops firing, or a lease or flag that lets an
occurrence fire twice, with nothing to say so: cronbus promises never to lose a fire, so the
services refuse a Redis whose ``maxmemory-policy`` is anything but ``noeviction``. The policy is
judged alone, whatever ``maxmemory`` is now: ``maxmemory`` can be raised from 0 at run time
(``CONFIG SET``), and a managed Redis sets it for you.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The one policy under which Redis never drops a key to make room (a write fails instead).
SAFE_POLICY = "noeviction"


def policies_in(info: Mapping[str, object]) -> list[str]:
    """The ``maxmemory_policy`` of every node in an INFO reply.

    A standalone server or a Sentinel's primary answers one mapping; a Redis Cluster answers
    one mapping per node. A Redis that hides the field (some managed ones) gives none."""
    found = info.get("maxmemory_policy")
    if found is not None:
        return [str(found)]
    return [
        str(node["maxmemory_policy"])
        for node in info.values()
        if isinstance(node, Mapping) and "maxmemory_policy" in node
    ]


def eviction_refusal(policies: list[str]) -> str | None:
    """The reason to refuse this Redis, or None when no node may evict (or none says)."""
    evicting = sorted({p for p in policies if p.strip().lower() != SAFE_POLICY})
    if not evicting:
        return None
    named = ", ".join(evicting)
    return (
        f"Redis may evict keys (maxmemory-policy {named}): an evicted index key is a schedule "
        f"that stops firing; set maxmemory-policy {SAFE_POLICY} on every Redis node"
    )
