"""The executor's HTTP/1.1 client against real servers on loopback speaking each framing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from cronbus.cli.sink import Sink
from services.executor.http import MAX_DRAIN, HttpClient, HttpError, parse_url
from shared.policy import netpolicy

LOOPBACK = netpolicy.AddressPolicy.from_text(netpolicy.LOOPBACK)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return head, body


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(closing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
async def client() -> AsyncIterator[HttpClient]:
    found = HttpClient(per_host=4, policy=LOOPBACK)
    yield found
    await found.close()


async def test_keep_alive_reuses_one_connection_and_sends_what_it_is_given(
    client: HttpClient,
) -> None:
    connections = 0
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while not reader.at_eof():
            try:
                seen.append(await read_request(reader))
            except asyncio.IncompleteReadError:
                break
            writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server, url = await serve(handler)
    async with server:
        for i in range(5):
            response = await client.request(
                "POST", f"{url}/hook?x={i}", [("X-Tenant", "acme")], b'{"a":1}', 5
            )
            assert (response.status, response.body) == (201, b"ok")
    assert connections == 1
    head, body = seen[0]
    assert head.startswith(b"POST /hook?x=0 HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:" in head and b"\r\nX-Tenant: acme\r\n" in head
    assert b"\r\nContent-Length: 7\r\n" in head and body == b'{"a":1}'


@pytest.mark.parametrize(
    ("reply", "status", "body"),
    [
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n",
            200,
            b"hello world",
        ),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n",
            202,
            b"",
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", 204, b""),
        (b"HTTP/1.1 503 Busy\r\nContent-Length: 9\r\n\r\ntoo busy!", 503, b"too busy!"),
    ],
)
async def test_response_framings(
    client: HttpClient, reply: bytes, status: int, body: bytes
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(reply)
            await writer.drain()
        writer.close()

    server, url = await serve(handler)
    async with server:
        for _ in range(2):  # the second call reuses the connection after the framing
            response = await client.request("POST", url, [], b"{}", 5)
            assert (response.status, response.body) == (status, body)


async def test_close_delimited_body_and_a_long_body_cut_short(client: HttpClient) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/long" in head:
            writer.write(b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n" % (MAX_DRAIN * 4))
            writer.write(b"x" * (MAX_DRAIN + 1000))
        else:
            writer.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    server, url = await serve(handler)
    async with server:
        response = await client.request("GET", f"{url}/short", [], None, 5)
        assert (response.status, response.body, response.keep_alive) == (200, b"all of it", False)
        long = await client.request("GET", f"{url}/long", [], None, 5)
        assert long.status == 500 and long.body == b"x" * 300


async def test_a_keep_alive_connection_closed_while_idle_is_replaced(
    client: HttpClient,
) -> None:
    calls = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        await read_request(reader)
        calls += 1
        # Promises keep-alive, then closes the idle connection anyway.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server, url = await serve(handler)
    async with server:
        for _ in range(3):
            assert (await client.request("POST", url, [], b"", 5)).status == 200
            await asyncio.sleep(0.05)
    assert calls == 3


async def test_timeouts_refusals_and_garbage_are_errors(client: HttpClient) -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            await asyncio.sleep(1)
        finally:
            writer.close()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 hello\r\n\r\n")
        await writer.drain()
        writer.close()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        writer.close()

    for handler, error in ((slow, TimeoutError), (garbage, HttpError), (hang_up, HttpError)):
        server, url = await serve(handler)
        async with server:
            with pytest.raises(error):
                await client.request("POST", url, [], b"x", 0.5)
    server, url = await serve(slow)
    server.close()
    await server.wait_closed()
    with pytest.raises(HttpError, match="cannot connect"):
        await client.request("GET", url, [], None, 2)


async def test_many_calls_at_once_against_the_sink() -> None:
    sink = Sink()
    await sink.start()
    client = HttpClient(per_host=8, policy=LOOPBACK)
    try:
        results = await asyncio.gather(
            *(
                client.request("POST", f"{sink.url}/x/{i}", [("Idempotency-Key", str(i))], b"{}", 5)
                for i in range(500)
            )
        )
        assert {r.status for r in results} == {200}
        assert sorted(int(r.key) for r in sink.received) == list(range(500))
    finally:
        await client.close()
        await sink.stop()


def test_url_parsing() -> None:
    target = parse_url("https://example.com/a/b?c=1")
    assert (target.scheme, target.host, target.port, target.path, target.authority) == (
        "https",
        "example.com",
        443,
        "/a/b?c=1",
        "example.com",
    )
    assert parse_url("http://[::1]:8080").authority == "[::1]:8080"
    assert parse_url("http://h").path == "/"
    with pytest.raises(HttpError):
        parse_url("ftp://h/x")
