"""TLS to Redis and PostgreSQL: private servers speaking TLS with a CA this test creates; the
services' clients connect with rediss:// and CRONBUS_REDIS_CA_FILE, and with PostgreSQL's
sslmode=verify-full, and refuse a server they cannot verify."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
import redis.exceptions

from shared.contract import keys
from shared.postgres.store import Store
from shared.redis import connection, index
from shared.runtime.config import CommonSettings
from tests.support import private, services, tls
from tests.support.stack import Stack


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, tls.Certificates]]:
    certificates = tls.make(tmp_path, ["localhost"])
    port = services.free_port()
    log = tmp_path / "redis.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                "redis-server",
                *("--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"),
                *(
                    "--tls-cert-file",
                    str(certificates.cert),
                    "--tls-key-file",
                    str(certificates.key),
                ),
                *("--tls-ca-cert-file", str(certificates.ca), "--tls-auth-clients", "no"),
                *("--save", "", "--appendonly", "no", "--dir", str(tmp_path)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 10
        while not services.port_open("127.0.0.1", port, timeout=0.2):
            if process.poll() is not None:
                pytest.skip(f"this redis-server has no TLS: {log.read_text()[-300:]}")
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield port, certificates
    finally:
        process.kill()
        process.wait()


async def test_the_services_redis_client_speaks_tls_and_verifies_the_server(
    tls_redis: tuple[int, tls.Certificates],
) -> None:
    port, certificates = tls_redis
    settings = CommonSettings(
        redis_url=f"rediss://localhost:{port}/0", redis_ca_file=str(certificates.ca)
    )
    client = connection.connect(settings)
    try:
        assert await client.ping()
        # The scripts load and run over TLS as over plain TCP.
        idx = index.Index(client, keys.RedisKeys("tls"), 4)
        await idx.load_scripts()
        assert await client.set("tls:probe", "ok") and await client.get("tls:probe") == b"ok"
    finally:
        await client.aclose()
    # Without our CA the server is a stranger; under another name than its certificate's, too.
    for url, ca in (
        (f"rediss://localhost:{port}/0", ""),
        (f"rediss://127.0.0.1:{port}/0", str(certificates.ca)),
    ):
        stranger = connection.connect(CommonSettings(redis_url=url, redis_ca_file=ca))
        try:
            with pytest.raises(redis.exceptions.ConnectionError, match="certificate verify failed"):
                await stranger.ping()
        finally:
            await stranger.aclose()


async def test_a_service_runs_against_redis_over_tls(
    tls_redis: tuple[int, tls.Certificates], stack: Stack
) -> None:
    port, certificates = tls_redis
    sweeper = stack.start(
        "sweeper",
        CRONBUS_REDIS_URL=f"rediss://localhost:{port}/0",
        CRONBUS_REDIS_CA_FILE=str(certificates.ca),
    )
    await stack.wait_ready(sweeper)  # /readyz: Redis answered, over TLS
    status, body = await asyncio.to_thread(sweeper.get, "/readyz")
    assert status == 200 and json.loads(body)["redis"] is True


@pytest.fixture
def tls_postgres() -> Iterator[tuple[int, tls.Certificates]]:
    """A private PostgreSQL with ssl=on and a certificate for "localhost" from our CA."""
    if private.available() is not None or os.geteuid() != 0:
        pytest.skip(f"no private PostgreSQL here: {private.available() or 'not root'}")
    directory = private._owned_dir("cbt-pgtls-", "postgres")
    server = private.PrivatePostgres(services.free_port(), directory)
    try:
        server.start()
        certificates = tls.make(directory, ["localhost"])
        for path in (certificates.cert, certificates.key, certificates.ca):
            shutil.chown(path, "postgres", "postgres")
        with (directory / "data" / "postgresql.conf").open("a") as conf:
            conf.write(
                f"ssl = on\nssl_cert_file = '{certificates.cert}'\n"
                f"ssl_key_file = '{certificates.key}'\n"
            )
        server.restart()
        yield server.port, certificates
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


async def test_postgres_verify_full_checks_the_certificate_and_the_host_name(
    tls_postgres: tuple[int, tls.Certificates],
) -> None:
    port, certificates = tls_postgres
    ca = certificates.ca
    url = f"postgresql://postgres@localhost:{port}/postgres"
    # The services' PostgreSQL client: the pool behind every query, and the migrator.
    store = await Store.open(f"{url}?sslmode=verify-full&sslrootcert={ca}", min_size=1, max_size=1)
    try:
        async with store.pool.acquire() as connection:
            assert await connection.fetchval(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
            )
    finally:
        await store.close()
    # Under another name than the certificate's, or without our CA: refused.
    for bad in (
        f"postgresql://postgres@127.0.0.1:{port}/postgres?sslmode=verify-full&sslrootcert={ca}",
        f"{url}?sslmode=verify-full&sslrootcert={certificates.cert}",
    ):
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncpg.connect(bad)
