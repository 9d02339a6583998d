"""Secrets the executor reads from files: webhook signing keys and secret header values.

Both are read where they are used and never copied anywhere else: a secret header's value goes
onto the wire of one request, and nowhere into PostgreSQL, Redis, RabbitMQ, logs or events
(errors name the secret, never its value). Files are re-read when they change, so a rotated
Kubernetes Secret (mounted as a volume: the kubelet swaps a symlink) applies without a restart.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from shared.contract import models
from shared.policy import signing

log = logging.getLogger(__name__)

#: How often a file is checked for a change (a stat): cheap, and rotation is not urgent.
CHECK_EVERY_S: Final = 1.0
#: A secret header's value is one line of at most this many characters.
MAX_SECRET_BYTES: Final = models.MAX_HEADER_VALUE


class SecretMissing(Exception):
    """A secret header could not be read; the message names the secret, never a value."""


def _file_identity(path: str) -> tuple[int, int, int, int]:
    # stat follows symlinks: a swapped Kubernetes ..data link shows as a new inode.
    found = os.stat(path)
    return (found.st_dev, found.st_ino, found.st_mtime_ns, found.st_size)


class SigningSecrets:
    """``CRONBUS_SIGNING_SECRETS_FILE``, re-read when it changes. A file that turns bad keeps
    the last good secrets (and says so in the log); a bad file at start stops the executor
    (SecretsError). A missing file means no secrets until it appears (an optional Kubernetes
    Secret not created yet)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._identity: tuple[int, int, int, int] | None = None
        self._secrets: signing.Secrets = {}
        try:
            self._identity = _file_identity(path)
        except FileNotFoundError:
            log.warning(
                "no signing secrets file yet: deliveries go unsigned until it appears",
                extra={"action": "signing_secrets_missing", "path": path},
            )
        else:
            try:
                self._secrets = signing.parse_secrets(Path(path).read_bytes())
            except signing.SecretsError as exc:
                raise signing.SecretsError(f"CRONBUS_SIGNING_SECRETS_FILE {path}: {exc}") from None
        self._next_check = clock() + CHECK_EVERY_S

    def keys_for(self, namespace: str) -> tuple[bytes, ...]:
        now = self.clock()
        if now >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            self._reload_if_changed()
        return signing.keys_for(self._secrets, namespace)

    def _reload_if_changed(self) -> None:
        try:
            identity = _file_identity(self.path)
            if identity == self._identity:
                return
            secrets = signing.parse_secrets(Path(self.path).read_bytes())
        except (OSError, signing.SecretsError) as exc:
            log.error(
                "signing secrets not reloaded, the last good ones stay in use",
                extra={"action": "signing_secrets_invalid", "path": self.path, "error": str(exc)},
            )
            return
        self._identity, self._secrets = identity, secrets
        log.info(
            "signing secrets reloaded",
            extra={"action": "signing_secrets_reloaded", "namespaces": len(secrets)},
        )


class SecretHeaders:
    """Values of ``target.secret_headers`` from ``CRONBUS_SECRETS_DIR/<namespace>/<name>``,
    cached for at most ``CHECK_EVERY_S`` (a rotated secret applies within a second)."""

    def __init__(self, directory: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.clock = clock
        self._cache: dict[tuple[str, str], tuple[float, str]] = {}

    def value(self, namespace: str, name: str) -> str:
        now = self.clock()
        cached = self._cache.get((namespace, name))
        if cached is not None and cached[0] > now:
            return cached[1]
        found = self._read(namespace, name)
        if len(self._cache) >= 10_000:
            self._cache.clear()
        self._cache[(namespace, name)] = (now + CHECK_EVERY_S, found)
        return found

    def _read(self, namespace: str, name: str) -> str:
        if not self.directory:
            raise SecretMissing(
                f"secret {name!r} not found: this executor has no CRONBUS_SECRETS_DIR"
            )
        # Checked at upsert too; again here, since the path is built from them.
        if not models.NAMESPACE_RE.match(namespace) or not models.SECRET_NAME_RE.match(name):
            raise SecretMissing(f"secret {name!r} has a name that is not allowed")
        path = os.path.join(self.directory, namespace, name)
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_SECRET_BYTES + 3)
        except FileNotFoundError:
            raise SecretMissing(f"secret {name!r} not found for namespace {namespace!r}") from None
        except OSError as exc:
            raise SecretMissing(f"secret {name!r} cannot be read: {exc.strerror}") from None
        return _header_value(name, raw)


def _header_value(name: str, raw: bytes) -> str:
    # Files written by hand or by `kubectl create secret --from-file` often end in a newline.
    text = raw.removesuffix(b"\n").removesuffix(b"\r")
    if len(text) > MAX_SECRET_BYTES:
        raise SecretMissing(f"secret {name!r} is longer than {MAX_SECRET_BYTES} bytes")
    try:
        value = text.decode("ascii")
    except UnicodeDecodeError:
        raise SecretMissing(f"secret {name!r} is not ASCII text") from None
    if any((ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F for ch in value):
        raise SecretMissing(f"secret {name!r} holds control characters (one line is allowed)")
    if not value.strip():
        raise SecretMissing(f"secret {name!r} is empty")
    return value
