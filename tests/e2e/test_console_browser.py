"""The console in a real browser (Debian's chromium, driven by selenium) against the services.

A person opens the console, finds a schedule, pauses it and sees the state change, then
triggers it and sees the execution appear without reloading (the page refreshes itself); the
command audit names them. They filter the failures by namespace, find a retried occurrence and
its failed first attempt, and delete a schedule.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

from cronbus.cli.sink import Sink
from shared.contract import timefmt
from tests.support import services, tools
from tests.support.commands import CommandClient, an_hour_from_now
from tests.support.stack import Stack

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
HEADLESS_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1000",
)
#: How long a page may take to come back on a busy machine.
PAGE_TIMEOUT_S = 20


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    tools.require("chromium", "chromedriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in HEADLESS_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def _goes_to_next_page(browser: WebDriver, action: Callable[[], object]) -> None:
    """Do ``action`` (a click, a submit) and wait, as a person does, until the page it leaves
    is replaced and the next one is loaded. A click does not wait for the navigation it
    starts: what is looked up right after it may belong to the page being left, and is gone
    (stale) a moment later."""
    leaving = browser.find_element(By.TAG_NAME, "html")
    action()
    wait = WebDriverWait(browser, PAGE_TIMEOUT_S)
    wait.until(lambda _: _left(leaving))
    wait.until(lambda driver: driver.execute_script("return document.readyState") == "complete")


def _left(element: WebElement) -> bool:
    """Whether ``element``'s page is gone. Chrome sometimes says so as an inspector error
    rather than as a stale element (seen on a loaded machine): both mean the same."""
    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc):
            return True
        raise
    return False


async def _eventually(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout_s:g}s: {what}")
        await asyncio.sleep(0.5)


async def test_find_pause_and_trigger_a_schedule_in_the_browser(
    stack: Stack, client: CommandClient, sink: Sink, browser: WebDriver
) -> None:
    await stack.start_all()
    # The "flaky" target fails every first attempt; the retry succeeds.
    # "broken" fails until it is retried (a backfilled delivery says so in a header).
    sink.respond = lambda r: (
        503
        if (r.path == "/flaky" and r.attempt == 1)
        or (r.path == "/broken" and "x-cronbus-backfill" not in r.headers)
        else 200
    )
    port = services.free_port()
    console = stack.start("console", CRONBUS_CONSOLE_PORT=str(port), CRONBUS_CONSOLE_ACTIONS="1")
    await stack.wait_ready(console)
    # An interval without start_at sits on the epoch's grid: every_s 3600 would also fire on the
    # next whole hour, which may fall inside the test and add executions it does not expect.
    hourly = {"kind": "interval", "every_s": 3600, "start_at": an_hour_from_now()}
    for schedule_id in ("nightly-report", "invoice-reminder", "invoice-archive"):
        reply = await client.send(
            "billing",
            "upsert",
            {
                "schedule": {
                    "id": schedule_id,
                    "spec": hourly,
                    "target": {"kind": "webhook", "url": f"{sink.url}/{schedule_id}"},
                    "labels": {"team": "billing"},
                }
            },
        )
        assert reply["ok"], reply
    flaky = {
        "id": "flaky",
        "spec": hourly,
        "target": {"kind": "webhook", "url": f"{sink.url}/flaky"},
        "retry": {"max_attempts": 3, "initial_backoff_s": 1, "full_jitter": False},
    }
    for namespace in ("billing", "other"):
        assert (await client.send(namespace, "upsert", {"schedule": flaky}))["ok"]
        assert (await client.send(namespace, "trigger", {"id": "flaky"}))["ok"]
    broken = {
        "id": "broken",
        "spec": {
            "kind": "interval",
            "every_s": 3600,
            "start_at": timefmt.format_ms(int(time.time() * 1000) + 1000),
        },
        "target": {"kind": "webhook", "url": f"{sink.url}/broken"},
        "retry": {"max_attempts": 1},
    }
    assert (await client.send("billing", "upsert", {"schedule": broken}))["ok"]
    # The auth proxy's header, as oauth2-proxy would set it in front of the console.
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd(
        "Network.setExtraHTTPHeaders", {"headers": {"X-Forwarded-User": "alice"}}
    )
    base = f"http://127.0.0.1:{port}"

    # Find it: namespaces -> billing -> search by id -> the schedule.
    await asyncio.to_thread(browser.get, base + "/")
    assert "Namespaces" in browser.find_element(By.TAG_NAME, "h1").text
    billing = browser.find_element(By.LINK_TEXT, "billing")
    await asyncio.to_thread(_goes_to_next_page, browser, billing.click)
    search = browser.find_element(By.NAME, "q")
    search.send_keys("invoice-r")
    await asyncio.to_thread(_goes_to_next_page, browser, search.submit)
    links = browser.find_elements(By.CSS_SELECTOR, "tbody th a")
    assert [a.text for a in links] == ["invoice-reminder"]
    await asyncio.to_thread(_goes_to_next_page, browser, links[0].click)
    assert browser.find_element(By.ID, "state").text == "active"
    assert "Alice" in browser.page_source or "alice" in browser.page_source

    # Pause: the page comes back with the new state (the confirm dialog is answered yes).
    browser.execute_script("window.confirm = () => true;")
    pause = browser.find_element(By.CSS_SELECTOR, "button[value=pause]")
    await asyncio.to_thread(_goes_to_next_page, browser, pause.click)
    assert browser.find_element(By.CSS_SELECTOR, "p.notice").text == "pause: done"
    assert browser.find_element(By.ID, "state").text == "paused"
    assert not browser.find_elements(By.CSS_SELECTOR, "button[value=pause]")

    # Trigger: one extra run now; its execution appears in the history.
    browser.execute_script("window.confirm = () => true;")
    trigger = browser.find_element(By.CSS_SELECTOR, "button[value=trigger]")
    await asyncio.to_thread(_goes_to_next_page, browser, trigger.click)
    assert browser.find_element(By.CSS_SELECTOR, "p.notice").text == "trigger: done"
    assert await sink.wait_for(
        lambda s: any(r.schedule == "billing/invoice-reminder" for r in s.received), 20
    )

    def execution_shown() -> bool:
        # No reload here: the page refreshes itself while it is open.
        try:
            rows = browser.find_elements(By.CSS_SELECTOR, "#executions tbody tr")
            return any("trigger" in row.text and "succeeded" in row.text for row in rows)
        except StaleElementReferenceException:  # replaced by a refresh under way: look again
            return False

    await _eventually(execution_shown, 30, "the triggered execution, without a reload")

    # The audit names the broker user and the person behind the proxy.
    audit = browser.find_element(By.CSS_SELECTOR, "section[aria-labelledby=audit-h]").text
    assert "cronbus-console:alice" in audit
    assert "pause" in audit
    assert "trigger" in audit

    # Failures, filtered to one namespace: the retried trigger of billing/flaky, not other's.
    def failures_of(namespace: str) -> list[str]:
        browser.get(f"{base}/failures")
        Select(browser.find_element(By.NAME, "namespace")).select_by_visible_text(namespace)
        _goes_to_next_page(browser, browser.find_element(By.CSS_SELECTOR, "form.filters").submit)
        return [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#failures tbody th a")]

    async def retried_listed() -> bool:
        listed = await asyncio.to_thread(failures_of, "billing")
        return "billing/flaky" in listed and all(n.startswith("billing/") for n in listed)

    await _eventually_async(retried_listed, 30, "billing/flaky among billing's failures only")
    (row,) = [
        r
        for r in browser.find_elements(By.CSS_SELECTOR, "#failures tbody tr")
        if "billing/flaky" in r.text
    ]
    assert "succeeded" in row.text
    # Its attempts: the first failed with 503, the second succeeded.
    row.find_element(By.CSS_SELECTOR, "details.attempts summary").click()
    attempts = [li.text for li in row.find_elements(By.CSS_SELECTOR, "details.attempts li")]
    assert len(attempts) == 2, attempts
    assert "failed" in attempts[0] and "HTTP 503" in attempts[0]
    assert "succeeded" in attempts[1]

    # Delete: back on the namespace's list, which no longer has it.
    await asyncio.to_thread(browser.get, f"{base}/ns/billing/s/invoice-reminder")
    browser.execute_script("window.confirm = () => true;")
    delete = browser.find_element(By.CSS_SELECTOR, "button[value=delete]")
    await asyncio.to_thread(_goes_to_next_page, browser, delete.click)
    assert browser.find_element(By.CSS_SELECTOR, "p.notice").text == "invoice-reminder deleted"
    listed = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "tbody th a")]
    assert "invoice-reminder" not in listed and "invoice-archive" in listed

    # Retry a dead occurrence: delivered again with the same key, marked as a backfill.
    await asyncio.to_thread(browser.get, f"{base}/ns/billing/s/broken")

    def dead_shown() -> bool:
        try:
            return bool(browser.find_elements(By.CSS_SELECTOR, "#executions button.small"))
        except StaleElementReferenceException:
            return False

    await _eventually(dead_shown, 30, "the dead occurrence of billing/broken with a Retry")
    browser.execute_script("window.confirm = () => true;")
    retry = browser.find_element(By.CSS_SELECTOR, "#executions button.small")
    await asyncio.to_thread(_goes_to_next_page, browser, retry.click)
    assert browser.find_element(By.CSS_SELECTOR, "p.notice").text.endswith(": done")
    assert await sink.wait_for(
        lambda s: [r.status for r in s.received if r.path == "/broken"] == [503, 200], 20
    )
    first, again = [r for r in sink.received if r.path == "/broken"]
    assert first.key == again.key

    # Pause two schedules at once from the list.
    await asyncio.to_thread(browser.get, f"{base}/ns/billing")
    for schedule_id in ("invoice-archive", "nightly-report"):
        browser.find_element(By.CSS_SELECTOR, f"input[name=id][value={schedule_id}]").click()
    browser.execute_script("window.confirm = () => true;")
    bulk_pause = browser.find_element(By.CSS_SELECTOR, "#bulk button[value=pause]")
    await asyncio.to_thread(_goes_to_next_page, browser, bulk_pause.click)
    assert browser.find_element(By.CSS_SELECTOR, "p.notice").text == "pause: 2 of 2 done"
    states = {
        row.find_element(By.CSS_SELECTOR, "th a").text: row.find_element(
            By.CSS_SELECTOR, ".state"
        ).text
        for row in browser.find_elements(By.CSS_SELECTOR, "tbody tr")
    }
    assert states["invoice-archive"] == states["nightly-report"] == "paused"


async def _eventually_async(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: str
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout_s:g}s: {what}")
        await asyncio.sleep(1)
