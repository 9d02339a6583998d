"""The receiver example of the security page, run as written: it accepts a delivery cronbus
signed and refuses one it did not."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared.policy import signing
from shared.rules import schedule
from tests.support import services

SECURITY = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()


def receiver_example() -> tuple[str, str]:
    """The example's code and the secret it verifies with."""
    section = SECURITY.split("## Signed webhooks", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    secret = re.search(r'Webhook\("(whsec_[^"]+)"\)', code[1])
    assert secret is not None
    return code[1], secret[1]


def post(port: int, body: bytes, headers: list[tuple[str, str]]) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/", data=body, headers=dict(headers), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_documented_receiver_verifies_a_cronbus_signature(tmp_path: Path) -> None:
    code, secret = receiver_example()
    port = services.free_port()
    script = tmp_path / "receiver.py"
    script.write_text(code.replace('HTTPServer(("", 8080)', f'HTTPServer(("127.0.0.1", {port})'))
    process = subprocess.Popen(
        [sys.executable, "-u", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 10
        while not services.port_open("127.0.0.1", port, timeout=0.2):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        key = schedule.idempotency_key("billing", "invoice-42", 1_800_000_000_000)
        body = b'{"invoice":42}'
        keys = signing.parse_secrets(b'{"billing": ["%s"]}' % secret.encode())["billing"]
        signed = signing.headers(keys, key, int(time.time()), body)
        assert post(port, body, signed) == 204
        assert post(port, body + b" ", signed) == 401
        forged = signing.headers((b"f" * 32,), key, int(time.time()), body)
        assert post(port, body, forged) == 401
    finally:
        process.kill()
        output = process.communicate(timeout=5)[0]
    assert f"{key} {{'invoice': 42}}".encode() in output
