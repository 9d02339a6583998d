"""A small HTTP/1.1 client for webhook calls, built on asyncio's protocol layer and httptools.

Webhook calls are simple (one request, a status, a short body), and a general client spent
most of an executor's CPU on them: this one builds the request with one format, parses the
response with llhttp (through httptools, the parser behind uvicorn and Node), and keeps
connections alive in a pool per host.

Every target is a stranger's server, so everything is bounded: the response head
(``MAX_HEAD``), chunk-size lines, extensions and trailers (``MAX_FRAMING`` plus a little per
chunk), the body read (``MAX_DRAIN``; only ``KEEP_BODY`` bytes are kept), and the whole exchange
(the target's timeout, from connect to the last byte). Malformed lengths and transfer codings
other than chunked are refused. Connections go only to addresses the ``AddressPolicy`` allows:
the host is resolved once per new connection, every address is checked, and the connection is
made to a checked address (there is no second resolution an attacker's DNS could answer
differently). Idle connections expire after ``idle_s``; the pool is bounded per host and in
total.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import httptools

from shared.policy import netpolicy

#: Response body bytes kept (for the error of a failed call); the rest is read and dropped.
KEEP_BODY: Final = 300
#: A body longer than this is not read to the end: the connection is closed instead.
MAX_DRAIN: Final = 1 << 20
#: Status line and headers, all of them (and 1xx interim responses before them).
MAX_HEAD: Final = 64 * 1024
#: Bytes that are neither head nor body (chunk-size lines, extensions, trailers) allowed in a
#: response, plus ``FRAMING_PER_CHUNK`` for each chunk.
MAX_FRAMING: Final = 8 * 1024
FRAMING_PER_CHUNK: Final = 256
#: The reason of a delivery refused by the address policy (the pinned wording).
NOT_ALLOWED: Final = "target address not allowed"

Key = tuple[str, str, int]


class HttpError(Exception):
    """The call failed before a complete response arrived."""


class AddressNotAllowed(HttpError):
    """The host resolved to an address the operator does not allow."""

    def __init__(self, host: str, address: str) -> None:
        super().__init__(NOT_ALLOWED)
        self.host = host
        self.address = address


class _Stop(Exception):
    """Raised from a parser callback to stop reading (the answer is already known)."""


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
    def key(self) -> Key:
        return (self.scheme, self.host, self.port)


@functools.lru_cache(maxsize=65_536)
def parse_url(url: str) -> Target:
    parts = urlsplit(url)
    try:
        port_given = parts.port
    except ValueError:
        raise HttpError(f"bad port in {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpError(f"not an http(s) URL: {url!r}")
    default = 443 if parts.scheme == "https" else 80
    port = port_given or default
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
    """One keep-alive connection; a single request at a time. Also the parser's callbacks."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Response] | None = None
        self.closed = False
        self.received_any = False
        #: loop.time() when it went back to the pool.
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.fed = 0
        self.body = bytearray()
        self.drained = 0
        self.chunks = 0
        self.lengths: set[bytes] = set()
        self.transfer_encoding: bytes | None = None
        self.retry_after: str | None = None

    # --- asyncio callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self.headers_done and self._close_delimited():
            waiter.set_result(Response(self.status, bytes(self.body), False, self.retry_after))
        else:
            waiter.set_exception(HttpError(f"connection closed: {exc or 'by the server'}"))

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self._close()  # unsolicited bytes: this connection cannot be trusted
            return
        self.received_any = True
        self.fed += len(data)
        try:
            self.parser.feed_data(data)
            self._check_bounds()
        except _Stop:
            self._close()
        except HttpError as exc:
            self._fail(exc)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Stop):
                self._close()
            else:
                self._fail(cause if isinstance(cause, HttpError) else HttpError(str(exc)))
        except httptools.HttpParserUpgrade:
            self._fail(HttpError("malformed response: protocol upgrade is not supported"))
        except httptools.HttpParserError as exc:
            self._fail(HttpError(f"malformed response: {exc}"))

    def _check_bounds(self) -> None:
        if self.complete:
            return
        if not self.headers_done:
            if self.fed > MAX_HEAD:
                raise HttpError(f"response head larger than {MAX_HEAD} bytes")
            return
        framing = self.fed - self.drained
        if framing > MAX_HEAD + MAX_FRAMING + FRAMING_PER_CHUNK * self.chunks:
            raise HttpError("chunk-size lines or trailers of the response are too long")

    # --- parser callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise _Stop  # bytes after the response: do not read (or reuse) any further

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.headers_done:
            return  # a trailer field: not merged into the header section (RFC 9110 6.5.1)
        lowered = name.lower()
        if lowered == b"content-length":
            self._check_length(value)
        elif lowered == b"transfer-encoding":
            if self.transfer_encoding is not None:
                raise HttpError("malformed response: Transfer-Encoding given twice")
            self.transfer_encoding = value
        elif lowered == b"retry-after":
            self.retry_after = value.decode("latin-1")[:64]

    def _check_length(self, value: bytes) -> None:
        text = value.strip()
        if not text.isdigit() or not text.isascii() or len(text) > 18:
            raise HttpError(f"malformed response: bad Content-Length {value[:40]!r}")
        self.lengths.add(text.lstrip(b"0") or b"0")
        if len(self.lengths) > 1:
            raise HttpError("malformed response: Content-Length values disagree")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # An interim response (100 Continue): the real one follows.
            self.lengths.clear()
            self.transfer_encoding = None
            self.retry_after = None
            return
        encoding = self.transfer_encoding
        if encoding is not None and encoding.strip().lower() != b"chunked":
            raise HttpError(f"malformed response: Transfer-Encoding {encoding[:40]!r}")
        self.status = status
        self.headers_done = True

    def on_chunk_header(self) -> None:
        self.chunks += 1

    def on_body(self, body: bytes) -> None:
        if len(self.body) < KEEP_BODY:
            self.body += body[: KEEP_BODY - len(self.body)]
        self.drained += len(body)
        if self.drained > MAX_DRAIN:
            # Enough to judge the call: answer now and drop the connection.
            self._answer(keep_alive=False)
            raise _Stop

    def on_message_complete(self) -> None:
        if not self.headers_done:
            return  # the end of an interim response
        self._answer(keep_alive=self.parser.should_keep_alive())

    # --- requests ---------------------------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.received_any = False
        self._reset()
        self.transport.write(request)
        return self.waiter

    def _close_delimited(self) -> bool:
        return not self.lengths and self.transfer_encoding is None

    def _answer(self, keep_alive: bool) -> None:
        self.complete = True
        if not keep_alive:
            self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(
                Response(self.status, bytes(self.body), keep_alive, self.retry_after)
            )

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self._close()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Pool:
    """Idle keep-alive connections: newest reused first, expired after ``idle_s``, at most
    ``limit`` across every host (the oldest is closed to make room)."""

    def __init__(self, limit: int, idle_s: float) -> None:
        self.limit = limit
        self.idle_s = idle_s
        self._by_key: dict[Key, collections.deque[_Connection]] = {}
        #: Every idle connection, oldest first.
        self._order: collections.OrderedDict[_Connection, Key] = collections.OrderedDict()
        #: Closes expired connections while no call comes (one timer, not one per connection).
        self._timer: asyncio.TimerHandle | None = None

    def take(self, key: Key, now: float) -> _Connection | None:
        idle = self._by_key.get(key)
        while idle:
            connection = idle.pop()
            del self._order[connection]
            if not connection.closed and now - connection.idle_since < self.idle_s:
                self._forget_if_empty(key)
                return connection
            connection._close()
        self._forget_if_empty(key)
        return None

    def put(self, key: Key, connection: _Connection, now: float) -> None:
        connection.idle_since = now
        connection.waiter = None
        self._by_key.setdefault(key, collections.deque()).append(connection)
        self._order[connection] = key
        self.prune(now)
        self._arm()

    def _arm(self) -> None:
        if self._timer is None and self._order:
            self._timer = asyncio.get_running_loop().call_later(self.idle_s, self._expire)

    def _expire(self) -> None:
        self._timer = None
        self.prune(asyncio.get_running_loop().time())
        self._arm()

    def prune(self, now: float) -> None:
        while self._order:
            oldest, key = next(iter(self._order.items()))
            if len(self._order) <= self.limit and now - oldest.idle_since < self.idle_s:
                return
            del self._order[oldest]
            self._by_key[key].remove(oldest)
            self._forget_if_empty(key)
            oldest._close()

    def _forget_if_empty(self, key: Key) -> None:
        if key in self._by_key and not self._by_key[key]:
            del self._by_key[key]

    def __len__(self) -> int:
        return len(self._order)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for connection in self._order:
            connection._close()
        self._order.clear()
        self._by_key.clear()


