"""Waiting on many futures at once (no I/O)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from services.executor import settle, waves
from services.executor.http import _Limit
from services.executor.settle import Outcome
from shared.contract.delivery import Occurrence
from shared.rules.plan import IntervalRule, Plan, WebhookPlan
from shared.runtime import transient
from tests.unit.executor.test_settle import occurrence


async def test_arrivals_hand_over_what_ended_a_batch_at_a_time() -> None:
    loop = asyncio.get_running_loop()
    arrivals = waves.Arrivals()
    futures = [loop.create_future() for _ in range(3)]
    for future in futures:
        future.add_done_callback(arrivals.add)
    futures[0].set_result(1)
    futures[2].set_result(3)
    assert await asyncio.wait_for(arrivals.next(), 1) == {futures[0], futures[2]}
    waiting = asyncio.ensure_future(arrivals.next())
    await asyncio.sleep(0)
    assert not waiting.done()
    futures[1].set_result(2)
    assert await asyncio.wait_for(waiting, 1) == {futures[1]}


async def test_ended_attempts_keep_their_results_and_the_first_failure() -> None:
    loop = asyncio.get_running_loop()
    attempts = waves.Watched(waves.Arrivals())
    parked, failed, cancelled = (loop.create_future() for _ in range(3))
    for attempt in (parked, failed, cancelled):
        attempts.add(attempt)
    parked.set_result(None)
    failed.set_exception(RuntimeError("bug"))
    cancelled.cancel()
    ended, failure = waves.ended({parked, failed, cancelled}, attempts)
    assert ended == [] and isinstance(failure, RuntimeError) and not attempts


async def test_the_http_limit_serves_in_order_and_a_cancelled_waiter_loses_no_slot() -> None:
    limit = _Limit(1)
    await limit.acquire()
    first = asyncio.ensure_future(limit.acquire())
    second = asyncio.ensure_future(limit.acquire())
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    limit.release()  # skips the cancelled waiter
    await asyncio.wait_for(second, 1)
    limit.release()
    assert limit.free == 1


async def test_a_step_keeps_its_bug_for_later_and_lets_a_stop_through() -> None:
    async def buggy() -> BaseException | None:
        raise RuntimeError("bug")

    async def stopped() -> BaseException | None:
        raise transient.Stopped("begin")

    assert isinstance(await waves.kept(buggy()), RuntimeError)
    with pytest.raises(transient.Stopped):
        await waves.kept(stopped())


def test_one_attempt_whose_settlement_fails_leaves_the_others_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = Plan(version=1, rule=IntervalRule(10_000), target=WebhookPlan("http://sink/x"))
    attempts = [
        waves.Attempt(occurrence(plan, 100_000, attempt=n), "k", 100_000, Outcome(True), 0, 0, 0)
        for n in (1, 2, 3)
    ]
    real = settle.settle

    def buggy(occ: Occurrence, *args: Any, **kwargs: Any) -> settle.Settlement:
        if occ.attempt == 2:
            raise RuntimeError("bug")
        return real(occ, *args, **kwargs)

    monkeypatch.setattr(settle, "settle", buggy)
    settled, failure = waves.settlements(attempts, random.Random(0))
    assert [occ.attempt for occ, _ in settled] == [1, 3]
    assert isinstance(failure, RuntimeError)
