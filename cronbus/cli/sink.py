"""A small, fast HTTP sink that records webhook deliveries (for ``cronbus dev``, tests, bench).

It speaks just enough HTTP/1.1 for webhook calls: keep-alive, pipelining, Content-Length
bodies. Written on asyncio's protocol layer so that a benchmark measures cronbus, not the sink.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_REASONS = {
    200: "OK",
    201: "Created",
    204: "No Content",
    400: "Bad Request",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
MAX_HEAD = 64 * 1024


@dataclass(slots=True)
class Received:
    at_ms: float
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    #: The status answered, and when the answer was written (0 until then).
    status: int = 0
    answered_ms: float = 0.0

    @property
    def key(self) -> str:
        return self.headers.get("idempotency-key", "")

    @property
    def schedule(self) -> str:
        return self.headers.get("x-cronbus-schedule", "")

    @property
    def fire_time(self) -> str:
        return self.headers.get("x-cronbus-fire-time", "")

    @property
    def attempt(self) -> int:
        return int(self.headers.get("x-cronbus-attempt", "0") or 0)


#: Decides the status of each request (200 unless told otherwise).
Responder = Callable[[Received], int]


@dataclass
class Sink:
    respond: Responder = field(default=lambda _: 200)
    on_receive: Callable[[Received], None] | None = None
    #: Keep what was received (a benchmark may only count).
    keep: bool = True
    #: Answer every request this long after it arrived (a slow target).
    delay_s: float = 0.0
    #: Extra response headers by status, e.g. ``{429: {"Retry-After": "3"}}``.
    headers_by_status: dict[int, dict[str, str]] = field(default_factory=dict)
    #: Per-request delay in seconds instead of ``delay_s`` (targets of several speeds).
    delay_for: Callable[[Received], float] | None = None
    received: list[Received] = field(default_factory=list)
    count: int = 0
    port: int = 0
    _server: asyncio.Server | None = None
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _connections: set[_Protocol] = field(default_factory=set)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Protocol(self), host, port, reuse_address=True, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self._connections):
                if connection.transport is not None:
                    connection.transport.close()
            await self._server.wait_closed()

    def record(self, request: Received) -> int:
        self.count += 1
        if self.keep:
            self.received.append(request)
        if self.on_receive is not None:
            self.on_receive(request)
        self._arrived.set()
        request.status = self.respond(request)
        return request.status

    async def wait_for(self, predicate: Callable[[Sink], bool], timeout_s: float) -> bool:
        """Wait until ``predicate(self)`` holds (checked at each arrival), or the timeout."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(remaining, 0.5))
            except TimeoutError:
                continue
        return True


class _Protocol(asyncio.Protocol):
    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        #: When the last reply on this connection goes out (loop time): replies keep the
        #: request order even when their delays differ.
        self.free_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = transport  # type: ignore[assignment]
        self.sink._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.sink._connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self._one_request():
            pass

    def _one_request(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                self._reply(400, True)
            return False
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        method, path, _ = [*lines[0].split(" ", 2), "", ""][:3]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or 0)
        if len(self.buffer) < end + 4 + length:
            return False
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        request = Received(time.time() * 1000, method, path, headers, body)
        status = self.sink.record(request)
        close = headers.get("connection", "").lower() == "close"
        delay = self.sink.delay_s if self.sink.delay_for is None else self.sink.delay_for(request)
        loop = asyncio.get_running_loop()
        if delay > 0 or self.free_at > loop.time():
            self.free_at = max(loop.time() + delay, self.free_at)
            loop.call_at(self.free_at, self._reply, status, close, request)
        else:
            self._reply(status, close, request)
        return True

    def _reply(self, status: int, close: bool = False, request: Received | None = None) -> None:
        if request is not None:
            request.answered_ms = time.time() * 1000
        if self.transport is None or self.transport.is_closing():
            return
        reason = _REASONS.get(status, "Status")
        connection = b"close" if close else b"keep-alive"
        extra = "".join(
            f"{name}: {value}\r\n"
            for name, value in self.sink.headers_by_status.get(status, {}).items()
        )
        self.transport.write(
            b"HTTP/1.1 %d %s\r\n%sContent-Length: 0\r\nConnection: %s\r\n\r\n"
            % (status, reason.encode(), extra.encode("latin-1"), connection)
        )
        if close:
            self.transport.close()
