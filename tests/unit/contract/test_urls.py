"""CRONBUS_AMQP_URL's list of nodes, and URLs masked wherever they are logged."""

from __future__ import annotations

import logging
import sys

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.contract import urls
from shared.runtime import logs, transient
from shared.runtime.config import CommonSettings

SECRET = st.text(
    alphabet=st.characters(exclude_characters="@/,?# \t\n\r:", categories=("L", "N", "P", "S")),
    min_size=1,
    max_size=20,
).filter(lambda s: s.isprintable() and s != "***")


def test_one_url_is_a_list_of_one() -> None:
    assert urls.amqp_urls("amqp://guest:guest@127.0.0.1:5672/") == (
        "amqp://guest:guest@127.0.0.1:5672/",
    )


def test_a_cluster_is_its_urls_in_order() -> None:
    listed = "amqp://u:p@a:5672/v, amqps://u:p@b:5671/v ,amqp://u:p@c/v"
    assert urls.amqp_urls(listed) == (
        "amqp://u:p@a:5672/v",
        "amqps://u:p@b:5671/v",
        "amqp://u:p@c/v",
    )


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "no URL"),
        ("amqp://u:p@a/,", "URL 2 of 2 is empty"),
        ("amqp://u:p@a/,,amqp://u:p@b/", "URL 2 of 3 is empty"),
        ("amqp://u:p@a/,http://u:p@b/", "URL 2 of 2: must start with amqp://"),
        ("amqp://u:p@a:99999/", "the URL: the port must be a number"),
        ("amqp:///vhost", "the URL: names no host"),
        ("amqp://u:p@a/,amqp://u:p@a/", "listed twice"),
    ],
)
def test_a_bad_list_is_refused_saying_which_url_and_why(value: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as refused:
        urls.amqp_urls(value)
    assert "p@" not in str(refused.value)


def test_a_service_refuses_a_bad_list_naming_the_setting_without_the_password() -> None:
    with pytest.raises(pydantic.ValidationError) as refused:
        CommonSettings(amqp_url="amqp://u:s3cret@a/,ftp://u:s3cret@b/")
    (error,) = refused.value.errors()
    assert error["loc"] == ("amqp_url",)
    assert "URL 2 of 2" in error["msg"]
    assert "s3cret" not in error["msg"]


@given(
    user=st.from_regex(r"[a-z]{1,8}", fullmatch=True),
    password=SECRET,
    hosts=st.lists(st.from_regex(r"[a-z]{1,8}(:[0-9]{2,5})?", fullmatch=True), min_size=1),
    scheme=st.sampled_from(["amqp", "amqps", "postgresql", "redis", "rediss", "http"]),
)
def test_no_password_of_a_list_survives_masking(
    user: str, password: str, hosts: list[str], scheme: str
) -> None:
    listed = ",".join(f"{scheme}://{user}:{password}@{host}/v" for host in hosts)
    text = urls.masked(f"cannot connect to {listed}: refused")
    assert f":{password}@" not in text
    for host in hosts:
        assert f"{user}:***@{host}/v" in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("amqp://guest@h:5672/", "amqp://guest@h:5672/"),
        ("amqp://h:5672/vhost", "amqp://h:5672/vhost"),
        ("postgresql://a:b@h1:5432,h2:5432/db", "postgresql://a:***@h1:5432,h2:5432/db"),
        ("host=h user=u password=pw dbname=d", "host=h user=u password=*** dbname=d"),
        ("amqp://u:pa/ss@h/", "amqp://u:***@h/"),
    ],
)
def test_masking_keeps_what_is_not_a_password(text: str, expected: str) -> None:
    assert urls.masked(text) == expected


def _record(message: str, **fields: object) -> logging.LogRecord:
    record = logging.makeLogRecord({"msg": message, "levelname": "WARNING", "name": "t"})
    record.__dict__.update(fields)
    return record


@pytest.mark.parametrize("formatter", [logs.JsonFormatter(), logs.TextFormatter("%(message)s")])
def test_every_log_line_masks_urls_in_its_message_fields_and_traceback(
    formatter: logging.Formatter,
) -> None:
    try:
        raise OSError("connect to amqp://u:tb-secret@b:5672/ failed")
    except OSError:
        exc_info = sys.exc_info()
    record = _record(
        "node amqp://u:msg-secret@a:5672/ lost",
        error="at postgresql://u:field-secret@db/x",
        exc_info=exc_info,
    )
    record.exc_info = exc_info
    line = formatter.format(record)
    for secret in ("msg-secret", "field-secret", "tb-secret"):
        assert secret not in line
    assert "u:***@a:5672" in line


def test_the_retry_log_says_the_error_without_passwords() -> None:
    error = ValueError("Max length exceeded for amqp://u:p1@a/,amqp://u:p2@b/")
    described = transient.said(error)
    assert "p1" not in described and "p2" not in described
    assert "Max length exceeded" in described


def test_host_port_names_no_user() -> None:
    assert urls.host_port("amqp://u:p@rabbit-1/v") == "rabbit-1:5672"
    assert urls.host_port("amqps://u:p@[::1]:5000/v") == "[::1]:5000"
