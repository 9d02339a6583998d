"""``cronbus doctor``'s RabbitMQ checks: every node of CRONBUS_AMQP_URL answers, and the
cluster's members and each cronbus quorum queue's members and leader, as its management API
(CRONBUS_AMQP_MANAGEMENT_URL) tells. The judging is ``shared.policy.rabbit_cluster``."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import aiohttp
import aiormq

from shared.contract import urls
from shared.policy import rabbit_cluster
from shared.policy.rabbit_cluster import Finding
from shared.runtime.config import CommonSettings

DIAL_TIMEOUT_S = 5.0


async def checks(settings: CommonSettings) -> list[Finding]:
    nodes = urls.amqp_urls(settings.amqp_url)
    dialled = await asyncio.gather(*(_dial(url) for url in nodes))
    findings = rabbit_cluster.node_findings(
        {urls.host_port(url): error for url, error in zip(nodes, dialled, strict=True)}
    )
    if not settings.amqp_management_url:
        return findings
    vhost = unquote(urlsplit(nodes[0]).path[1:]) or "/"
    try:
        cluster, queues = await _management(settings.amqp_management_url, vhost)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        where = _where(settings.amqp_management_url)
        findings.append(
            Finding(
                "rabbitmq-management",
                "warning",
                urls.masked(
                    f"the management API at {where} did not answer ({exc or type(exc).__name__}): "
                    "the cluster's members and its queues' leaders were not checked"
                ),
                f"enable rabbitmq_management, or set {rabbit_cluster.MANAGEMENT_SETTING} "
                "(empty: skip these checks)",
            )
        )
        return findings
    return (
        findings + rabbit_cluster.cluster_findings(cluster) + rabbit_cluster.queue_findings(queues)
    )


async def _dial(url: str) -> str | None:
    try:
        connection = await asyncio.wait_for(aiormq.connect(url), DIAL_TIMEOUT_S)
    except (OSError, TimeoutError, aiormq.exceptions.AMQPError) as exc:
        return urls.masked(f"{type(exc).__name__}: {exc}")[:200]
    await connection.close()
    return None


async def _management(
    base_url: str, vhost: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    parts = urlsplit(base_url)
    auth = aiohttp.BasicAuth(unquote(parts.username or ""), unquote(parts.password or ""))
    root = urlunsplit(parts._replace(netloc=_where(base_url))).rstrip("/")
    timeout = aiohttp.ClientTimeout(total=DIAL_TIMEOUT_S)
    async with aiohttp.ClientSession(auth=auth, timeout=timeout) as session:
        nodes = await _get(session, f"{root}/api/nodes?columns=name,running,partitions")
        queues = await _get(
            session,
            f"{root}/api/queues/{quote(vhost, safe='')}?columns=name,type,members,leader,online",
        )
    return nodes, queues


async def _get(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(url) as response:
        if response.status != 200:
            raise ValueError(f"HTTP {response.status} from {urlsplit(url).path}")
        found = await response.json()
    if not isinstance(found, list):
        raise ValueError("the answer is not a list")
    return found


def _where(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
