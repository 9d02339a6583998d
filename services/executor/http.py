"""A small HTTP/1.1 client for webhook calls, built on asyncio's protocol layer.

Webhook calls are simple (one request, a status, a short body), and a general client spent
most of an executor's CPU on them: this one builds the request with one format, parses the
response in place, and keeps connections alive in a pool per host. It handles Content-Length,
chunked and close-delimited bodies, 1xx interim responses, TLS, timeouts, and a keep-alive
connection the server closed while it was idle (the request is sent once more on a new one).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

#: Response body bytes kept (for the error of a failed call); the rest is read and dropped.
KEEP_BODY: Final = 300
#: A body longer than this is not read to the end: the connection is closed instead.
MAX_DRAIN: Final = 1 << 20
MAX_HEAD: Final = 64 * 1024


class HttpError(Exception):
    """The call failed before a complete response arrived."""


@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str
    port: int
    #: Path and query, as sent on the request line.
    path: str
    #: Value of the Host header.
    authority: str

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


@functools.lru_cache(maxsize=65_536)
def parse_url(url: str) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpError(f"not an http(s) URL: {url!r}")
    default = 443 if parts.scheme == "https" else 80
    port = parts.port or default
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    authority = shown if port == default else f"{shown}:{port}"
    return Target(parts.scheme, host, port, path, authority)


@dataclass(slots=True)
class Response:
    status: int
    #: The first KEEP_BODY bytes of the body.
    body: bytes
    keep_alive: bool
    #: The Retry-After header, if the response had one.
    retry_after: str | None = None


class _Connection(asyncio.Protocol):
    """One keep-alive connection; a single request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[Response] | None = None
        self.closed = False
        self.used = False
        self.received_any = False
        self._head_only = False
        self._reset_parse()

    def _reset_parse(self) -> None:
        self.status = 0
        self.headers_done = False
        self.framing = ""
        self.remaining = 0
        self.body = bytearray()
        self.keep_alive = True
        self.drained = 0
        self.retry_after: str | None = None

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self.headers_done and self.framing == "close":
            waiter.set_result(Response(self.status, bytes(self.body), False, self.retry_after))
        else:
            waiter.set_exception(HttpError(f"connection closed: {exc or 'by the server'}"))

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.closed = True  # unsolicited bytes: this connection cannot be trusted
            if self.transport is not None:
                self.transport.close()
            return
        self.received_any = True
        self.buffer += data
        try:
            self._parse()
        except HttpError as exc:
            self._fail(exc)

    # requests

    def send(self, request: bytes, head_only: bool) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.received_any = False
        self._head_only = head_only
        self._reset_parse()
        self.transport.write(request)
        return self.waiter

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def _finish(self) -> None:
        assert self.waiter is not None
        if self.buffer:
            self.keep_alive = False  # bytes beyond the response: do not reuse
        if not self.waiter.done():
            self.waiter.set_result(
                Response(self.status, bytes(self.body), self.keep_alive, self.retry_after)
            )

    # parsing

    def _parse(self) -> None:
        while True:
            if not self.headers_done:
                if not self._parse_head():
                    return
                if self.framing == "none":
                    self._finish()
                    return
                continue
            done = self._parse_body()
            if done:
                self._finish()
            return

    def _parse_head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                raise HttpError("response head too large")
            return False
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        del self.buffer[: end + 4]
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HttpError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return True  # interim response (100 Continue): the real one follows
        self.status = status
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        self.headers_done = True
        retry_after = headers.get(b"retry-after")
        self.retry_after = retry_after.decode("latin-1") if retry_after is not None else None
        self._choose_framing(parts[0], status, headers)
        return True

    def _choose_framing(self, version: bytes, status: int, headers: dict[bytes, bytes]) -> None:
        connection = headers.get(b"connection", b"").lower()
        self.keep_alive = b"close" not in connection and (
            version == b"HTTP/1.1" or b"keep-alive" in connection
        )
        if self._head_only or status in (204, 304):
            self.framing = "none"
        elif b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self.framing = "chunked"
        elif b"content-length" in headers:
            try:
                self.remaining = int(headers[b"content-length"])
            except ValueError:
                raise HttpError("bad Content-Length") from None
            self.framing = "length" if self.remaining else "none"
            if self.remaining > MAX_DRAIN:
                self.keep_alive = False
        else:
            self.framing = "close"
            self.keep_alive = False

    def _take(self, count: int) -> None:
        """Consume ``count`` body bytes from the buffer, keeping the first few."""
        if len(self.body) < KEEP_BODY:
            self.body += self.buffer[: min(count, KEEP_BODY - len(self.body))]
        del self.buffer[:count]
        self.drained += count
        if self.drained > MAX_DRAIN and self.waiter is not None:
            # Enough to judge the call: answer now and drop the connection.
            self.keep_alive = False
            self.closed = True
            self._finish()
            if self.transport is not None:
                self.transport.close()

    def _parse_body(self) -> bool:
        if self.framing == "length":
            count = min(self.remaining, len(self.buffer))
            self._take(count)
            self.remaining -= count
            return self.remaining == 0
        if self.framing == "close":
            self._take(len(self.buffer))
            return False
        return self._parse_chunks()

    def _parse_chunks(self) -> bool:
        while True:
            if self.remaining > 0:
                count = min(self.remaining, len(self.buffer))
                self._take(count)
                self.remaining -= count
                if self.remaining:
                    return False
                self.remaining = -2  # the CRLF after the chunk
            if self.remaining == -2:
                if len(self.buffer) < 2:
                    return False
                del self.buffer[:2]
                self.remaining = 0
            end = self.buffer.find(b"\r\n")
            if end < 0:
                return False
            size_text = bytes(self.buffer[:end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise HttpError("bad chunk size") from None
            if size == 0:
                trailer_end = self.buffer.find(b"\r\n\r\n", end)
                if trailer_end < 0:
                    return False
                del self.buffer[: trailer_end + 4]
                return True
            del self.buffer[: end + 2]
            self.remaining = size


class HttpClient:
    """Keep-alive connections pooled per (scheme, host, port), at most ``per_host`` each."""

    def __init__(
        self, per_host: int, ssl_context: ssl.SSLContext | None = None, user_agent: str = "cronbus"
    ) -> None:
        self.per_host = per_host
        self.ssl_context = ssl_context
        self.user_agent = user_agent
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = {}
        self._slots: dict[tuple[str, str, int], asyncio.Semaphore] = {}

    def _ssl(self) -> ssl.SSLContext:
        if self.ssl_context is None:
            self.ssl_context = ssl.create_default_context()
        return self.ssl_context

    async def request(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        timeout_s: float,
    ) -> Response:
        target = parse_url(url)
        request = self._encode(method, target, headers, body)
        slots = self._slots.get(target.key)
        if slots is None:
            slots = self._slots[target.key] = asyncio.Semaphore(self.per_host)
        async with asyncio.timeout(timeout_s), slots:
            return await self._exchange(target, request, method == "HEAD")

    async def _exchange(self, target: Target, request: bytes, head_only: bool) -> Response:
        connection = self._idle_connection(target)
        if connection is not None:
            try:
                return await self._round_trip(target, connection, request, head_only)
            except HttpError:
                if connection.received_any:
                    raise
                # The server closed the idle connection: once more on a fresh one.
        connection = await self._connect(target)
        return await self._round_trip(target, connection, request, head_only)

    async def _round_trip(
        self, target: Target, connection: _Connection, request: bytes, head_only: bool
    ) -> Response:
        try:
            response = await connection.send(request, head_only)
        except BaseException:
            connection.closed = True
            if connection.transport is not None:
                connection.transport.close()
            raise
        if response.keep_alive and not connection.closed:
            connection.waiter = None
            self._idle.setdefault(target.key, collections.deque()).append(connection)
        elif connection.transport is not None:
            connection.transport.close()
        return response

    def _idle_connection(self, target: Target) -> _Connection | None:
        idle = self._idle.get(target.key)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        return None

    async def _connect(self, target: Target) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await loop.create_connection(
                _Connection,
                target.host,
                target.port,
                ssl=self._ssl() if target.scheme == "https" else None,
                server_hostname=target.host if target.scheme == "https" else None,
            )
        except (OSError, ssl.SSLError) as exc:
            raise HttpError(f"cannot connect to {target.authority}: {exc}") from exc
        return protocol

    def _encode(
        self, method: str, target: Target, headers: list[tuple[str, str]], body: bytes | None
    ) -> bytes:
        lines = [
            f"{method} {target.path} HTTP/1.1",
            f"Host: {target.authority}",
            f"User-Agent: {self.user_agent}",
        ]
        lines += [f"{name}: {value}" for name, value in headers]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        elif method in ("POST", "PUT", "PATCH"):
            lines.append("Content-Length: 0")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        return head + body if body else head

    async def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                if connection.transport is not None:
                    connection.transport.close()
        self._idle.clear()
