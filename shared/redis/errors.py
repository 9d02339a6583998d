"""Errors of cronbus's own Redis clients, apart from the connection code so that the outage
classification (``shared.runtime.transient``) can name them."""

from __future__ import annotations

from redis.exceptions import RedisClusterException


class ClusterUnavailable(RedisClusterException):
    """A Redis Cluster whose layout cannot be read for now: no node answers, slots have no
    primary for a moment, or the nodes disagree on the slots (a failover under way).

    Not a ConnectionError on purpose: redis-py retries those around a pipeline's refresh of
    the layout, ten times over (minutes during a network partition); this error leaves its
    control flow as it was, and the services wait it out like any outage."""
