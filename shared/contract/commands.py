"""The bodies of the commands, one model per verb (pure): what ``cronbus.commands`` accepts
besides the schedule itself (``shared.contract.models``)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, JsonValue, field_validator

from shared.contract.models import (
    BACKFILL_DEFAULT_LIMIT,
    BACKFILL_MAX_LIMIT,
    MAX_UPSERT_MANY,
    Instant,
    Schedule,
    Strict,
    check_labels,
    check_schedule_id,
)


class UpsertCommand(Strict):
    schedule: Schedule
    #: Compare-and-set: apply only when the stored version is this one (0: only create).
    expected_version: int | None = Field(default=None, ge=0)


class IdCommand(Strict):
    """delete | pause | resume | trigger | get."""

    id: str

    @field_validator("id")
    @classmethod
    def _id_is_safe(cls, value: str) -> str:
        return check_schedule_id(value)


class BackfillCommand(Strict):
    """Deliver again each nominal occurrence of a schedule in ``[from, to)``, oldest first, one
    at a time, at most ``limit`` of them. (``from`` before ``to``, and ``to`` not in the future,
    are checked by the intake: they need its clock.)"""

    id: str
    from_: Instant = Field(alias="from")
    to: Instant
    limit: int = Field(default=BACKFILL_DEFAULT_LIMIT, ge=1, le=BACKFILL_MAX_LIMIT)

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, populate_by_name=False, serialize_by_alias=True
    )

    @field_validator("id")
    @classmethod
    def _id_is_safe(cls, value: str) -> str:
        return check_schedule_id(value)


class ListCommand(Strict):
    limit: int = Field(default=100, ge=1, le=1000)
    #: The ``next_cursor`` of the previous page.
    cursor: str | None = Field(default=None, max_length=512)
    #: Only schedules carrying every one of these labels.
    labels: dict[str, str] = Field(default_factory=dict)
    #: Only schedules in this state.
    state: Literal["active", "paused", "completed"] | None = None

    @field_validator("labels")
    @classmethod
    def _labels_are_bounded(cls, value: dict[str, str]) -> dict[str, str]:
        return check_labels(value)


class UpsertManyCommand(Strict):
    """Many upserts in one command; each schedule is validated (and refused) on its own, so the
    list holds them unvalidated here."""

    schedules: list[JsonValue] = Field(min_length=1, max_length=MAX_UPSERT_MANY)


COMMAND_MODELS: dict[str, type[Strict]] = {
    "upsert": UpsertCommand,
    "delete": IdCommand,
    "pause": IdCommand,
    "resume": IdCommand,
    "trigger": IdCommand,
    "get": IdCommand,
    "list": ListCommand,
    "upsert_many": UpsertManyCommand,
    "backfill": BackfillCommand,
}
