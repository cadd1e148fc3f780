"""The KV coordinator (one block table per group of layers, sliding groups giving back what
slid out, a second tier behind the prefix cache), driven by hypothesis against a shadow of what
each physical block holds: add (with prefix-cache hits and tier promotions), step, fork, preempt
and recompute or swap, free; after every operation the
bookkeeping invariants hold, every cached block holds the tokens its hash stands for, every
sequence reads back its own tokens inside each group's window, and a sliding group's footprint
stays bounded by its window. Recurrent (STATE) groups: each step reads the state its sequence's
blocks hold and writes the next one; a sequence finds there the state of exactly its own computed
tokens (a fork's sibling never overwrites it), and holds state_blocks blocks a group."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagellm.core.kv.groups import STATE, plan_kv_groups
from pagellm.core.kv.coordinator import NULL_BLOCK, KVCoordinator
from pagellm.core.kv.interface import cdiv
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams
from tests.core.test_sharing_invariants import Shadow as SharingShadow

MAX_STEP = 14  # the most tokens one operation computes for a sequence


class DictTier:
    """A second tier in a dict: what a demoted block's slots held, under its key."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, dict[int, object]] = {}

    def load(self, key: bytes) -> dict[int, object] | None:
        return self.blocks.get(key)


class Shadow(SharingShadow):
    """The paged test's shadow of the blocks (it writes through every group's table), which also
    remembers where each sequence's last allocation started, and makes the tier's moves as the
    runner does: before the step's copies and writes."""

    def __init__(self, kv: KVCoordinator, tier: DictTier | None = None) -> None:
        super().__init__(kv)
        self.last_start: dict[str, int] = {}
        self.tier = tier

    def apply_tier_ops(self) -> None:
        bs = self.kv.block_size
        for op in self.kv.take_tier_ops():
            if op.kind == "demote":
                self.tier.blocks[op.key] = {o: self.slots.get((op.block, o)) for o in range(bs)}
            else:
                for o, v in op.payload.items():
                    if v is None:
                        self.slots.pop((op.block, o), None)
                    else:
                        self.slots[(op.block, o)] = v

    def run_step(self, req: Request, n: int) -> None:
        self.apply_tier_ops()
        super().run_step(req, n)

    def write(self, group: int, table: list[int], req: Request, n: int) -> None:
        if self.kv.windows[group] != STATE:
            return super().write(group, table, req, n)
        # A recurrent layer reads its state (none before the first token) and writes the next.
        computed = req.num_computed_tokens
        if computed:
            for b in table:
                assert self.slots.get((b, 0)) == tuple(req.all_token_ids[:computed]), (req.request_id, group, b)
        for b in table:
            self.slots[(b, 0)] = tuple(req.all_token_ids[:computed + n])

    def on_step(self, req: Request, n: int) -> None:
        for g, table in enumerate(self.kv.group_tables(req.request_id)):
            if self.kv.windows[g] in (None, STATE):  # null entries only in sliding tables (check_integrity)
                continue
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                assert table[p // self.kv.block_size] != NULL_BLOCK, "a token written into the null block"
        self.last_start[req.request_id] = req.num_computed_tokens


def _check(kv: KVCoordinator, reqs: dict[str, Request], shadow: Shadow) -> None:
    kv.check_integrity()
    bs = kv.block_size
    copying = {dst for _, dst in kv.pending_copies}
    for key, b in kv.pool.cached.items():
        if len(key) == 16 + 2:
            # A state checkpoint (block hash, group, part): once its copy is made, the state of every
            # token up to the block's end.
            assert b in copying or shadow.slots.get((b, 0)) == shadow.hash_prefix[key[:16]], (key, b)
            continue
        # The group's key is the block hash (and a group byte, but for group 0).
        assert [shadow.slots.get((b, o)) for o in range(bs)] == shadow.hash_tokens[key[:16]]
    for rid, req in reqs.items():
        tokens, nxt = req.all_token_ids, req.num_computed_tokens
        for g, (w, table) in enumerate(zip(kv.windows, kv.group_tables(rid))):
            if w == STATE:
                assert len(table) == kv.state_blocks, (rid, g, table)
                assert all(shadow.slots.get((b, 0)) == tuple(tokens[:nxt]) for b in table) or nxt == 0, (rid, g)
                continue
            first = 0 if w is None else max(0, nxt - w + 1)
            # Every position the next token reads is there, and holds this sequence's token.
            for p in range(first, nxt):
                assert shadow.slots.get((table[p // bs], p % bs)) == tokens[p], (rid, g, p)
            if w is not None:
                # What slid out of the window of the last allocation's first token is given back.
                released = max(0, shadow.last_start[rid] - w + 1) // bs
                assert all(b == NULL_BLOCK for b in table[:released]), (rid, g, released, table)
                held = sum(b != NULL_BLOCK for b in table)
                assert held <= cdiv(w - 1 + MAX_STEP, bs) + 1, (rid, g, held, table)


op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, MAX_STEP)),
    st.tuples(st.just("step"), st.integers(0, 9), st.integers(1, 6)),
    st.tuples(st.just("fork"), st.integers(0, 9), st.integers(0, 9)),
    st.tuples(st.just("preempt"), st.integers(0, 9), st.just(0)),
    st.tuples(st.just("free"), st.integers(0, 9), st.just(0)),
    st.tuples(st.just("swap"), st.integers(0, 9), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(3, 40), block_size=st.sampled_from([1, 2, 4]),
       windows=st.sampled_from([(None,), (None, 3), (5,), (None, 2, 7), (4, 4), (None, STATE),
                                (None, 3, STATE, STATE)]),
       state_blocks=st.integers(1, 3), with_tier=st.booleans(), ops=st.lists(op, max_size=80),
       prefixes=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=MAX_STEP), min_size=4, max_size=4))
