"""Delivery slots handed to namespaces in turn (no I/O)."""

from __future__ import annotations

import asyncio

from services.executor.fairslots import FairSlots


async def test_a_waiting_namespace_is_served_between_a_herds_waiters() -> None:
    slots = FairSlots(2)
    order: list[str] = []
    release = asyncio.Event()

    async def work(namespace: str) -> None:
        async with slots.slot(namespace):
            order.append(namespace)
            await release.wait()

    herd = [asyncio.create_task(work("a")) for _ in range(50)]
    await asyncio.sleep(0)
    few = [asyncio.create_task(work("b")) for _ in range(3)]
    await asyncio.sleep(0)
    assert order == ["a", "a"]
    release.set()
    await asyncio.gather(*herd, *few)
    # After the two that held slots, b's three are served within the next six.
    assert sorted(i for i, ns in enumerate(order) if ns == "b")[-1] < 2 + 6
    assert order.count("a") == 50 and slots.free == 2


async def test_a_cancelled_waiter_gives_up_its_place_and_loses_no_slot() -> None:
    slots = FairSlots(1)
    await slots.acquire("a")
    waiter = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    slots.release()
    assert slots.free == 1
    await asyncio.wait_for(slots.acquire("c"), 1)


def test_interleave_round_robins_namespaces_and_keeps_each_ones_order() -> None:
    from shared.policy import fairness  # noqa: PLC0415

    items = ["a/1", "a/2", "a/3", "b/1", "a/4", "c/1", "b/2"]
    assert fairness.interleave(items, fairness.namespace_of) == [
        "a/1",
        "b/1",
        "c/1",
        "a/2",
        "b/2",
        "a/3",
        "a/4",
    ]
    alone = ["a/3", "a/1", "a/2"]
    assert fairness.interleave(alone, fairness.namespace_of) == alone


async def test_claims_are_served_in_turn_and_a_withdrawn_one_passes_its_slot_on() -> None:
    slots = FairSlots(1)
    assert slots.take_now(2) == 1 and slots.free == 0
    first, second = slots.claim("a"), slots.claim("b")
    assert not first.done()
    slots.free += 1  # as if a slot came back without a release (no waiter served)
    assert slots.take_now(1) == 0  # others wait: nobody jumps the queue
    slots.free -= 1
    slots.release()
    assert first.done() and not second.done()
    slots.withdraw("a", first)  # granted and not used: handed on
    assert second.done()
    slots.release()
    assert slots.free == 1


async def test_a_withdrawn_waiting_claim_loses_no_slot() -> None:
    slots = FairSlots(1)
    assert slots.take_now(1)
    claim = slots.claim("a")
    slots.withdraw("a", claim)
    slots.release()
    assert slots.free == 1 and slots.take_now(1) == 1
