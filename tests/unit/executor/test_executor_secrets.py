"""The executor's secret files: secret header values and signing keys, re-read on change."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from services.executor.secrets import SecretHeaders, SecretMissing, SigningSecrets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def whsec(seed: bytes) -> str:
    return "whsec_" + base64.b64encode(seed * 32).decode()


def test_secret_header_values_are_read_cached_briefly_and_checked(tmp_path: Path) -> None:
    (tmp_path / "acme").mkdir()
    token = tmp_path / "acme" / "billing-token"
    token.write_text("Bearer one\n")
    clock = Clock()
    secrets = SecretHeaders(str(tmp_path), clock)
    assert secrets.value("acme", "billing-token") == "Bearer one"
    token.write_text("Bearer two")
    assert secrets.value("acme", "billing-token") == "Bearer one"  # cached for a second
    clock.now += 1.1
    assert secrets.value("acme", "billing-token") == "Bearer two"
    (tmp_path / "acme" / "bad").write_text("a\r\nInjected: yes")
    problems = {
        ("acme", "nope"): "secret 'nope' not found for namespace 'acme'",
        ("other", "billing-token"): "secret 'billing-token' not found for namespace 'other'",
        ("acme", "../acme/billing-token"): "has a name that is not allowed",
        ("..", "billing-token"): "has a name that is not allowed",
        ("acme", "bad"): "holds control characters",
    }
    for (namespace, name), reason in problems.items():
        with pytest.raises(SecretMissing, match=reason.replace("(", r"\(")):
            secrets.value(namespace, name)
    with pytest.raises(SecretMissing, match="no CRONBUS_SECRETS_DIR"):
        SecretHeaders("").value("acme", "billing-token")


def test_signing_secrets_follow_a_kubernetes_style_symlink_swap(tmp_path: Path) -> None:
    # The kubelet writes each version in a new directory and swaps the ..data symlink.
    clock = Clock()
    mounted = tmp_path / "signing.json"
    secrets = SigningSecrets(str(mounted), clock)
    assert secrets.keys_for("acme") == ()  # not created yet: unsigned

    def publish(version: str, content: dict[str, list[str]]) -> None:
        (tmp_path / version).mkdir()
        (tmp_path / version / "signing.json").write_text(json.dumps(content))
        link = tmp_path / "..data.tmp"
        link.symlink_to(version)
        os.replace(link, tmp_path / "..data")
        if not mounted.is_symlink():
            mounted.symlink_to("..data/signing.json")

    publish("v1", {"acme": [whsec(b"a")]})
    clock.now += 1.1
    assert secrets.keys_for("acme") == (b"a" * 32,)
    publish("v2", {"acme": [whsec(b"b"), whsec(b"a")]})
    assert secrets.keys_for("acme") == (b"a" * 32,)  # checked at most once a second
    clock.now += 1.1
    assert secrets.keys_for("acme") == (b"b" * 32, b"a" * 32)
    publish("v3", {"acme": ["broken"]})
    clock.now += 1.1
    assert secrets.keys_for("acme") == (b"b" * 32, b"a" * 32)  # the last good ones stay
