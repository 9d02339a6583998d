"""Redis Sentinel settings: checked at start, each refusal naming the setting(s); the clients
built from them (no I/O: a client connects on its first command)."""

from __future__ import annotations

import os
import subprocess
import sys

import pydantic
import pytest

from shared.redis import connection
from shared.runtime.config import CommonSettings, host_ports


@pytest.mark.parametrize(
    ("text", "pairs"),
    [
        ("", []),
        ("10.0.0.1:26379", [("10.0.0.1", 26379)]),
        (
            " s-0.sentinel:26379 , s-1.sentinel:26380,",
            [("s-0.sentinel", 26379), ("s-1.sentinel", 26380)],
        ),
        ("[::1]:26379", [("::1", 26379)]),
    ],
)
def test_sentinel_addresses_parse(text: str, pairs: list[tuple[str, int]]) -> None:
    assert host_ports(text) == pairs


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("sentinel", "'sentinel' is not host:port"),
        (":26379", "':26379' is not host:port"),
        ("s:0", "the port must be a number from 1 to 65535"),
        ("s:65536", "the port must be a number from 1 to 65535"),
        ("s:\uff12\uff16\uff13\uff17\uff19", "the port must be a number from 1 to 65535"),
        ("s:", "the port must be a number from 1 to 65535"),
        ("::1:26379", "write an IPv6 address in brackets, [::1]:26379"),
        ("redis://s:26379", "is not host:port"),
        ("user@s:26379", "is not host:port"),
    ],
)
def test_a_malformed_sentinel_is_refused_naming_it(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        host_ports(text)


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        (
            {"redis_sentinels": "s:26379"},
            "CRONBUS_REDIS_SENTINELS and CRONBUS_REDIS_SENTINEL_MASTER",
        ),
        (
            {"redis_sentinel_master": "m"},
            "CRONBUS_REDIS_SENTINELS and CRONBUS_REDIS_SENTINEL_MASTER",
        ),
        (
            {"redis_sentinels": "s:26379", "redis_sentinel_master": "m", "redis_cluster": True},
            "CRONBUS_REDIS_SENTINELS and CRONBUS_REDIS_CLUSTER",
        ),
    ],
)
def test_sentinel_settings_go_together(settings: dict[str, object], names: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=names):
        CommonSettings(**settings)  # type: ignore[arg-type]


def test_a_service_started_with_half_of_sentinel_says_which_settings() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.sweeper"],
        env={**os.environ, "CRONBUS_REDIS_SENTINEL_MASTER": "cronbus"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "cronbus sweeper: configuration: CRONBUS_REDIS_SENTINELS and "
        "CRONBUS_REDIS_SENTINEL_MASTER go together: set both (Sentinel) or neither"
    )


def test_a_malformed_sentinel_stops_the_start_in_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.executor"],
        env={
            **os.environ,
            "CRONBUS_REDIS_SENTINELS": "s-0:26379,s-1",
            "CRONBUS_REDIS_SENTINEL_MASTER": "cronbus",
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "cronbus executor: configuration: CRONBUS_REDIS_SENTINELS: Value error, "
        "'s-1' is not host:port"
    )


def test_the_url_gives_database_credentials_and_tls_not_the_host() -> None:
    options = connection.sentinel_url_options("rediss://app:s%3Acret@ignored:6390/3")
    assert options == {"db": 3, "username": "app", "password": "s:cret", "ssl": True}
    assert connection.sentinel_url_options("redis://ignored/0") == {"db": 0, "ssl": False}


async def test_a_sentinel_client_asks_the_sentinels_for_the_primary() -> None:
    settings = CommonSettings(
        redis_url="redis://:pw@ignored:1/5",
        redis_sentinels="10.0.0.1:26379,10.0.0.2:26379",
        redis_sentinel_master="cronbus",
    )
    for client in (connection.connect(settings), connection.connect_node(settings)):
        assert isinstance(client, connection.SentinelRedis)
        pool = client.connection_pool
        assert pool.service_name == "cronbus"  # type: ignore[attr-defined]
        assert pool.connection_kwargs["db"] == 5
        assert pool.connection_kwargs["password"] == "pw"
        assert client.sentinels is not None
        addresses = [
            (
                s.connection_pool.connection_kwargs["host"],
                s.connection_pool.connection_kwargs["port"],
            )
            for s in client.sentinels.sentinels
        ]
        assert addresses == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]
        await client.aclose()
    client = connection.connect(settings)
    assert isinstance(client, connection.SentinelRedis)
    assert client.connection_pool.connection_class is connection.FastSentinelConnection
    await client.aclose()
