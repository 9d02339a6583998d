"""A hostile HTTP server on loopback: each path answers a webhook call in a way meant to hurt
the caller (endless chunk-size lines, a 10 MB header, a slow drip, lying lengths).

Every answer is bounded in time and bytes, so a test cannot run away even when the client
under test never hangs up; ``sent`` records how many bytes each path got out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

#: Most bytes one answer writes, and for how long.
MAX_BYTES = 64 * 1024 * 1024
MAX_SECONDS = 15.0
PIECE = 64 * 1024

OK_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

Writer = asyncio.StreamWriter


async def _endless(writer: Writer, head: bytes, piece: bytes, pause_s: float = 0.0) -> int:
    """``head`` then ``piece`` again and again until the client hangs up (or the bounds)."""
    sent = 0
    writer.write(head)
    sent += len(head)
    deadline = time.monotonic() + MAX_SECONDS
    try:
        while sent < MAX_BYTES and time.monotonic() < deadline and not writer.is_closing():
            writer.write(piece)
            await writer.drain()
            sent += len(piece)
            if pause_s:
                await asyncio.sleep(pause_s)
    except ConnectionError:
        pass  # the client hung up: what this answer is for
    return sent


async def _once(writer: Writer, reply: bytes) -> int:
    writer.write(reply)
    await writer.drain()
    return len(reply)


def _fixed(reply: bytes) -> Callable[[Writer], Awaitable[int]]:
    return lambda writer: _once(writer, reply)


ANSWERS: dict[str, Callable[[Writer], Awaitable[int]]] = {
    # A chunk-size line that never ends: hex digits, or an extension.
    "/endless-chunk-size": lambda w: _endless(w, OK_CHUNKED, b"f" * PIECE),
    "/endless-chunk-extension": lambda w: _endless(w, OK_CHUNKED + b"5;ext=", b"a" * PIECE),
    "/endless-trailer": lambda w: _endless(w, OK_CHUNKED + b"0\r\nX-Trailer: ", b"t" * PIECE),
    # One header of 10 MB (and then some), or header lines without end.
    "/huge-header": lambda w: _endless(w, b"HTTP/1.1 200 OK\r\nX-Big: ", b"h" * PIECE),
    "/endless-headers": lambda w: _endless(w, b"HTTP/1.1 200 OK\r\n", b"X-A: b\r\n" * 8192),
    "/endless-interim": lambda w: _endless(w, b"", b"HTTP/1.1 100 Continue\r\n\r\n" * 2048),
    # A valid response, one byte every 50 ms.
    "/slow-drip": lambda w: _endless(
        w, b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n", b"x", 0.05
    ),
    # A body that never ends, and a chunked one.
    "/endless-body": lambda w: _endless(
        w, b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n", b"b" * PIECE
    ),
    "/endless-chunks": lambda w: _endless(w, OK_CHUNKED, b"10000\r\n" + b"c" * 0x10000 + b"\r\n"),
    # Lengths and codings that lie or are malformed.
    "/negative-length": _fixed(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"),
    "/plus-length": _fixed(b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok"),
    "/underscore-length": _fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n0123456789"),
    "/hex-length": _fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 0x2\r\n\r\nok"),
    "/disagreeing-lengths": _fixed(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!"
    ),
    "/list-length": _fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nok!"),
    "/gzip-coding": _fixed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok"),
    "/gzip-chunked-coding": _fixed(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    ),
    "/length-and-chunked": _fixed(
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n"
    ),
    "/huge-chunk-size": _fixed(OK_CHUNKED + b"ffffffffffffffffffff\r\n"),
    "/not-http": _fixed(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"),
}


@dataclass
class HostileServer:
    #: Bytes each path got out before the client hung up (or the bounds stopped it).
    sent: dict[str, int] = field(default_factory=dict)
    port: int = 0
    _server: asyncio.Server | None = None

    async def start(self) -> HostileServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _handle(self, reader: asyncio.StreamReader, writer: Writer) -> None:
        path = "?"
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            answer = ANSWERS.get(
                path, _fixed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            )
            sent = await answer(writer)
            self.sent[path] = max(self.sent.get(path, 0), sent)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
