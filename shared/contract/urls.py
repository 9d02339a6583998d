"""Server URLs from settings: lists of nodes, and URLs made safe to log. No I/O."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

#: The schemes a RabbitMQ node's URL may have.
AMQP_SCHEMES = ("amqp", "amqps")

# scheme://user:PASSWORD@ : the password runs to the last "@" before the host, and stops at
# white space or a comma (the next URL of a list). A match that is not a password (a port
# followed by "@" in a path) is masked too: too much hidden is harmless, too little is not.
_USERINFO_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@,]*:)([^\s,]*)@")
# libpq's key=value form, and a password in a query string (?password=...).
_PASSWORD_PARAMETER = re.compile(r"(password=)([^\s&,]*)", re.IGNORECASE)
MASK = "***"


def masked(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``: for any log line,
    error or finding that may quote a URL, whichever setting it came from."""
    text = _USERINFO_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    return _PASSWORD_PARAMETER.sub(lambda m: f"{m.group(1)}{MASK}", text)


def amqp_urls(value: str) -> tuple[str, ...]:
    """The RabbitMQ nodes of ``CRONBUS_AMQP_URL``: one URL, or several separated by commas
    (the nodes of one cluster).

    Raises ValueError saying which URL of the list is wrong and why, without repeating it
    (it may hold a password).
    """
    parts = [part.strip() for part in value.split(",")]
    if not any(parts):
        raise ValueError("no URL: give amqp://user:password@host:5672/vhost")
    urls: list[str] = []
    for position, part in enumerate(parts, start=1):
        where = f"URL {position} of {len(parts)}" if len(parts) > 1 else "the URL"
        if not part:
            raise ValueError(f"{where} is empty (two commas in a row, or one at an end)")
        problem = _amqp_url_problem(part)
        if problem:
            raise ValueError(f"{where}: {problem}")
        urls.append(part)
    if len(set(urls)) != len(urls):
        raise ValueError("a node is listed twice")
    return tuple(urls)


def _amqp_url_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "the port must be a number from 1 to 65535"
    if parts.scheme not in AMQP_SCHEMES:
        return "must start with amqp:// or amqps://"
    if not parts.hostname:
        return "names no host"
    if port == 0:
        return "the port must be a number from 1 to 65535"
    return None


def host_port(url: str) -> str:
    """Where a URL points, for a message: host and port, never the user or password."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    default = 5671 if parts.scheme == "amqps" else 5672
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port or default}"
