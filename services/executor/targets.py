"""Delivering one occurrence to its target: an HTTP webhook or an AMQP publish."""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import logging
import time
from collections.abc import Callable

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from services.executor.http import (
    NOT_ALLOWED,
    AddressNotAllowed,
    HttpClient,
    HttpError,
    parse_url,
)
from services.executor.secrets import SecretHeaders, SecretMissing, SigningSecrets
from services.executor.settle import Outcome
from shared.contract import timefmt
from shared.contract.delivery import Occurrence
from shared.policy import exchanges, limits, signing, tracing
from shared.rules.plan import AmqpPlan, WebhookPlan
from shared.runtime import metrics
from shared.runtime.config import ExecutorSettings

log = logging.getLogger(__name__)

USER_AGENT = "cronbus/0.1"
HOST_NOT_ALLOWED = "target host not allowed"


def pinned_headers(occ: Occurrence, key: str, sampled: bool = False) -> dict[str, str]:
    """The headers every delivery carries (the pinned contract)."""
    headers = {
        "Idempotency-Key": key,
        "X-Cronbus-Schedule": f"{occ.namespace}/{occ.id}",
        "X-Cronbus-Fire-Time": timefmt.format_ms(occ.nominal_ms),
        "X-Cronbus-Attempt": str(occ.attempt),
    }
    if occ.is_trigger:
        headers["X-Cronbus-Trigger"] = "manual"
    if occ.is_backfill:
        headers["X-Cronbus-Backfill"] = "true"
    headers["traceparent"] = tracing.traceparent(key, occ.attempt, sampled)
    return headers


class Webhooks:
    """One pooled HTTP client for every webhook this executor calls, with the operator's
    address policy, signing secrets and secret headers."""

    def __init__(
        self,
        client: HttpClient,
        signing_secrets: SigningSecrets | None = None,
        secret_headers: SecretHeaders | None = None,
        clock: Callable[[], float] = time.time,
        allowed_hosts: tuple[str, ...] = ("*",),
    ) -> None:
        self.client = client
        #: Host-name globs (CRONBUS_WEBHOOK_ALLOWED_HOSTS), checked again at every delivery.
        self.allowed_hosts = None if "*" in allowed_hosts else allowed_hosts
        self.signing_secrets = signing_secrets
        self.secret_headers = secret_headers or SecretHeaders("")
        self.clock = clock
        #: Spans are exported: the traceparent says "sampled".
        self.sampled = False

    @classmethod
    def from_settings(
        cls, settings: ExecutorSettings, signing_secrets: SigningSecrets | None
    ) -> Webhooks:
        client = HttpClient(
            settings.http_connections_per_host,
            settings.address_policy(),
            total=settings.http_connections_total,
            idle_s=settings.http_idle_s,
            user_agent=USER_AGENT,
        )
        return cls(
            client,
            signing_secrets,
            SecretHeaders(settings.secrets_dir),
            allowed_hosts=settings.allowed_hosts(),
        )

    async def close(self) -> None:
        await self.client.close()

    def _headers(self, occ: Occurrence, key: str, target: WebhookPlan) -> list[tuple[str, str]]:
        """Every header of the request; SecretMissing when a secret header cannot be read."""
        headers = list(target.headers)
        for name, secret in target.secret_headers:
            headers.append((name, self.secret_headers.value(occ.namespace, secret)))
        headers += pinned_headers(occ, key, self.sampled).items()
        if target.body is not None:
            headers.append(("Content-Type", "application/json"))
        if self.signing_secrets is not None:
            keys = self.signing_secrets.keys_for(occ.namespace)
            headers += signing.headers(keys, key, int(self.clock()), target.body or b"")
        return headers

    async def deliver(self, occ: Occurrence, key: str) -> Outcome:
        target = occ.plan.target
        assert isinstance(target, WebhookPlan)
        if self.allowed_hosts is not None and not _host_allowed(target.url, self.allowed_hosts):
            metrics.WEBHOOK_REFUSED.inc()
            log.warning(
                "webhook refused: its host is not in CRONBUS_WEBHOOK_ALLOWED_HOSTS",
                extra={"action": "webhook_refused", "schedule": occ.member, "url": target.url},
            )
            return Outcome(False, None, HOST_NOT_ALLOWED, sent=False)
        try:
            headers = self._headers(occ, key, target)
        except SecretMissing as exc:
            return Outcome(False, None, str(exc)[:500], sent=False)
        try:
            response = await self.client.request(
                target.method, target.url, headers, target.body, target.timeout_ms / 1000
            )
        except TimeoutError:
            return Outcome(False, None, f"timed out after {target.timeout_ms / 1000:g}s")
        except AddressNotAllowed as exc:
            metrics.WEBHOOK_REFUSED.inc()
            log.warning(
                "webhook refused: its host resolves to an address not allowed (a private, "
                "local or reserved one outside CRONBUS_WEBHOOK_ALLOWED_NETWORKS, or one in "
                "CRONBUS_WEBHOOK_DENIED_NETWORKS)",
                extra={
                    "action": "webhook_refused",
                    "schedule": occ.member,
                    "host": exc.host,
                    "address": exc.address,
                },
            )
            return Outcome(False, None, NOT_ALLOWED, sent=False)
        except HttpError as exc:
            return Outcome(False, None, str(exc)[:500])
        status = response.status
        if _succeeded(status, target.success_codes):
            return Outcome(True, status, reached=True)
        text = _without_secrets(response.body.decode("utf-8", "replace").strip(), headers, target)
        return Outcome(
            False,
            status,
            f"HTTP {status}" + (f": {text}" if text else ""),
            _retry_after_ms(status, response.retry_after),
            reached=True,
        )


