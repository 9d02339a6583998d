"""Per-namespace quotas from ``CRONBUS_QUOTAS_FILE``, re-read when the file changes.

The file is a JSON object from namespace (or ``"*"`` for every other namespace) to
``{"max_schedules": n, "max_fires_per_s": r}`` (either may be left out: no limit)::

    {"acme": {"max_schedules": 10000, "max_fires_per_s": 50}, "*": {"max_schedules": 1000}}

A file that cannot be read or parsed keeps the quotas read last (and is logged): a typo in the
file must not lift every limit at once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.contract import codec
from shared.contract.errors import ConfigError

log = logging.getLogger(__name__)

#: How often the file's modification time is looked at.
CHECK_EVERY_S = 1.0


class Quota(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    #: Live schedules (not deleted) the namespace may hold.
    max_schedules: int | None = Field(default=None, ge=0)
    #: Deliveries per second the namespace gets, across all executors (more are delayed).
    max_fires_per_s: float | None = Field(default=None, gt=0, le=1_000_000)


@dataclass(frozen=True, slots=True)
class Quotas:
    by_namespace: dict[str, Quota]

    def of(self, namespace: str) -> Quota | None:
        return self.by_namespace.get(namespace, self.by_namespace.get("*"))


def parse(text: bytes | str) -> Quotas:
    """The quotas in a file's text; ConfigError naming the entry when it is not valid."""
    try:
        data: Any = codec.loads(text)
    except codec.DecodeError as exc:
        raise ConfigError(f"CRONBUS_QUOTAS_FILE is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("CRONBUS_QUOTAS_FILE must hold a JSON object")
    found = {}
    for namespace, entry in data.items():
        try:
            found[namespace] = Quota.model_validate(entry)
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(part) for part in problem["loc"])
            raise ConfigError(
                f"CRONBUS_QUOTAS_FILE: {namespace}{'.' + where if where else ''}: {problem['msg']}"
            ) from None
    return Quotas(found)


class QuotaFile:
    """The quotas of one file, re-read when its modification time changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.quotas = Quotas({})
        self._mtime: float | None = None
        self._checked = 0.0
        if path:
            self._read(strict=True)

    def of(self, namespace: str) -> Quota | None:
        if not self.path:
            return None
        now = time.monotonic()
        if now - self._checked >= CHECK_EVERY_S:
            self._checked = now
            self._read(strict=False)
        return self.quotas.of(namespace)

    def _read(self, *, strict: bool) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime == self._mtime:
                return
            with open(self.path, "rb") as handle:
                self.quotas = parse(handle.read())
            self._mtime = mtime
        except (OSError, ConfigError) as exc:
            if strict:
                raise ConfigError(f"CRONBUS_QUOTAS_FILE {self.path}: {exc}") from None
            log.error(
                "quotas file not re-read; keeping the last quotas",
                extra={"action": "quotas_unreadable", "error": str(exc)},
            )
