"""One exception tree for cronbus: every error a service raises on purpose derives from here."""

from __future__ import annotations


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
