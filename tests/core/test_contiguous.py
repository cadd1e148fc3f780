"""The contiguous-reservation allocators, checked against a plain bitmap model."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from pagellm.core.kv import KVCoordinator, make_kv_manager
from pagellm.core.kv.contiguous import ContiguousKVManager, ExtentPool, next_pow2
from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler
from pagellm.sampling_params import SamplingParams


def first_fit(bitmap: list[bool], n: int) -> int | None:
    run = 0
    for i, used in enumerate(bitmap):
        run = 0 if used else run + 1
        if run == n:
            return i - n + 1
    return None


def extents(bitmap: list[bool]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, used in enumerate(bitmap + [True]):
        if not used and start is None:
            start = i
        elif used and start is not None:
            out.append((start, i - start))
            start = None
    return out


pool_ops = st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 1000)), min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 64), ops=pool_ops)
def test_extent_pool_is_first_fit_disjoint_and_coalesced(num_blocks, ops):
    pool = ExtentPool(num_blocks)
    bitmap = [False] * num_blocks
    live: list[tuple[int, int]] = []
    for alloc, n, pick in ops:
        if alloc or not live:
            expected = first_fit(bitmap, n)
            start = pool.allocate(n)
            assert start == expected
            if start is not None:
                assert not any(bitmap[start:start + n]), "overlap"
                bitmap[start:start + n] = [True] * n
                live.append((start, n))
        else:
            start, n = live.pop(pick % len(live))
            pool.free(start, n)
            bitmap[start:start + n] = [False] * n
        # Free extents are exactly the free runs: disjoint, sorted, and merged when adjacent.
        assert pool.free_extents == extents(bitmap)
        assert pool.num_free_blocks == bitmap.count(False)
        assert pool.ref_cnt == [int(b) for b in bitmap]
        pool.check_integrity()
    for start, n in live:
        pool.free(start, n)
    assert pool.free_extents == [(0, num_blocks)]
    assert pool.num_free_blocks == num_blocks


def test_free_coalesces_both_neighbours_and_double_free_is_caught():
    pool = ExtentPool(10)
    a, b, c = pool.allocate(3), pool.allocate(3), pool.allocate(3)
    assert (a, b, c) == (0, 3, 6)
    pool.free(a, 3)
    pool.free(c, 3)
    assert pool.free_extents == [(0, 3), (6, 4)]
    # External fragmentation: 7 blocks free, but no run of 5.
    assert pool.allocate(5) is None
    pool.free(b, 3)
    assert pool.free_extents == [(0, 10)]
    with pytest.raises(AssertionError):
        pool.free(b, 3)


def test_extend_in_place_only_into_free_neighbour():
    pool = ExtentPool(8)
    a = pool.allocate(2)
    assert pool.extend(a, 2, 3)
    b = pool.allocate(1)
    assert b == 5 and not pool.extend(a, 5, 1)
    assert pool.free_extents == [(6, 2)]


def _req(rid: str, prompt: int, max_tokens: int | None) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("policy,expected", [("max", 2048), ("pow2", 100 + 64), ("oracle", 100 + 50)])
def test_policies_reserve_what_they_promise(policy, expected):
    kv = ContiguousKVManager(num_blocks=4096, block_size=1, max_model_len=2048, policy=policy)
    req = _req("a", 100, 50)
    assert kv.allocate_slots(req, 100)
    assert kv.reserved_slots("a") == expected
    # The block table covers the scheduled tokens only, consecutive from the region start.
    assert kv.block_table("a") == list(range(0, 100))
    kv.free(req)
    assert kv.pool.num_free_blocks == 4096


def test_block_aligned_regions_and_unknown_length():
    kv = ContiguousKVManager(num_blocks=64, block_size=16, max_model_len=512, policy="oracle")
    assert kv.allocate_slots(_req("a", 20, 10), 20)  # 30 tokens -> 2 blocks
    b = _req("b", 5, None)  # no max_tokens: the oracle knows nothing, so it reserves max_model_len
    assert kv.allocate_slots(b, 5)
    assert kv.block_tables == {"a": [0, 1], "b": list(range(2, 34))}
    assert next_pow2(1) == 1 and next_pow2(5) == 8 and next_pow2(64) == 64


def test_outgrowing_a_reservation_extends_or_fails():
    short = lambda r: r.num_prompt_tokens + 1  # noqa: E731 - an oracle that guesses short
    kv = ContiguousKVManager(num_blocks=10, block_size=1, max_model_len=100, policy="oracle", final_len=short)
    a, b = _req("a", 3, 5), _req("b", 3, 5)
    assert kv.allocate_slots(a, 3) and kv.allocate_slots(b, 3)
    assert kv.block_tables == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    a.num_computed_tokens = 4
    assert not kv.allocate_slots(a, 1)  # b sits right after a
    b.num_computed_tokens = 4
    assert kv.allocate_slots(b, 1) and kv.reserved_slots("b") == 5


def test_factory():
    assert isinstance(make_kv_manager("paged", 8, 16, 128), KVCoordinator)
    kv = make_kv_manager("contiguous-pow2", 8, 16, 128)
    assert isinstance(kv, ContiguousKVManager) and kv.policy == "pow2" and kv.num_blocks == 8
    with pytest.raises(ValueError, match="kv_policy"):
        make_kv_manager("contiguous", 8, 16, 128)


@pytest.mark.parametrize("policy", ["contiguous-max", "contiguous-pow2", "contiguous-oracle"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_real_scheduler_runs_to_completion(policy, block_size):
    """The scheduler, unchanged, drives a contiguous manager: everything finishes, all is freed."""
    rng = random.Random(0)
    max_model_len = 64
    kv = make_kv_manager(policy, num_blocks=160 // block_size, block_size=block_size, max_model_len=max_model_len)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32)
    reqs = []
    for i in range(20):
        p = rng.randint(1, 30)
        req = _req(f"r{i}", p, rng.randint(1, max_model_len - p))
        req.max_model_len = max_model_len
        sched.add_request(req)
        reqs.append(req)
    steps = 0
    while sched.num_unfinished:
        out = sched.schedule()
        assert not out.is_empty
        regions = [(kv._regions[s.request.request_id][0], kv._regions[s.request.request_id][1])
                   for s in out.scheduled]
        spans = sorted(regions)
        assert all(a0 + an <= b0 for (a0, an), (b0, _) in zip(spans, spans[1:])), "regions overlap"
        for s in out.scheduled:
            table = s.block_table
            assert table == list(range(table[0], table[0] + len(table)))
            assert len(table) * block_size >= s.start + s.num_new_tokens
        sched.update_after_step(out, {s.request.request_id: [7] for s in out.scheduled if s.samples})
        steps += 1
        assert steps < 5000
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in reqs)
    assert kv.pool.num_free_blocks == kv.num_blocks and kv.pool.free_extents == [(0, kv.num_blocks)]


def test_fork_copies_into_a_region_of_its_own():
    kv = ContiguousKVManager(num_blocks=32, block_size=4, max_model_len=64, policy="oracle")
    parent = _req("p", 8, 8)
    assert kv.allocate_slots(parent, 8)
    child = _req("c", 8, 8)
    kv.fork(parent, child)
    assert kv.block_tables == {"p": [0, 1, 2, 3], "c": [4, 5, 6, 7]}
    assert kv.take_copies() == [(0, 4), (1, 5)] and kv.take_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.pool.free_extents == [(0, 32)]


def test_check_integrity_sees_broken_bookkeeping():
    """Each manager's check catches a corruption of the kind it guards against."""
    from pagellm.core.kv import make_kv_manager

    paged = make_kv_manager("paged", 16, 4, 64)
    a, b = _req("a", 10, 4), _req("b", 10, 4)
    assert paged.allocate_slots(a, 10) and paged.allocate_slots(b, 10)
    paged.check_integrity()
    paged.pool.ref_cnt[paged.block_table("a")[0]] += 1  # a reference no table holds
    with pytest.raises(AssertionError, match="ref counts differ"):
        paged.check_integrity()
    paged.pool.ref_cnt[paged.block_table("a")[0]] -= 1
    paged.pool.cache(paged.block_table("a")[0], b"h")
    paged.pool.cached[b"other"] = paged.block_table("b")[0]  # an index entry the block does not hold
    with pytest.raises(AssertionError, match="hash index"):
        paged.check_integrity()

    contiguous = make_kv_manager("contiguous-max", 64, 4, 64)
    assert contiguous.allocate_slots(a, 10) and contiguous.allocate_slots(b, 10)
    contiguous.check_integrity()
    contiguous._regions["b"][0] -= 1  # b's region now overlaps a's
    with pytest.raises(AssertionError, match="overlap"):
        contiguous.check_integrity()
