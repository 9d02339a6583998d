"""Reading the next item of an async stream while the caller works on the current one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

T = TypeVar("T")


class _End:
    """The stream ended; ``error`` is what ended it, if it failed."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error


async def read_ahead(source: AsyncIterator[T], depth: int = 1) -> AsyncGenerator[T, None]:
    """The items of ``source`` in order, with up to ``depth`` of them fetched and waiting,
    and one more being fetched.

    A rebuild waits on PostgreSQL for a page, then on Redis to write it: fetching the next
    page meanwhile overlaps the two. An error of ``source`` is raised where the caller reads
    the item that failed to come; a caller that stops early stops the fetching too.
    """
    queue: asyncio.Queue[T | _End] = asyncio.Queue(depth)

    async def fetch() -> None:
        try:
            async for item in source:
                await queue.put(item)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put(_End(exc))
            return
        await queue.put(_End())

    fetching = asyncio.create_task(fetch())
    try:
        while True:
            item = await queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        fetching.cancel()
        # Waited for without awaiting it: its cancellation would look like the caller's own,
        # and a caller cancelled meanwhile (a shutdown) would go on as if it had not been.
        await asyncio.wait([fetching])
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()
