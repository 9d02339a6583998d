"""One webhook delivery, as the executor makes it, against a real sink on loopback."""

from __future__ import annotations

from pathlib import Path

from cronbus.cli.sink import Sink
from services.executor.http import HttpClient
from services.executor.secrets import SecretHeaders
from services.executor.targets import Webhooks
from shared.contract.delivery import Occurrence
from shared.policy import netpolicy
from shared.rules import schedule
from shared.rules.plan import IntervalRule, Plan, WebhookPlan


def occurrence(url: str, **target: object) -> Occurrence:
    plan = Plan(1, IntervalRule(60_000), WebhookPlan(url=url, **target))  # type: ignore[arg-type]
    return Occurrence(0, "acme/hook", 1, 0, 0, 1, 0, plan, "acme", "hook", None)


def webhooks(allowed: tuple[str, ...], **options: object) -> Webhooks:
    client = HttpClient(4, netpolicy.AddressPolicy.from_text(allowed))
    return Webhooks(client, **options)  # type: ignore[arg-type]


async def test_host_globs_and_addresses_are_checked_at_every_delivery(sink: Sink) -> None:
    key = schedule.idempotency_key("acme", "hook", 0)
    allowed = webhooks(netpolicy.LOOPBACK, allowed_hosts=("127.0.0.*",))
    outcome = await allowed.deliver(occurrence(f"{sink.url}/ok"), key)
    assert outcome.ok and len(sink.received) == 1
    by_name = await allowed.deliver(occurrence(f"http://localhost:{sink.port}/x"), key)
    assert (by_name.ok, by_name.error) == (False, "target host not allowed")
    denied = webhooks(())
    outcome = await denied.deliver(occurrence(f"{sink.url}/no"), key)
    assert (outcome.ok, outcome.error) == (False, "target address not allowed")
    assert len(sink.received) == 1
    for client in (allowed, denied):
        await client.close()


async def test_secret_headers_are_sent_or_the_attempt_fails_naming_the_secret(
    sink: Sink, tmp_path: Path
) -> None:
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "token").write_text("Bearer abc\n")
    hooks = webhooks(netpolicy.LOOPBACK, secret_headers=SecretHeaders(str(tmp_path)))
    key = schedule.idempotency_key("acme", "hook", 0)
    try:
        ok = await hooks.deliver(
            occurrence(f"{sink.url}/s", secret_headers=(("Authorization", "token"),)), key
        )
        assert ok.ok and sink.received[0].headers["authorization"] == "Bearer abc"
        missing = await hooks.deliver(
            occurrence(f"{sink.url}/s", secret_headers=(("X-Key", "gone"),)), key
        )
        assert not missing.ok
        assert missing.error == "secret 'gone' not found for namespace 'acme'"
        assert len(sink.received) == 1
    finally:
        await hooks.close()