def test_coordinator_keeps_its_invariants(num_blocks, block_size, windows, state_blocks, with_tier, ops, prefixes):
    """Every kind of group, with and without a second tier: blocks promoted from the tier hold the
    tokens their key says (the cached-block check below), and a request swapped out to it resumes
    reading back its own tokens."""
    tier = DictTier() if with_tier else None
    kv = KVCoordinator(num_blocks, block_size, windows, max_chunk_tokens=MAX_STEP,
                       state_blocks=state_blocks if STATE in windows else 0, tier=tier)
    shadow = Shadow(kv, tier)
    reqs: dict[str, Request] = {}
    next_id, token = 0, 100

    def admit(req: Request) -> bool:
        blocks, cached = kv.get_computed_blocks(req)
        req.num_computed_tokens = cached
        n = req.num_tokens - cached
        if n > MAX_STEP or not kv.allocate_slots(req, n, blocks):
            req.num_computed_tokens = 0
            kv.free(req)  # a prefix too long to recompute in one step: not admitted
            return False
        shadow.run_step(req, n)
        return True

    for kind, a, b in ops:
        live = sorted(reqs)
        if kind == "add":
            # Prompts from a few shared prefixes (tiny alphabet), so cache hits are common.
            req = Request(f"r{next_id}", prefixes[a][:b] or [1], SamplingParams())
            next_id += 1
            if admit(req):
                reqs[req.request_id] = req
        elif kind == "step" and live:
            req = reqs[live[a % len(live)]]
            for _ in range(b):
                req.output_token_ids.append(token)
                token += 1
            n = req.num_tokens - req.num_computed_tokens
            if kv.allocate_slots(req, n):
                shadow.run_step(req, n)
            else:
                del req.output_token_ids[-b:]
        elif kind == "fork" and live:
            parent = reqs[live[a % len(live)]]
            child = parent.fork(f"r{next_id}", 1, parent.sampling_params)
            next_id += 1
            kv.fork(parent, child)
            reqs[child.request_id] = child
            shadow.last_start[child.request_id] = shadow.last_start[parent.request_id]
        elif kind == "preempt" and live:
            # Recompute: all blocks back, then the whole sequence again from its cached prefix.
            req = reqs.pop(live[a % len(live)])
            kv.free(req)
            req.num_computed_tokens = 0
            if admit(req):
                reqs[req.request_id] = req
        elif kind == "free" and live:
            kv.free(reqs.pop(live[a % len(live)]))
        elif kind == "swap" and live:
            # Preempted by swapping with a sampled token not yet computed, as the scheduler does;
            # without a tier swap_out declines and it is recomputed.
            req = reqs.pop(live[a % len(live)])
            req.output_token_ids.append(token)
            token += 1
            swapped = kv.swap_out(req)
            assert swapped == (with_tier and req.num_computed_tokens > 0)
            kv.free(req)
            req.num_computed_tokens = 0
            shadow.apply_tier_ops()
            if admit(req):
                reqs[req.request_id] = req
        if with_tier:
            shadow.apply_tier_ops()  # the engine makes them at the next step, whatever it schedules
        _check(kv, reqs, shadow)
    for req in reqs.values():
        kv.free(req)
    kv.take_copies()  # the next step hands out the last copies, and the checkpoints they fill go to the cache
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert sum(kv.pool.ref_cnt) == (windows != (None,))  # the null block's, if reserved


