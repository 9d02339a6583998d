"""The contract works from another language: ``examples/node`` (amqplib and standardwebhooks,
written from docs/asyncapi.yaml alone) upserts, gets and deletes a schedule on the real services
and verifies the signed webhook it receives."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
from pathlib import Path

from tests.support import npm
from tests.support.commands import CommandClient
from tests.support.stack import Stack

SECRET = "whsec_" + base64.b64encode(b"node-example-secret-0123456789ab").decode()


async def run_example(folder: Path, amqp_url: str, secret: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        "node",
        "schedule.mjs",
        cwd=folder,
        env={
            **os.environ,
            "CRONBUS_AMQP_URL": amqp_url,
            "CRONBUS_NAMESPACE": "acme",
            "CRONBUS_SIGNING_SECRET": secret,
            "SCHEDULE_ID": "from-node",
            "TIMEOUT_MS": "20000",
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout=40)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, output.decode()


async def test_the_node_example_upserts_verifies_its_signed_webhook_and_deletes(
    stack: Stack, client: CommandClient, amqp_url: str, tmp_path: Path
) -> None:
    folder = npm.installed("examples/node")
    secrets_file = tmp_path / "signing.json"
    secrets_file.write_text(json.dumps({"acme": [SECRET]}))
    await stack.start_all(
        ("dispatcher", "executor"), CRONBUS_SIGNING_SECRETS_FILE=str(secrets_file)
    )

    code, output = await run_example(folder, amqp_url, SECRET)

    assert code == 0, output + stack.tails()
    lines = output.splitlines()
    assert lines[0] == "upserted from-node version=1"
    assert re.fullmatch(r"got state=active next_fires=\S+Z", lines[1])
    assert re.fullmatch(
        r'verified webhook-id=\S+ schedule=acme/from-node body=\{"from":"node"\}', lines[2]
    )
    assert lines[3].startswith("deleted from-node")
    reply = await client.send("acme", "get", {"id": "from-node"})
    assert reply["error"]["code"] == "not_found"


async def test_the_node_example_refuses_a_webhook_signed_with_another_secret(
    stack: Stack, amqp_url: str, tmp_path: Path
) -> None:
    folder = npm.installed("examples/node")
    secrets_file = tmp_path / "signing.json"
    secrets_file.write_text(json.dumps({"acme": [SECRET]}))
    await stack.start_all(
        ("dispatcher", "executor"), CRONBUS_SIGNING_SECRETS_FILE=str(secrets_file)
    )
    other = "whsec_" + base64.b64encode(b"another-secret-0123456789abcdefg").decode()

    code, output = await run_example(folder, amqp_url, other)

    assert code != 0
    assert "WebhookVerificationError" in output
