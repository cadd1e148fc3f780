"""The replica router's policies (serving/router.py), without replicas: requests that share a
prefix go where it was seen; an overloaded replica is passed over; a dead one is out of rotation."""
from __future__ import annotations

import random

import pytest

from pagellm.serving.router import NoReplicaError, Router


def _prompt(system: int, user: int, n: int = 40) -> list[int]:
    rng = random.Random(system)
    head = [rng.randrange(3, 30000) for _ in range(n)]  # the shared system prompt
    return head + [user + 100, user + 200, user + 300]


def test_shared_prefixes_land_on_one_replica_and_new_ones_spread():
    router = Router(2, "cache_aware", block_size=16)
    first = {s: router.route(_prompt(s, 0)) for s in range(4)}
    for r in first.values():
        router.finished(r)
    assert sorted(first.values()) == [0, 0, 1, 1]  # unseen prefixes go to the least loaded
    for user in range(1, 6):
        for s in range(4):
            assert router.route(_prompt(s, user)) == first[s]
            router.finished(first[s])
    assert router.num_prefix_routed == 20


def test_at_low_load_new_prefixes_still_spread():
    # Each request finishes before the next arrives: in-flight counts tie at 0 every time, and
    # the replica that holds fewer prefixes gets the new one.
    router = Router(2, "cache_aware", block_size=16)
    homes = []
    for s in range(4):
        homes.append(router.route(_prompt(s, 0)))
        router.finished(homes[-1])
    assert sorted(homes) == [0, 0, 1, 1]


def test_a_short_common_header_does_not_pull_everything_to_one_replica():
    # Every prompt opens with the same 2-block header (a chat template's), then its own text.
    header = list(range(3, 35))
    router = Router(2, "cache_aware", block_size=16, min_match=0.5)
    homes = []
    for s in range(4):
        homes.append(router.route(header + _prompt(s, 0, n=64)))
        router.finished(homes[-1])
    assert sorted(homes) == [0, 0, 1, 1]
    assert router.num_prefix_routed == 0
    for s in range(4):  # header and system prompt together (all 6 full blocks) still route
        assert router.route(header + _prompt(s, 1, n=64)) == homes[s]
        router.finished(homes[s])


def test_round_robin_ignores_prefixes_and_least_loaded_counts_in_flight():
    rr = Router(3, "round_robin")
    assert [rr.route(_prompt(1, u)) for u in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = Router(3, "least_loaded")
    assert [ll.route([1, 2, 3]) for _ in range(3)] == [0, 1, 2]
    ll.finished(1)
    assert ll.route([1, 2, 3]) == 1


def test_an_overloaded_replica_is_passed_over():
    router = Router(2, "cache_aware", block_size=16, balance_abs=2, balance_rel=1.5)
    home = router.route(_prompt(7, 0))
    for u in (1, 2):  # home's lead grows to 3 in flight against 0
        assert router.route(_prompt(7, u)) == home
    # A lead of 3: over the absolute gap (2) and the relative one (1.5x): the other replica gets it.
    assert router.route(_prompt(7, 9)) == 1 - home
    assert router.in_flight[1 - home] == 1


def test_a_replica_with_a_nearly_full_kv_cache_is_passed_over():
    router = Router(2, "cache_aware", block_size=16, kv_high=0.9, kv_gap=0.2)
    home = router.route(_prompt(3, 0))
    router.finished(home)
    router.report_kv_usage(home, 0.95)
    router.report_kv_usage(1 - home, 0.8)  # full too, within the gap: the prefix still wins
    assert router.route(_prompt(3, 1)) == home
    router.finished(home)
    router.report_kv_usage(1 - home, 0.5)
    assert router.route(_prompt(3, 2)) == 1 - home
    router.finished(1 - home)
    # Equal requests in flight: the least loaded is the one with more free KV.
    assert Router(2, "least_loaded")._least_loaded() == 0
    ll = Router(2, "least_loaded")
    ll.report_kv_usage(0, 0.7)
    assert ll.route([1, 2, 3]) == 1


def test_dead_replicas_leave_the_rotation():
    router = Router(2, "cache_aware", block_size=16)
    home = router.route(_prompt(3, 0))
    router.remove(home)
    assert router.route(_prompt(3, 1)) == 1 - home
    router.remove(1 - home)
    with pytest.raises(NoReplicaError, match="no engine replica is serving"):
        router.route(_prompt(3, 2))
    with pytest.raises(ValueError, match="router_policy must be one of"):
        Router(2, "random")


def test_remembered_blocks_are_bounded():
    router = Router(1, "cache_aware", block_size=4, max_blocks_per_replica=10)
    for s in range(5):
        router.route(_prompt(s, 0, n=40))
    assert len(router._seen[0]) == 10
