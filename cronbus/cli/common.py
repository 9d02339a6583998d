"""What the ``cronbus`` subcommands share."""

from __future__ import annotations

import argparse
import logging
from urllib.parse import urlsplit

from shared.runtime import transient
from shared.runtime.config import CommonSettings


class CliError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2."""


def settings() -> CommonSettings:
    return CommonSettings()


def amqp_url() -> str:
    return settings().amqp_url


def database_url() -> str:
    return settings().database_url


def _where(url: str) -> str:
    """host:port of a URL, without its credentials (the message may be pasted anywhere)."""
    parts = urlsplit(url)
    return f"{parts.hostname or '?'}:{parts.port or ''}".rstrip(":")


def unreachable(service: str, setting: str, url: str, exc: BaseException) -> str:
    """Why a dependency cannot be used, and the setting that fixes it."""
    refused = transient.refusal(exc)
    if refused is not None:
        return f"{refused}; check the user and password in {setting}"
    return (
        f"cannot reach {service} at {_where(url)} ({exc or type(exc).__name__}): is it running? "
        f"{setting} says where it is"
    )


def broker_error(exc: BaseException) -> str:
    return unreachable("RabbitMQ", "CRONBUS_AMQP_URL", amqp_url(), exc)


def database_error(exc: BaseException) -> str:
    return unreachable("PostgreSQL", "CRONBUS_DATABASE_URL", database_url(), exc)


def quiet_drivers() -> None:
    """The command prints one line per problem: the AMQP library's own connection errors
    (logged before it raises what this command reports) would be a stray second one."""
    for name in ("aiormq", "aio_pika"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


#: The namespace a command uses when neither -n nor CRONBUS_NAMESPACE names one.
DEFAULT_NAMESPACE = "default"


def namespace_arg(text: str) -> str:
    """-n's value; an empty one is refused here, naming -n, rather than by the service."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "empty: give the schedules' namespace, e.g. -n billing (or set CRONBUS_NAMESPACE)"
        )
    return text


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def interval_s(text: str) -> float:
    """An argparse type: seconds between looks, at least 0.1 (never a busy loop)."""
    try:
        value = float(text)
    except ValueError:
        value = 0
    if not value >= 0.1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0.1")
    return value
