"""Shard lease arithmetic (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.dispatcher.leases import fair_share, moves, search_order


def test_fair_share() -> None:
    assert [fair_share(16, n) for n in (0, 1, 2, 3, 16, 17)] == [16, 16, 8, 6, 1, 1]


@given(st.integers(1, 1024), st.text(min_size=1, max_size=32))
def test_search_order_visits_every_shard_once(shards: int, dispatcher_id: str) -> None:
    order = search_order(shards, dispatcher_id)
    assert sorted(order) == list(range(shards))
    assert order == search_order(shards, dispatcher_id)


@given(st.integers(1, 64), st.data())
def test_moves_bring_a_dispatcher_to_its_share(shards: int, data: st.DataObject) -> None:
    order = search_order(shards, data.draw(st.text(min_size=1, max_size=8)))
    owned = set(data.draw(st.lists(st.sampled_from(range(shards)), unique=True)))
    share = data.draw(st.integers(1, shards))
    give_back, candidates = moves(owned, order, share)
    if len(owned) > share:
        assert len(owned) - len(give_back) == share and set(give_back) <= owned
        assert candidates == []
    else:
        assert give_back == []
        assert set(candidates) == set(range(shards)) - owned
