"""One exception tree for cronbus: every error a service raises on purpose derives from here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class CronbusError(Exception):
    """A cronbus operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class StoreError(CronbusError):
    """PostgreSQL could not complete the operation."""


class RedisIndexError(CronbusError):
    """The Redis index could not complete the operation."""


class LuaScriptError(RedisIndexError):
    """A Lua script returned an error code."""

    def __init__(self, script: str, code: int, message: str | None = None) -> None:
        self.script = script
        self.code = code
        detail = (type(self).__doc__ or "").strip().rstrip(".")
        super().__init__(message or f"{script}.lua returned {code}: {detail}")


class StaleWriteError(LuaScriptError):
    """The index already holds a newer version of the schedule."""


class DependencyRefused(CronbusError):
    """A dependency refused the connection for a reason retrying cannot fix.

    ``setting`` is the CRONBUS_* variable to change; ``reason`` says what the server answered.
    """

    def __init__(self, setting: str, reason: str) -> None:
        self.setting = setting
        self.reason = reason
        super().__init__(f"{setting}: {reason}")


class ValidationFailed(CronbusError):
    """The input is not valid.

    `code` is the reply's error code; `details` name each offending field and why.
    """

    def __init__(
        self, code: str, message: str, details: list[dict[str, str]] | None = None
    ) -> None:
        self.code = code
        self.details = details or []
        super().__init__(message)


class ConfigError(CronbusError):
    """A setting (or a file it names) is not valid."""


@dataclass(frozen=True)
class FieldError:
    """One field of a refused command, and why it was refused."""

    #: The field, named as in the command (``spec.expr``, ``target.headers.X-A``, ``id``).
    field: str
    #: Why it was refused, in words.
    reason: str


class CommandRefused(CronbusError):
    """cronbus refused a command: nothing was changed.

    Attributes
    ----------
    code
        The reply's error code: ``invalid_schedule``, ``invalid_command``, ``not_found``,
        ``version_conflict``, ``quota_exceeded``, ``conflict``, ``too_large``, ``internal``...
    message
        One line saying what is wrong.
    errors
        Each offending field with its reason (at most 50).
    reply
        The refusal as the reply carries it: ``{"ok": false, "error": {...}}``.
    """

    def __init__(self, code: str, message: str, errors: Sequence[FieldError] = ()) -> None:
        self.code = code
        self.message = message
        self.errors = tuple(errors)
        super().__init__(f"{code}: {message}")

    @property
    def reply(self) -> dict[str, Any]:
        details = [{"field": e.field, "reason": e.reason} for e in self.errors]
        return {
            "ok": False,
            "error": {"code": self.code, "message": self.message, "details": details},
        }

    @staticmethod
    def of(error: Mapping[str, Any]) -> CommandRefused:
        """The exception for a reply's ``error`` object: NotFound for ``not_found``."""
        details = error.get("details") or []
        errors = [FieldError(str(d.get("field")), str(d.get("reason"))) for d in details]
        code = str(error.get("code"))
        kind = NotFound if code == NOT_FOUND else CommandRefused
        return kind(code, str(error.get("message")), errors)


#: The error code of a command about a schedule that does not exist (or was deleted).
NOT_FOUND = "not_found"


class NotFound(CommandRefused):
    """The schedule does not exist (or was deleted): the refusal with code ``not_found``."""
