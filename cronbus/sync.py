"""The blocking client: the same calls as ``cronbus.client.Client``, for code without an event
loop. Its connection lives on a loop in a thread of its own."""

from __future__ import annotations

import asyncio
import builtins
import threading
from collections.abc import Coroutine, Iterable, Iterator, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar

from cronbus.client import Client, Page
from cronbus.forms import ItemResult, ScheduleInput
from shared.contract.replies import StoredSchedule, Triggered

T = TypeVar("T")


class SyncClient:
    """The same client, blocking: ``with SyncClient() as c: c.get("billing", "invoice-42")``.

    Its connection lives on an event loop in a thread of its own, so it reconnects while the
    caller does other things. Parameters as for ``Client``.
    """

    def __init__(
        self, url: str | None = None, timeout_s: float = 30, *, app_id: str = "cronbus-client"
    ) -> None:
        self.client = Client(url, timeout_s, app_id=app_id)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        self.connect()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def connect(self) -> None:
        """Start the client's thread and open the connection (``with`` does it for you)."""
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="cronbus-client", daemon=True)
        self._thread.start()
        self._loop = loop
        try:
            self._run(self.client.connect())
        except BaseException:
            self._stop()
            raise

    def close(self) -> None:
        """Close the connection and stop the client's thread."""
        if self._loop is None:
            return
        try:
            self._run(self.client.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(_cancel_the_rest(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            work.close()
            raise RuntimeError("not connected: use 'with SyncClient() as c'")
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def send(
        self, namespace: str, verb: str, body: Mapping[str, Any], **options: Any
    ) -> dict[str, Any]:
        """``Client.send``: one command as given, its reply as a dict."""
        return self._run(self.client.send(namespace, verb, body, **options))

    def upsert(
        self, namespace: str, schedule: ScheduleInput, *, expected_version: int | None = None
    ) -> StoredSchedule:
        """``Client.upsert``."""
        return self._run(self.client.upsert(namespace, schedule, expected_version=expected_version))

    def upsert_many(
        self, namespace: str, schedules: Iterable[ScheduleInput]
    ) -> builtins.list[ItemResult]:
        """``Client.upsert_many``."""
        return self._run(self.client.upsert_many(namespace, schedules))

    def get(self, namespace: str, schedule_id: str) -> StoredSchedule:
        """``Client.get``."""
        return self._run(self.client.get(namespace, schedule_id))

    def page(self, namespace: str, **options: Any) -> Page:
        """``Client.page``."""
        return self._run(self.client.page(namespace, **options))

    def list(
        self,
        namespace: str,
        *,
        labels: Mapping[str, str] | None = None,
        state: str | None = None,
        page_size: int = 100,
    ) -> Iterator[StoredSchedule]:
        """``Client.list``: every schedule, page after page."""
        cursor: str | None = None
        while True:
            found = self.page(namespace, labels=labels, state=state, limit=page_size, cursor=cursor)
            yield from found.schedules
            if found.next_cursor is None:
                return
            cursor = found.next_cursor

    def pause(self, namespace: str, schedule_id: str) -> StoredSchedule:
        """``Client.pause``."""
        return self._run(self.client.pause(namespace, schedule_id))

    def resume(self, namespace: str, schedule_id: str) -> StoredSchedule:
        """``Client.resume``."""
        return self._run(self.client.resume(namespace, schedule_id))

    def delete(self, namespace: str, schedule_id: str) -> StoredSchedule:
        """``Client.delete``."""
        return self._run(self.client.delete(namespace, schedule_id))

    def trigger(self, namespace: str, schedule_id: str) -> Triggered:
        """``Client.trigger``."""
        return self._run(self.client.trigger(namespace, schedule_id))

    def backfill(
        self,
        namespace: str,
        schedule_id: str,
        start: datetime | str,
        end: datetime | str,
        *,
        limit: int | None = None,
    ) -> int:
        """``Client.backfill``."""
        return self._run(self.client.backfill(namespace, schedule_id, start, end, limit=limit))


async def _cancel_the_rest() -> None:
    """What the connection left running on the client's loop, ended before the loop closes."""
    current = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not current]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
