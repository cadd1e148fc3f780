"""Fork, copy-on-write, free and evict, driven by hypothesis against a shadow model of
what each physical block holds."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagellm.core.kv.coordinator import KVCoordinator
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams


class Shadow:
    """What each slot of each physical block holds, written only as a model runner would:
    block copies first, then the step's tokens through the block table (each KV group's, for
    the hybrid manager: tests/core/test_hybrid_kv.py)."""

    def __init__(self, kv: KVCoordinator) -> None:
        self.kv = kv
        self.slots: dict[tuple[int, int], int] = {}
        self.hash_tokens: dict[bytes, list[int]] = {}
        self.hash_prefix: dict[bytes, tuple[int, ...]] = {}  # every token up to the block's end

    def on_step(self, req: Request, n: int) -> None:
        """Called with each request a step writes (its next n tokens), before it advances."""

    def write(self, group: int, table: list[int], req: Request, n: int) -> None:
        """The step's tokens written through one group's table."""
        bs, tokens = self.kv.block_size, req.all_token_ids
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.slots[(table[p // bs], p % bs)] = tokens[p]

    def run_step(self, req: Request, n: int) -> None:
        for src, dst in self.kv.take_copies():
            for off in range(self.kv.block_size):
                if (src, off) in self.slots:
                    self.slots[(dst, off)] = self.slots[(src, off)]
                else:
                    self.slots.pop((dst, off), None)
        for g, table in enumerate(self.kv.group_tables(req.request_id)):  # one table, or one per KV group
            self.write(g, table, req, n)
        self.on_step(req, n)
        req.num_computed_tokens += n
        self.kv.cache_full_blocks(req)
        bs, tokens = self.kv.block_size, req.all_token_ids
        for i, h in enumerate(req.block_hashes[:req.num_hashed_blocks]):
            self.hash_tokens.setdefault(h, tokens[i * bs:(i + 1) * bs])
            self.hash_prefix.setdefault(h, tuple(tokens[:(i + 1) * bs]))


def _check(kv: KVCoordinator, reqs: dict[str, Request], shadow: Shadow) -> None:
    kv.check_integrity()
    pool, bs = kv.pool, kv.block_size
    counts = [0] * kv.num_blocks
    for t in kv.block_tables.values():
        for b in t:
            counts[b] += 1
    assert counts == pool.ref_cnt
    assert sorted(pool.free_block_ids()) == [b for b in range(kv.num_blocks) if counts[b] == 0]
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h
        # A cached block holds exactly the tokens its hash stands for.
        assert [shadow.slots.get((b, o)) for o in range(bs)] == shadow.hash_tokens[h]
    assert sum(h is not None for h in pool.block_hash) == len(pool.cached)
    # Isolation: every sequence reads back its own tokens, never a sibling's.
    for rid, req in reqs.items():
        table, tokens = kv.block_table(rid), req.all_token_ids
        for p in range(req.num_computed_tokens):
            assert shadow.slots.get((table[p // bs], p % bs)) == tokens[p], (rid, p)


op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 14)),
    st.tuples(st.just("step"), st.integers(0, 9), st.integers(1, 6)),
    st.tuples(st.just("fork"), st.integers(0, 9), st.integers(0, 9)),
    st.tuples(st.just("free"), st.integers(0, 9), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(2, 20), block_size=st.sampled_from([1, 2, 4]), ops=st.lists(op, max_size=80),
       prefixes=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=14), min_size=4, max_size=4))
def test_sharing_keeps_refcounts_hashes_and_isolation(num_blocks, block_size, ops, prefixes):
    kv = KVCoordinator(num_blocks, block_size)
    shadow = Shadow(kv)
    reqs: dict[str, Request] = {}
    next_id = 0
    token = 100
    for kind, a, b in ops:
        live = sorted(reqs)
        if kind == "add":
            # Prompts from a few shared prefixes (tiny alphabet), so cache hits are common.
            req = Request(f"r{next_id}", prefixes[a][:b] or [1], SamplingParams())
            next_id += 1
            blocks, cached = kv.get_computed_blocks(req)
            req.num_computed_tokens = cached
            n = req.num_tokens - cached
            if kv.allocate_slots(req, n, blocks):
                reqs[req.request_id] = req
                shadow.run_step(req, n)
        elif kind == "step" and live:
            req = reqs[live[a % len(live)]]
            for _ in range(b - 1):  # a multi-token step, as after a preemption
                req.output_token_ids.append(token)
                token += 1
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
        elif kind == "free" and live:
            kv.free(reqs.pop(live[a % len(live)]))
        _check(kv, reqs, shadow)
    for req in reqs.values():
        kv.free(req)
    assert kv.pool.num_free_blocks == num_blocks and not any(kv.pool.ref_cnt)