def test_a_long_sliding_sequence_holds_its_window_only():
    """2,000 tokens decoded one at a time through a window of 64: the sliding group holds
    ceil(64 / 16) + 1 blocks at most, the full group all of them."""
    kv = KVCoordinator(200, 16, [None, 64], max_chunk_tokens=16)
    req = Request("a", list(range(16)), SamplingParams())
    assert kv.allocate_slots(req, 16)
    req.num_computed_tokens = 16
    peak = 0
    for t in range(2000):
        req.output_token_ids.append(t)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        full, sliding = kv.group_tables("a")
        peak = max(peak, sum(b != NULL_BLOCK for b in sliding))
        assert NULL_BLOCK not in full
    assert peak == cdiv(64, 16) + 1
    assert len(full) == cdiv(2016, 16)
    kv.check_integrity()


def test_prefix_hits_agree_across_groups():
    """A prefix is a hit only as far as every group can serve it: a sliding group needs just the
    blocks inside the window of the prefix's end; a full group needs all of them."""
    kv = KVCoordinator(64, 4, [None, 8], max_chunk_tokens=64)
    a = Request("a", list(range(40)), SamplingParams())
    assert kv.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    kv.cache_full_blocks(a)
    b = Request("b", list(range(40)) + [99], SamplingParams())
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 40
    full, sliding = blocks
    assert full == kv.group_tables("a")[0][:10]
    # The window of position 40 starts at 33: blocks 8 and 9 (tokens 32-39) from the cache, the rest null.
    assert sliding[:8] == [NULL_BLOCK] * 8 and sliding[8:] == kv.group_tables("a")[1][8:10]
    kv.free(a)  # group by group, each tail first: the full group's last block is the LRU's oldest
    plain = kv.pool.num_free_blocks - kv.pool.num_cached_free_blocks
    kv.pool.allocate(plain + 1)  # evicts it
    blocks, cached = kv.get_computed_blocks(b)
    # Nine full blocks left: a hit of 36 tokens, whose window (29-35) the sliding group still holds.
    assert cached == 36 and len(blocks[0]) == 9 and blocks[1][:7] == [NULL_BLOCK] * 7
    kv.pool.reset_cache()
    assert kv.get_computed_blocks(b) == ([], 0)


def test_group_plan_shares_tensors_evenly():
    # Gemma-3-like: five sliding layers per full one (12 layers): groups of 2 layers each.
    windows = [None if i % 6 == 5 else 1024 for i in range(12)]
    plan = plan_kv_groups(windows, 32768)
    assert plan.slots == 2 and plan.windows == (None, 1024, 1024, 1024, 1024, 1024)
    assert [plan.layer_group[i] for i in (5, 11)] == [0, 0]
    assert sorted(zip(plan.layer_group, plan.layer_slot)) == sorted({(g, s) for g, s in zip(plan.layer_group,
                                                                                            plan.layer_slot)})
    # A window as long as the longest sequence slides nothing out: one group.
    assert plan_kv_groups(windows, 1024).windows == (None,)
    assert plan_kv_groups([None] * 4, 100) == plan_kv_groups([None] * 4, 100)
    assert plan_kv_groups([None] * 4, 100).slots == 4
    # Uneven counts: 3 sliding, 2 full -> groups of 2, the last sliding group half empty.
    uneven = plan_kv_groups([8, None, 8, None, 8], 64)
    assert uneven.slots == 2 and uneven.windows == (None, 8, 8)


def test_a_fork_copies_the_state_before_either_sequence_writes_it():
    """n > 1 and beams fork a sequence mid-generation: both then hold the same state blocks, and
    the first step of each must write into its own copy, or the other reads a state that has
    seen a token it never had."""
    kv = KVCoordinator(20, 2, (None, STATE), max_chunk_tokens=MAX_STEP, state_blocks=2)
    shadow = Shadow(kv)
    parent = Request("a", [1, 2, 3], SamplingParams())
    assert kv.allocate_slots(parent, 3)
    shadow.run_step(parent, 3)
    child = parent.fork("b", 1, parent.sampling_params)
    kv.fork(parent, child)
    shadow.last_start["b"] = shadow.last_start["a"]
    assert kv.group_tables("b")[1] == kv.group_tables("a")[1]
    for req, token in ((child, 9), (parent, 8)):
        req.output_token_ids.append(token)
        assert kv.allocate_slots(req, 1)
        shadow.run_step(req, 1)
        _check(kv, {"a": parent, "b": child}, shadow)
    assert not set(kv.group_tables("a")[1]) & set(kv.group_tables("b")[1])
    # One step's blocks: 2 attention blocks each, 2 state blocks each.
    assert kv.blocks_for(4) == 2 + 2 and kv.num_used_blocks == 2 + 1 + 2 + 2


