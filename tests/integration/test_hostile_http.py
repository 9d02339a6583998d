"""The webhook client against a hostile server: every attack ends in a clear failure, soon,
without the client buffering what the server sends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from services.executor.http import (
    MAX_DRAIN,
    MAX_FRAMING,
    MAX_HEAD,
    AddressNotAllowed,
    HttpClient,
    HttpError,
)
from shared.policy import netpolicy
from tests.support.hostile import HostileServer

LOOPBACK = netpolicy.AddressPolicy.from_text(netpolicy.LOOPBACK)


@pytest.fixture
async def hostile() -> AsyncIterator[HostileServer]:
    server = await HostileServer().start()
    yield server
    await server.stop()


@pytest.fixture
async def client() -> AsyncIterator[HttpClient]:
    found = HttpClient(per_host=4, policy=LOOPBACK)
    yield found
    await found.close()


#: Path -> what the failure says. Each must fail well before the 5 s timeout.
REFUSED = {
    "/endless-chunk-size": "malformed response",
    "/endless-chunk-extension": "chunk-size lines or trailers of the response are too long",
    "/endless-trailer": "chunk-size lines or trailers of the response are too long",
    "/huge-header": f"response head larger than {MAX_HEAD} bytes",
    "/endless-headers": f"response head larger than {MAX_HEAD} bytes",
    "/endless-interim": f"response head larger than {MAX_HEAD} bytes",
    "/negative-length": "malformed response",
    "/plus-length": "malformed response",
    "/underscore-length": "malformed response",
    "/hex-length": "malformed response",
    "/disagreeing-lengths": "malformed response",
    "/list-length": "malformed response",
    "/gzip-coding": "malformed response",
    "/gzip-chunked-coding": "malformed response",
    "/length-and-chunked": "malformed response",
    "/huge-chunk-size": "malformed response",
    "/not-http": "malformed response",
}


@pytest.mark.parametrize("path", sorted(REFUSED))
async def test_each_attack_fails_fast_with_a_clear_reason(
    hostile: HostileServer, client: HttpClient, path: str
) -> None:
    started = time.monotonic()
    with pytest.raises(HttpError) as caught:
        await client.request("POST", f"{hostile.url}{path}", [], b"{}", 5)
    took = time.monotonic() - started
    assert REFUSED[path] in str(caught.value), caught.value
    assert took < 2, f"{path} took {took:.2f}s"
    await asyncio.sleep(0.05)  # the server notices the hang-up
    # The client stopped reading soon: the server could not push much more than its socket
    # buffers hold (a few MB on loopback) past the bound.
    sent = hostile.sent.get(path, 0)
    print(f"{path}: {str(caught.value)!r} after {took * 1000:.0f} ms, server sent {sent} bytes")
    assert hostile.sent.get(path, 0) < 16 * 1024 * 1024


async def test_a_slow_drip_is_cut_by_the_timeout_of_the_whole_response(
    hostile: HostileServer, client: HttpClient
) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await client.request("POST", f"{hostile.url}/slow-drip", [], b"{}", 1)
    # The drip would take 5,000 s; a few seconds' slack keeps a loaded CI machine from
    # failing what only the 1 s timeout of the whole response can explain.
    assert 0.9 < time.monotonic() - started < 4.0


@pytest.mark.parametrize("path", ["/endless-body", "/endless-chunks"])
async def test_an_endless_body_is_judged_on_its_first_megabyte(
    hostile: HostileServer, client: HttpClient, path: str
) -> None:
    response = await client.request("POST", f"{hostile.url}{path}", [], b"{}", 5)
    assert response.status == 200 and not response.keep_alive
    assert len(response.body) == 300
    await asyncio.sleep(0.05)
    assert hostile.sent[path] < MAX_DRAIN + 16 * 1024 * 1024


async def test_many_small_chunks_are_not_mistaken_for_an_attack(client: HttpClient) -> None:
    chunks = b"".join(b"1;e=1\r\nx\r\n" for _ in range(MAX_FRAMING))

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
        writer.write(b"0\r\nX-Checksum: 1\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        response = await client.request("GET", f"http://127.0.0.1:{port}/", [], None, 5)
    assert response.status == 200 and response.body == b"x" * 300


async def test_names_are_resolved_and_every_address_checked() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        for policy in (netpolicy.AddressPolicy(), netpolicy.AddressPolicy.from_text(["::1/128"])):
            denied = HttpClient(per_host=1, policy=policy)
            with pytest.raises(AddressNotAllowed, match=r"^target address not allowed$") as caught:
                await denied.request("GET", f"http://localhost:{port}/", [], None, 5)
            assert caught.value.host == "localhost"
            with pytest.raises(AddressNotAllowed):
                await denied.request("GET", f"http://127.0.0.1:{port}/", [], None, 5)
            with pytest.raises(AddressNotAllowed):
                await denied.request("GET", f"http://[::ffff:127.0.0.1]:{port}/", [], None, 5)
        allowed = HttpClient(per_host=1, policy=LOOPBACK)
        try:
            response = await allowed.request("GET", f"http://localhost:{port}/", [], None, 5)
            assert response.status == 204
        finally:
            await allowed.close()


async def test_the_pool_is_bounded_in_total_and_idle_connections_expire() -> None:
    accepted: list[int] = []

    def server_for(index: int):  # type: ignore[no-untyped-def]
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(index)
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
            writer.close()

        return handler

    servers = [await asyncio.start_server(server_for(i), "127.0.0.1", 0) for i in range(3)]
    urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}/" for s in servers]
    client = HttpClient(per_host=2, policy=LOOPBACK, total=2, idle_s=0.3)
    try:
        for url in urls:
            await client.request("GET", url, [], None, 5)
        assert len(client.pool) == 2  # the oldest idle connection was closed
        await client.request("GET", urls[2], [], None, 5)
        assert accepted == [0, 1, 2]  # reused
        await asyncio.sleep(0.4)
        await client.request("GET", urls[2], [], None, 5)
        assert accepted == [0, 1, 2, 2]  # expired: a new connection
        assert len(client.pool) == 1
    finally:
        await client.close()
        for server in servers:
            server.close()
