"""Adversarial review of issue 10, pure parts: each test pins a defect found by trying to
break a promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.executor.secrets import SecretHeaders, SecretMissing


@pytest.mark.parametrize("content", [b"", b"\n", b"\r\n", b"   ", b"\t\n"])
def test_an_empty_secret_file_fails_the_attempt_instead_of_sending_an_empty_credential(
    tmp_path: Path, content: bytes
) -> None:
    """A Kubernetes Secret created with an empty key, or a file caught half-written by a
    non-atomic rotation, would send ``Authorization:`` with nothing: the receiver answers 401
    and the reason does not say that the secret is the problem."""
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "token").write_bytes(content)
    with pytest.raises(SecretMissing, match="'token' is empty"):
        SecretHeaders(str(tmp_path)).value("acme", "token")