def _without_secrets(text: str, headers: list[tuple[str, str]], target: WebhookPlan) -> str:
    """The response text with the values of the secret headers sent blanked out: the text
    becomes the attempt's error (stored and published), and a receiver may quote a header
    back ("invalid token: ...")."""
    names = {name.lower() for name, _ in target.secret_headers}
    for name, value in headers:
        if name.lower() in names and value:
            text = text.replace(value, "[secret]")
            # The token alone, too (a receiver may quote "sk_..." without "Bearer ").
            for part in value.split():
                if len(part) >= 8:
                    text = text.replace(part, "[secret]")
    return text


def _retry_after_ms(status: int, value: str | None) -> int | None:
    """What a 429 or 503 asks with Retry-After (capped by the executor's limits)."""
    if status not in limits.BACKPRESSURE_STATUSES:
        return None
    return limits.retry_after_ms(value, int(time.time() * 1000), limits.MAX_RETRY_AFTER_MS)


@functools.lru_cache(maxsize=4096)
def _host_allowed(url: str, globs: tuple[str, ...]) -> bool:
    try:
        host = parse_url(url).host
    except HttpError:
        return False
    return any(fnmatch.fnmatchcase(host, glob) for glob in globs)


def _succeeded(status: int, codes: frozenset[int] | None) -> bool:
    return status in codes if codes is not None else 200 <= status < 300


class AmqpTargets:
    """Publishes to users' exchanges with publisher confirms; ``message_id`` is the key.

    The exchange is checked against ``CRONBUS_AMQP_ALLOWED_EXCHANGES`` again at every delivery:
    a schedule stored before the setting (or its default) narrowed is refused here, not
    published.
    """

    def __init__(
        self,
        connection: AbstractRobustConnection,
        sampled: bool = False,
        policy: exchanges.ExchangePolicy | None = None,
    ) -> None:
        self.connection = connection
        self.sampled = sampled
        self.policy = policy or exchanges.ExchangePolicy()
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()

    async def _ensure_channel(self) -> AbstractChannel:
        async with self._lock:
            if self._channel is None or self._channel.is_closed:
                self._channel = await self.connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
            return self._channel

    def refuses(self, occ: Occurrence) -> bool:
        """Whether ``occ`` is an AMQP delivery the exchange policy refuses (as ``deliver``
        would: checked before its rate gate, so a refused one takes no probe nor token)."""
        target = occ.plan.target
        return (
            isinstance(target, AmqpPlan)
            and self.policy.refusal(occ.namespace, target.exchange) is not None
        )

    async def deliver(self, occ: Occurrence, key: str) -> Outcome:
        target = occ.plan.target
        assert isinstance(target, AmqpPlan)
        refusal = self.policy.refusal(occ.namespace, target.exchange)
        if refusal is not None:
            return _refused(occ, target.exchange, refusal)
        headers: dict[str, object] = dict(target.headers)
        pinned = pinned_headers(occ, key, self.sampled)
        del pinned["Idempotency-Key"]
        headers.update(pinned)
        message = aio_pika.Message(
            target.body or b"",
            content_type="application/json",
            message_id=key,
            headers=headers,  # type: ignore[arg-type]
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            timestamp=occ.nominal_ms / 1000,
        )
        try:
            channel = await self._ensure_channel()
            # Never the default exchange: the policy above refuses "".
            exchange = await channel.get_exchange(target.exchange, ensure=False)
            await exchange.publish(
                message,
                routing_key=target.routing_key,
                mandatory=True,
                timeout=target.timeout_ms / 1000,
            )
        except aio_pika.exceptions.DeliveryError as exc:
            # The broker answered: it is up, the routing is about this message.
            return Outcome(False, None, f"not routed: {exc}"[:500], reached=True)
        except Exception as exc:  # noqa: BLE001 - a failed attempt, retried by policy
            return Outcome(False, None, f"{type(exc).__name__}: {exc}"[:500])
        return Outcome(True, reached=True)


def _refused(occ: Occurrence, exchange: str, reason: str) -> Outcome:
    metrics.AMQP_TARGET_REFUSED.labels(metrics.NAMESPACES(occ.namespace)).inc()
    log.warning(
        "amqp target refused: its exchange is not allowed (%s)",
        exchanges.SETTING,
        extra={"action": "amqp_refused", "schedule": occ.member, "exchange": exchange},
    )
    # Permanent: the policy would refuse every attempt the same way; nothing was published.
    return Outcome(False, None, f"not published: {reason}"[:500], permanent=True, sent=False)
