"""CRONBUS_QUOTAS_FILE: parsing, the "*" default, re-reading a changed file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.contract.errors import ConfigError
from shared.runtime import quotas


def test_a_namespace_has_its_own_quota_or_the_default() -> None:
    found = quotas.parse(
        b'{"acme": {"max_schedules": 10, "max_fires_per_s": 5}, "*": {"max_schedules": 2}}'
    )
    assert found.of("acme") == quotas.Quota(max_schedules=10, max_fires_per_s=5)
    assert found.of("other") == quotas.Quota(max_schedules=2)
    assert quotas.parse(b"{}").of("acme") is None


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (b"[1]", "JSON object"),
        (b"{", "not JSON"),
        (b'{"acme": {"max_schedules": -1}}', "acme.max_schedules"),
        (b'{"acme": {"max_fires_per_s": 0}}', "acme.max_fires_per_s"),
        (b'{"acme": {"max_fire_per_s": 3}}', "acme.max_fire_per_s"),
        (b'{"acme": 3}', "acme"),
    ],
)
def test_a_bad_file_is_refused_naming_the_entry(text: bytes, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        quotas.parse(text)


def test_a_changed_file_is_re_read_and_a_broken_one_keeps_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quotas, "CHECK_EVERY_S", 0.0)
    path = tmp_path / "quotas.json"
    path.write_text('{"acme": {"max_schedules": 1}}')
    file = quotas.QuotaFile(str(path))
    assert file.of("acme") == quotas.Quota(max_schedules=1)
    path.write_text('{"acme": {"max_schedules": 7}}')
    os.utime(path, (1, 1))
    assert file.of("acme") == quotas.Quota(max_schedules=7)
    path.write_text("{broken")
    os.utime(path, (2, 2))
    assert file.of("acme") == quotas.Quota(max_schedules=7)
    assert quotas.QuotaFile("").of("acme") is None


def test_a_missing_file_stops_the_service_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CRONBUS_QUOTAS_FILE"):
        quotas.QuotaFile(str(tmp_path / "absent.json"))