def test_a_prefix_resumes_from_the_state_checkpoint_at_its_end():
    """Prefill chunks of a recurrent model end at block boundaries, each leaving a checkpoint of the
    state there; a later prompt sharing the prefix restores the latest checkpoint it covers (a copy
    into its own state blocks) and computes from there; checkpoints outlive their request only as
    evictable cached blocks."""
    kv = KVCoordinator(40, 2, (None, STATE), max_chunk_tokens=MAX_STEP, state_blocks=2)
    shadow = Shadow(kv)
    first = Request("a", [5, 6, 7, 8, 9, 10, 11], SamplingParams())
    steps = []
    while first.num_computed_tokens < first.num_tokens:
        n = kv.chunk_tokens(first, min(first.num_tokens - first.num_computed_tokens, 3))
        steps.append(n)
        assert kv.allocate_slots(first, n)
        shadow.run_step(first, n)
        _check(kv, {"a": first}, shadow)
    # Chunks of at most 3 cut to block boundaries (2, 4), the last at the final boundary (6).
    assert steps == [2, 2, 2, 1] and kv.num_checkpoints == 3
    kv.free(first)
    kv.take_copies()
    assert kv.num_used_blocks == 0 and kv.num_cached_free_blocks > 0
    second = Request("b", [5, 6, 7, 8, 9, 10, 12, 13], SamplingParams())
    blocks, cached = kv.get_computed_blocks(second)
    assert cached == 6 and blocks[1] == kv._checkpoint(1, second.block_hashes[2])
    assert kv.group_stats()[1].checkpoints_taken == 3
    second.num_computed_tokens = cached
    assert kv.allocate_slots(second, 2, blocks)
    assert not set(kv.group_tables("b")[1]) & set(blocks[1])  # restored into its own blocks
    shadow.run_step(second, 2)  # reads the state of [5 .. 10], as its own
    assert kv.group_stats()[1].checkpoints_restored == 1
    _check(kv, {"b": second}, shadow)
    # A prompt that ends inside the prefix: the state must be restored where it resumes, one block back.
    third = Request("c", [5, 6, 7, 8, 9], SamplingParams())
    assert kv.get_computed_blocks(third)[1] == 4


def test_a_prompt_sharing_only_part_of_a_prefix_leaves_a_checkpoint_where_the_sharing_ends():
    """A shared system prompt ends inside another prompt: the first prompt's checkpoint is at its own
    last boundary, past the shared part; the second finds the shared blocks but no checkpoint, so its
    prefill stops where they end; the third resumes there."""
    kv = KVCoordinator(60, 2, (None, STATE), max_chunk_tokens=MAX_STEP, state_blocks=1)
    shadow = Shadow(kv)
    system = [5, 6, 7, 8, 9, 10]
    for i, (rid, user) in enumerate((("a", [20, 21, 22]), ("b", [30, 31, 32]), ("c", [40, 41, 42]))):
        req = Request(rid, system + user, SamplingParams())
        blocks, cached = kv.get_computed_blocks(req)
        assert cached == [0, 0, 6][i]
        req.num_computed_tokens = cached
        chunks = []
        while req.num_computed_tokens < req.num_tokens:
            n = kv.chunk_tokens(req, req.num_tokens - req.num_computed_tokens)
            assert kv.allocate_slots(req, n, blocks if not chunks else ())
            chunks.append(n)
            shadow.run_step(req, n)
            _check(kv, {rid: req}, shadow)
        assert chunks == [[8, 1], [6, 2, 1], [2, 1]][i]
        kv.free(req)
        kv.take_copies()


def test_a_sliding_prefix_comes_back_from_the_tier_as_far_as_a_hit_needs():
    """A prefix pushed out of the pool entirely comes back from the tier: every block of the full
    group, and of the sliding group only the two inside the window of the prefix's end; each holds
    the tokens its key says when the step reads it."""
    tier = DictTier()
    kv = KVCoordinator(25, 4, [None, 8], max_chunk_tokens=64, tier=tier)
    shadow = Shadow(kv, tier)
    a = Request("a", list(range(40)), SamplingParams())
    assert kv.allocate_slots(a, 40)
    shadow.run_step(a, 40)
    kv.free(a)
    other = Request("o", list(range(100, 196)), SamplingParams())  # 24 blocks a group: all of the pool
    assert kv.allocate_slots(other, 48)
    shadow.run_step(other, 48)
    kv.free(other)
    shadow.apply_tier_ops()
    assert kv.tier_stats().demoted_blocks == 20 and not any(len(k) <= 17 and k[:16] in a.block_hashes
                                                               for k in kv.pool.cached)
    b = Request("b", list(range(40)) + [99], SamplingParams())
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 40 and kv.tier_stats().promoted_blocks == 10 + 2
    assert blocks[1][:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in blocks[1][8:]
    b.num_computed_tokens = cached
    assert kv.allocate_slots(b, 1, blocks)
    shadow.run_step(b, 1)  # makes the promotions first, then checks b reads its own tokens
    _check(kv, {"b": b}, shadow)
