"""The coordinator's tier moves (core/kv/tiered.py) with a real disk tier, each block's contents
tracked as the hash of the tokens it holds: whatever order evictions and hits come in, applying
the moves in the order given leaves every cached block holding what its hash says."""
from __future__ import annotations

import torch

from pagellm.core.kv.block_hash import request_block_hashes
from pagellm.core.kv.coordinator import KVCoordinator
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.worker.kv_tier import DiskKVTier

BS = 2


class Blocks:
    """The pool's contents: per block id, the 16-byte hash of the tokens it holds."""

    def __init__(self, n: int) -> None:
        self.held = [bytes(16)] * n

    def apply(self, ops, tier) -> None:
        for op in ops:
            if op.kind == "demote":
                tier.store(op.key, torch.frombuffer(bytearray(self.held[op.block]), dtype=torch.uint8))
            else:
                self.held[op.block] = op.payload.numpy().tobytes()

    def compute(self, kv, req: Request) -> None:
        """The forward pass: every block of the request now holds its own tokens."""
        hashes = request_block_hashes(req, BS, req.num_tokens // BS)
        for b, h in zip(kv.block_table(req.request_id), hashes):
            self.held[b] = h


def _serve(kv, blocks, tier, rid: str, tokens: list[int]) -> int:
    """Admit, run and finish one request; returns the tokens its cached prefix let it skip."""
    req = Request(rid, tokens, SamplingParams())
    computed, skipped = kv.get_computed_blocks(req)
    req.num_computed_tokens = skipped
    assert kv.allocate_slots(req, req.num_tokens - skipped, computed)
    blocks.apply(kv.take_tier_ops(), tier)  # before the step writes, as the engine does
    for b, h in zip(kv.block_table(rid), request_block_hashes(req, BS, req.num_tokens // BS)):
        if computed and b in computed[0]:
            assert blocks.held[b] == h, "a cached or promoted block does not hold its tokens"
    blocks.compute(kv, req)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    kv.free(req)
    kv.check_integrity()
    return skipped


def test_moves_in_order_keep_every_block_true_to_its_hash(tmp_path):
    tier = DiskKVTier(str(tmp_path), DiskKVTier.slot_size(16) * 64, 16, bytes(16))
    kv = KVCoordinator(num_blocks=4, block_size=BS, tier=tier)
    blocks = Blocks(4)
    a, b, c = list(range(10, 18)), list(range(30, 38)), list(range(50, 58))
    assert _serve(kv, blocks, tier, "a1", a) == 0
    assert _serve(kv, blocks, tier, "b1", b) == 0  # evicts all of a: four demotions
    # a again: each of its blocks is promoted into a block that b's eviction frees in the same
    # step (demote, then promote, per block), and b's blocks reach the tier intact.
    assert _serve(kv, blocks, tier, "a2", a) == 7  # all but the last token, which is recomputed
    assert _serve(kv, blocks, tier, "b2", b) == 7
    assert _serve(kv, blocks, tier, "c1", c) == 0
    assert _serve(kv, blocks, tier, "a3", a) == 7
    assert kv.tier_stats().promoted_blocks == 12 and tier.stats().corrupt == 0
    tier.close()


def test_a_swapped_request_gets_every_computed_block_back(tmp_path):
    """Swapped out with 7 tokens computed (3 full blocks of 2 and 1 token in a 4th) and an 8th
    sampled, then pushed out of the pool entirely: on resume all 4 blocks come back from the tier
    (the partial one under its own key, never indexed as a full block) and only the 8th token is
    left to compute."""
    tier = DiskKVTier(str(tmp_path), DiskKVTier.slot_size(16) * 64, 16, bytes(16))
    kv = KVCoordinator(num_blocks=4, block_size=BS, tier=tier)
    blocks = Blocks(4)
    req = Request("a", list(range(10, 17)), SamplingParams())
    assert kv.allocate_slots(req, 7)
    blocks.apply(kv.take_tier_ops(), tier)
    held = {b: bytes([i]) * 16 for i, b in enumerate(kv.block_table("a"))}  # what the forward pass wrote
    for b, content in held.items():
        blocks.held[b] = content
    req.num_computed_tokens = 7
    kv.cache_full_blocks(req)
    req.append_token(17)
    assert kv.swap_out(req) and kv.tier_stats().swapped_out_requests == 1
    kv.free(req)
    req.num_computed_tokens = 0
    blocks.apply(kv.take_tier_ops(), tier)
    _serve(kv, blocks, tier, "other", list(range(50, 58)))  # takes all 4 blocks
    computed, skipped = kv.get_computed_blocks(req)
    assert skipped == 7 and len(computed[0]) == 4
    req.num_computed_tokens = skipped
    assert kv.allocate_slots(req, 1, computed)
    blocks.apply(kv.take_tier_ops(), tier)
    assert [blocks.held[b] for b in kv.block_table("a")] == list(held.values())
    assert sum(1 for b in computed[0] if kv.pool.block_hash[b] is None) == 1  # the partial block
    kv.check_integrity()
    tier.close()
