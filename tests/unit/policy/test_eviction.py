"""Which Redis the services refuse: any whose maxmemory-policy may drop a key, on any node."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.policy import eviction

EVICTING = st.sampled_from(
    [
        "allkeys-lru",
        "allkeys-lfu",
        "allkeys-random",
        "volatile-lru",
        "volatile-lfu",
        "volatile-random",
        "volatile-ttl",
    ]
)
SAFE = st.sampled_from(["noeviction", "NoEviction", " noeviction "])


@given(st.lists(SAFE, max_size=6))
def test_nodes_that_never_evict_are_accepted(policies: list[str]) -> None:
    assert eviction.eviction_refusal(policies) is None


@given(st.lists(SAFE, max_size=6), EVICTING, st.lists(SAFE, max_size=6))
def test_one_evicting_node_is_refused_with_its_policy_and_the_fix(
    before: list[str], evicting: str, after: list[str]
) -> None:
    refusal = eviction.eviction_refusal([*before, evicting, *after])
    assert refusal is not None
    assert f"maxmemory-policy {evicting}" in refusal
    assert "set maxmemory-policy noeviction" in refusal
    assert "\n" not in refusal  # one line


def test_a_standalone_info_reply_gives_its_policy() -> None:
    info = {"used_memory": 1024, "maxmemory": 0, "maxmemory_policy": "allkeys-lru"}
    assert eviction.policies_in(info) == ["allkeys-lru"]


@given(st.dictionaries(st.from_regex(r"127\.0\.0\.1:[0-9]{4}", fullmatch=True), EVICTING | SAFE))
def test_a_cluster_info_reply_gives_every_nodes_policy(nodes: dict[str, str]) -> None:
    info = {name: {"maxmemory_policy": policy, "maxmemory": 0} for name, policy in nodes.items()}
    assert sorted(eviction.policies_in(info)) == sorted(nodes.values())


def test_a_redis_that_hides_its_policy_is_not_refused() -> None:
    assert eviction.policies_in({"used_memory": 1024}) == []
    assert eviction.eviction_refusal([]) is None
