"""What the client does before and after a round trip, without I/O: a schedule's command form
(round-tripped through JSON, as the intake will read it), the intake's own validation, the
chunks of ``upsert_many`` and its results, refusals as exceptions."""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shared.contract import codec, models, timefmt, validation
from shared.contract.errors import CommandRefused, CronbusError, FieldError, ValidationFailed

#: A schedule as the command carries it (a dict), or as the typed model.
ScheduleInput = models.Schedule | Mapping[str, Any]

#: upsert_many sends at most this much per command, well inside the default
#: CRONBUS_MAX_COMMAND_BYTES (262144).
MAX_CHUNK_BYTES = 200_000

#: The refusal of a command larger than CRONBUS_MAX_COMMAND_BYTES (it changed nothing).
TOO_LARGE = "too_large"


@dataclass(frozen=True)
class ItemResult:
    """One schedule of an ``upsert_many``: applied (``ok``, its new ``version``) or refused
    (``error``), exactly as a single upsert would have been."""

    id: str | None
    ok: bool
    version: int | None = None
    error: CommandRefused | None = None
    #: The definition sent was the stored one: nothing changed, the version stays.
    unchanged: bool = False
    #: What to notice, though the schedule was applied (each with ``field`` and ``reason``).
    warnings: tuple[FieldError, ...] = ()

    def as_reply(self) -> dict[str, Any]:
        """The result as the reply carries it."""
        if self.error is not None:
            return {"id": self.id, "ok": False, "error": self.error.reply["error"]}
        reply: dict[str, Any] = {"id": self.id, "ok": True, "version": self.version}
        if self.unchanged:
            reply["unchanged"] = True
        if self.warnings:
            reply["warnings"] = [{"field": w.field, "reason": w.reason} for w in self.warnings]
        return reply

    @staticmethod
    def of(result: Mapping[str, Any]) -> ItemResult:
        """One entry of an ``upsert_many`` reply's ``results``."""
        error = result.get("error")
        return ItemResult(
            result.get("id"),
            bool(result.get("ok")),
            result.get("version"),
            None if error is None else CommandRefused.of(error),
            bool(result.get("unchanged")),
            tuple(
                FieldError(str(w.get("field")), str(w.get("reason")))
                for w in result.get("warnings") or []
            ),
        )


class UpsertManyIncomplete(CronbusError):
    """``upsert_many`` stopped part way: a command went unanswered (``NoReply``) or the broker
    refused it (``AccessRefused``); the cause is ``__cause__``.

    Attributes
    ----------
    results
        One entry per schedule, in input order: its ``ItemResult`` where cronbus answered (or
        the client refused it), None where the outcome is unknown. A None schedule may have been
        applied (its reply was lost) or never sent; sending it again is safe: the same
        definition again changes nothing.
    """

    def __init__(self, message: str, results: Sequence[ItemResult | None]) -> None:
        self.results: builtins.list[ItemResult | None] = list(results)
        done = sum(result is not None for result in self.results)
        super().__init__(f"{message} ({done} of {len(self.results)} schedules answered)")


def refusal(failure: ValidationFailed) -> CommandRefused:
    """The client's exception for what the intake would have refused the same way."""
    return CommandRefused.of(
        {"code": failure.code, "message": str(failure), "details": failure.details}
    )


def command_form(schedule: ScheduleInput) -> dict[str, Any]:
    """A schedule as the command carries it: a typed model is written out as its fields."""
    if isinstance(schedule, models.Schedule):
        return schedule.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return dict(schedule)


def json_form(value: Mapping[str, Any], code: str = "invalid_command") -> dict[str, Any]:
    """``value`` as the intake will read it: written as JSON and read back, so a tuple, a date or
    a UUID is checked in its JSON form, and what JSON cannot carry (a lone surrogate, a key that
    is not a string) is refused naming ``(body)``, as the intake refuses what is not JSON."""
    try:
        parsed = codec.loads(codec.dumps(dict(value)))
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        reason = f"cannot be written as JSON: {exc}"
        raise CommandRefused(code, f"the body {reason}", [FieldError("(body)", reason)]) from None
    assert isinstance(parsed, dict)
    return parsed


def check(namespace: str, verb: str, body: Mapping[str, Any]) -> None:
    """Refuse locally what the intake would refuse: the same validation, without a round trip.
    (What needs the operator's settings, such as allowed hosts, is still checked by cronbus.)"""
    try:
        validation.check_namespace(namespace)
        validation.parse_command(verb, dict(body))
    except ValidationFailed as failure:
        raise refusal(failure) from None


def item_form(schedule: ScheduleInput) -> dict[str, Any]:
    """One schedule of an upsert_many, in JSON form and checked as the intake checks it;
    CommandRefused(invalid_schedule) when it would be refused."""
    raw = json_form(command_form(schedule), "invalid_schedule")
    try:
        validation.parse_schedule(raw)
    except ValidationFailed as failure:
        raise refusal(failure) from None
    return raw


def schedule_id(schedule: Any) -> str | None:
    """The ``id`` a schedule gives, if it is a string."""
    if isinstance(schedule, models.Schedule):
        return schedule.id
    found = schedule.get("id") if isinstance(schedule, Mapping) else None
    return found if isinstance(found, str) else None


def chunks(schedules: builtins.list[Any]) -> Iterator[builtins.list[Any]]:
    """upsert_many bodies: at most 1000 schedules and about MAX_CHUNK_BYTES each."""
    chunk: builtins.list[Any] = []
    size = 0
    for item in schedules:
        item_size = len(codec.dumps(item)) + 1
        if chunk and (len(chunk) >= models.MAX_UPSERT_MANY or size + item_size > MAX_CHUNK_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += item_size
    if chunk:
        yield chunk


def instant(value: datetime | str) -> str:
    """An instant as a command carries it (RFC 3339, UTC)."""
    if isinstance(value, datetime) and value.tzinfo is not None:
        return timefmt.format_ms(timefmt.datetime_to_ms(value))
    # A naive datetime goes as written, without a zone, so the refusal names the field.
    return value.isoformat() if isinstance(value, datetime) else value
