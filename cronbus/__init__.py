"""cronbus: a distributed scheduler. This package is its Python client (``cronbus.client``), its
command line (``cronbus.cli``) and its benchmarks (``cronbus.bench``).

The client's names, importable from here::

    from cronbus import Client, SyncClient, CommandRefused, NotFound
"""

from cronbus.client import AccessRefused, Client, NoReply, Page
from cronbus.forms import ItemResult, UpsertManyIncomplete
from cronbus.sync import SyncClient
from shared.contract.errors import CommandRefused, FieldError, NotFound
from shared.contract.models import (
    AfterCompletionSpec,
    AmqpTarget,
    CronSpec,
    Exclusion,
    FireAllMisfire,
    FireOnceMisfire,
    IntervalSpec,
    OnceSpec,
    RateLimit,
    Retry,
    Schedule,
    SkipMisfire,
    WebhookTarget,
)
from shared.contract.replies import BackfillProgress, Breaker, Stats, StoredSchedule, Triggered

__all__ = [
    "AccessRefused",
    "AfterCompletionSpec",
    "AmqpTarget",
    "BackfillProgress",
    "Breaker",
    "Client",
    "CommandRefused",
    "CronSpec",
    "Exclusion",
    "FieldError",
    "FireAllMisfire",
    "FireOnceMisfire",
    "IntervalSpec",
    "ItemResult",
    "NoReply",
    "NotFound",
    "OnceSpec",
    "Page",
    "RateLimit",
    "Retry",
    "Schedule",
    "SkipMisfire",
    "Stats",
    "StoredSchedule",
    "SyncClient",
    "Triggered",
    "UpsertManyIncomplete",
    "WebhookTarget",
]
