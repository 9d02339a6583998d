"""What the ``cronbus`` subcommands share."""

from __future__ import annotations

from shared.runtime.config import CommonSettings


class CliError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2."""


def settings() -> CommonSettings:
    return CommonSettings()


def amqp_url() -> str:
    return settings().amqp_url


def database_url() -> str:
    return settings().database_url
