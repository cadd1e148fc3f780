"""The block pool and block tables, driven through long random operation sequences."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pagellm.core.block_pool import BlockPool, NoFreeBlocksError
from pagellm.core.kv.coordinator import KVCoordinator
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams


def test_allocate_and_free_roundtrip():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.incref(a[:1])
    pool.free(a)
    assert pool.num_free_blocks == 3 and pool.ref_cnt[a[0]] == 1
    pool.free(a[:1])
    assert pool.num_free_blocks == 4 and all(c == 0 for c in pool.ref_cnt)


def test_free_order_puts_tail_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.free(reversed(blocks))
    # The tail block was freed first, so it is the first to be handed out again.
    assert pool.allocate(1) == [blocks[-1]]


def test_cached_blocks_are_reused_last_and_least_recently_used_first():
    """README's promise: a freed block that holds a cached prefix is overwritten only when no
    free block without one is left, and the least recently freed of them goes first."""
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    for i, b in enumerate(blocks[:3]):
        pool.cache(b, f"h{i}".encode())
    pool.free([blocks[1], blocks[0], blocks[2]])  # cached, freed in this order
    pool.free(blocks[3:])                         # plain
    assert pool.num_cached_free_blocks == 3
    assert pool.allocate(3) == blocks[3:]         # every plain block before any cached one
    assert pool.lookup(b"h0") == blocks[0]
    assert pool.allocate(1) == [blocks[1]]        # then LRU among the cached ones
    assert pool.lookup(b"h1") is None and pool.lookup(b"h0") == blocks[0] and pool.num_evictions == 1
    pool.incref([blocks[0]])                      # a hit revives a cached free block
    assert not pool.is_free(blocks[0]) and pool.free_block_ids() == [blocks[2]]
    pool.free([blocks[0]])
    assert pool.free_block_ids() == [blocks[2], blocks[0]]
    pool.reset_cache()
    assert pool.num_cached_free_blocks == 0 and pool.lookup(b"h2") is None
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 4


def test_double_free_is_caught():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams())


ops = st.lists(
    st.tuples(st.sampled_from(["grow", "free", "compute"]), st.integers(0, 7), st.integers(1, 40)),
    min_size=1, max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]), ops=ops)
def test_block_tables_keep_invariants(num_blocks, block_size, ops):
    kv = KVCoordinator(num_blocks, block_size)
    reqs: dict[str, Request] = {}
    for op, slot, n in ops:
        rid = f"r{slot}"
        req = reqs.get(rid)
        if op == "grow":
            if req is None:
                req = reqs[rid] = _req(rid, n)
            before = list(kv.block_table(rid))
            free_before = kv.pool.num_free_blocks
            ok = kv.allocate_slots(req, n)
            after = kv.block_table(rid)
            if ok:
                # Enough blocks for every token so far, and no more than one spare block's worth.
                assert len(after) * block_size >= req.num_computed_tokens + n
                assert after[:len(before)] == before
                assert len(after) == max(len(before), kv.blocks_for(req.num_computed_tokens + n))
            else:
                assert after == before and kv.pool.num_free_blocks == free_before
        elif op == "compute" and req is not None:
            req.num_computed_tokens = min(len(kv.block_table(rid)) * block_size, req.num_computed_tokens + n)
        elif op == "free" and req is not None:
            kv.free(req)
            del reqs[rid]
        _check(kv)
    for req in reqs.values():
        kv.free(req)
    assert kv.pool.num_free_blocks == num_blocks
    assert all(c == 0 for c in kv.pool.ref_cnt)


def _check(kv: KVCoordinator) -> None:
    kv.check_integrity()
    owned = [b for t in kv.block_tables.values() for b in t]
    assert len(owned) == len(set(owned)), "a block is in two tables"
    for b in range(kv.num_blocks):
        assert kv.pool.ref_cnt[b] == owned.count(b)
        assert kv.pool.is_free(b) == (kv.pool.ref_cnt[b] == 0)
    assert kv.pool.num_free_blocks + len(owned) == kv.num_blocks


@pytest.mark.parametrize("corrupt, words", [
    (lambda p, used, free: p.ref_cnt.__setitem__(free, 1), "free lists and zero ref counts differ"),
    (lambda p, used, free: p.ref_cnt.__setitem__(used, 0), "free lists and zero ref counts differ"),
    (lambda p, used, free: p.ref_cnt.__setitem__(used, -1), "negative ref count"),
    (lambda p, used, free: p._free_cached.__setitem__(free, None), "both free lists"),
    (lambda p, used, free: p.block_hash.__setitem__(free, b"h"), "plain list holds a hash"),
    (lambda p, used, free: p.cached.__setitem__(b"x", used), "hash index"),
    (lambda p, used, free: p.block_hash.__setitem__(used, b"y"), "hash index")])
def test_check_integrity_names_each_broken_invariant(corrupt, words):
    """The check tests run after every step catches each kind of corruption, and says which."""
    pool = BlockPool(64)
    used = pool.allocate(3)[1]
    pool.cache(used, b"u")
    pool.check_integrity()
    corrupt(pool, used, pool.free_block_ids()[5])
    with pytest.raises(AssertionError, match=words):
        pool.check_integrity()
