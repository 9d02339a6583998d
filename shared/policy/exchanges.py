"""Which exchanges an AMQP target may publish to (pure).

An AMQP target is a publish cronbus makes with its own broker credentials on a tenant's behalf.
Without a guard, a tenant could publish into another tenant's exchange, into cronbus's own
exchanges (``cronbus.commands``: commands in any namespace's name) or, through the default
exchange, into any queue by its name. So, as pinned in the design:

- ``CRONBUS_AMQP_ALLOWED_EXCHANGES`` is a comma-separated list of globs (``fnmatch``: ``*``,
  ``?``, ``[...]``), in which ``{namespace}`` stands for the schedule's namespace. The default,
  ``{namespace},{namespace}.*``, lets namespace ``billing`` publish to ``billing`` and
  ``billing.jobs`` and nowhere else.
- The default exchange (``""``), ``amq.*`` (the broker's) and ``cronbus.*`` (ours) are refused
  whatever the setting says, even ``*``. The reserved prefixes are compared without regard to
  case: nothing legitimate is lost, and a broker or plugin that folds case is no way around.

The same decision is made at upsert (the intake), at every delivery (the executor: a schedule
stored under an older, wider setting is refused there) and by ``cronbus doctor``.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from shared.contract import keys
from shared.contract.rows import AmqpTargetRow

SETTING = "CRONBUS_AMQP_ALLOWED_EXCHANGES"
#: Replaced by the schedule's namespace in each glob.
NAMESPACE = "{namespace}"
#: The pinned default of CRONBUS_AMQP_ALLOWED_EXCHANGES.
DEFAULT = "{namespace},{namespace}.*"
#: Refused whatever the setting says (compared case-insensitively).
RESERVED_PREFIXES: tuple[str, ...] = keys.RESERVED_EXCHANGE_PREFIXES


def parse_globs(text: str) -> tuple[str, ...]:
    """The setting's comma-separated globs, blanks dropped (an empty setting allows nothing)."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


@dataclass(frozen=True)
class ExchangePolicy:
    """The operator's allowed exchanges (globs, ``{namespace}`` not yet replaced)."""

    globs: tuple[str, ...] = parse_globs(DEFAULT)

    @classmethod
    def from_text(cls, text: str) -> ExchangePolicy:
        return cls(parse_globs(text))

    def refusal(self, namespace: str, exchange: str) -> str | None:
        """Why ``namespace`` may not publish to ``exchange`` (None: it may)."""
        return _refusal(self.globs, namespace, exchange)

    def allows(self, namespace: str, exchange: str) -> bool:
        return self.refusal(namespace, exchange) is None

    def describe(self) -> str:
        """The setting as an operator would write it (for messages)."""
        return ",".join(self.globs)


def reserved_refusal(exchange: str) -> str | None:
    """Why ``exchange`` is refused whatever the setting says (None: it is not reserved)."""
    if exchange == "":
        return (
            'the default exchange ("") routes to any queue by its name, so it is never allowed, '
            f"whatever {SETTING} says"
        )
    folded = exchange.casefold()
    for prefix in RESERVED_PREFIXES:
        if folded.startswith(prefix):
            return (
                f"exchange {exchange!r} is reserved: amq.* (the broker's) and cronbus.* "
                f"(cronbus's own) are never allowed, whatever {SETTING} says"
            )
    return None


# Schedules repeat namespaces and exchanges by the million (a bulk import, a doctor run).
@functools.lru_cache(maxsize=4096)
def _refusal(globs: tuple[str, ...], namespace: str, exchange: str) -> str | None:
    reserved = reserved_refusal(exchange)
    if reserved is not None:
        return reserved
    # fnmatchcase: exchange names are case-sensitive in RabbitMQ. The namespace goes in as
    # literal text: glob syntax comes from the operator, never from a tenant.
    literal = _literal(namespace)
    if any(fnmatch.fnmatchcase(exchange, glob.replace(NAMESPACE, literal)) for glob in globs):
        return None
    shown = ",".join(globs) or "empty"
    allowed = ",".join(glob.replace(NAMESPACE, namespace) for glob in globs) or "nothing"
    return (
        f"exchange {exchange!r} is not one namespace {namespace!r} may publish to: {SETTING} "
        f"is {shown!r}, which allows {allowed!r} here"
    )


def _literal(text: str) -> str:
    """``text`` as a glob that matches exactly itself (each special character in brackets)."""
    return "".join(f"[{char}]" if char in "*?[" else char for char in text)


@dataclass(frozen=True, slots=True)
class RefusedTarget:
    """A stored schedule whose AMQP target the policy refuses: it fails at every delivery
    until it is changed (or the operator allows its exchange)."""

    namespace: str
    id: str
    state: str
    exchange: str
    reason: str


def refused_targets(
    rows: Iterable[AmqpTargetRow], policy: ExchangePolicy
) -> Iterator[RefusedTarget]:
    """The rows whose exchange ``policy`` refuses, with the reason."""
    for row in rows:
        reason = policy.refusal(row.namespace, row.exchange)
        if reason is not None:
            yield RefusedTarget(row.namespace, row.id, row.state, row.exchange, reason)