class _Limit:
    """A counting limit served in arrival order, O(1) per call: ``asyncio.Semaphore`` looks
    at every waiter on each acquire, and a herd to one host keeps hundreds waiting."""

    __slots__ = ("_waiters", "free")

    def __init__(self, size: int) -> None:
        self.free = size
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # handed over as we were cancelled: passed on
            raise

    def release(self) -> None:
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():  # a cancelled waiter is skipped here
                future.set_result(None)
                return
        self.free += 1


class _HostSlots:
    """A semaphore per host, forgotten when nobody uses it (tenants may name many hosts)."""

    def __init__(self, per_host: int) -> None:
        self.per_host = per_host
        self._slots: dict[Key, tuple[_Limit, list[int]]] = {}

    def acquire(self, key: Key) -> _Limit:
        entry = self._slots.get(key)
        if entry is None:
            entry = self._slots[key] = (_Limit(self.per_host), [0])
        entry[1][0] += 1
        return entry[0]

    def release(self, key: Key) -> None:
        users = self._slots[key][1]
        users[0] -= 1
        if users[0] == 0:
            del self._slots[key]

    def __len__(self) -> int:
        return len(self._slots)


class HttpClient:
    """Keep-alive connections pooled per (scheme, host, port): at most ``per_host`` calls in
    flight per host and ``total`` overall; at most ``total`` idle connections kept."""

    def __init__(
        self,
        per_host: int,
        policy: netpolicy.AddressPolicy,
        *,
        total: int = 1024,
        idle_s: float = 15.0,
        ssl_context: ssl.SSLContext | None = None,
        user_agent: str = "cronbus",
    ) -> None:
        self.policy = policy
        self.ssl_context = ssl_context
        self.user_agent = user_agent
        self.pool = _Pool(total, idle_s)
        self._hosts = _HostSlots(per_host)
        self._total = _Limit(total)

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
        """One call, from connect to the last byte within ``timeout_s`` (TimeoutError), or
        HttpError (AddressNotAllowed when the host resolves to an address not allowed)."""
        target = parse_url(url)
        request = self._encode(method, target, headers, body)
        slots = self._hosts.acquire(target.key)
        try:
            async with asyncio.timeout(timeout_s):
                await self._total.acquire()
                try:
                    await slots.acquire()
                    try:
                        return await self._exchange(target, request)
                    finally:
                        slots.release()
                finally:
                    self._total.release()
        finally:
            self._hosts.release(target.key)

    async def _exchange(self, target: Target, request: bytes) -> Response:
        now = asyncio.get_running_loop().time()
        connection = self.pool.take(target.key, now)
        if connection is not None:
            try:
                return await self._round_trip(target, connection, request)
            except HttpError:
                if connection.received_any:
                    raise
                # The server closed the idle connection: once more on a fresh one.
        connection = await self._connect(target)
        return await self._round_trip(target, connection, request)

    async def _round_trip(
        self, target: Target, connection: _Connection, request: bytes
    ) -> Response:
        try:
            response = await connection.send(request)
        except BaseException:
            connection._close()
            raise
        if response.keep_alive and not connection.closed:
            self.pool.put(target.key, connection, asyncio.get_running_loop().time())
        else:
            connection._close()
        return response

    async def _checked_addresses(self, target: Target) -> list[str]:
        """Every address the host resolves to (one resolution), or AddressNotAllowed when
        any of them is not allowed."""
        try:
            addresses = [ipaddress.ip_address(target.host)]
        except ValueError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    target.host, target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                )
            except (OSError, UnicodeError) as exc:
                raise HttpError(f"cannot resolve {target.host}: {exc}") from exc
            addresses = list(
                dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos)
            )
        for address in addresses:
            if not self.policy.allows(address):
                raise AddressNotAllowed(target.host, str(address))
        return [str(address) for address in addresses]

    async def _connect(self, target: Target) -> _Connection:
        addresses = await self._checked_addresses(target)
        loop = asyncio.get_running_loop()
        tls = target.scheme == "https"
        failure: Exception | None = None
        for address in addresses:
            try:
                _, protocol = await loop.create_connection(
                    _Connection,
                    address,
                    target.port,
                    ssl=self._ssl() if tls else None,
                    server_hostname=target.host if tls else None,
                )
            except (OSError, ssl.SSLError) as exc:
                failure = exc
                continue
            return protocol
        raise HttpError(f"cannot connect to {target.authority}: {failure}")

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
        self.pool.close()
