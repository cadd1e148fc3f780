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


def _state_coordinator(tmp_path, num_blocks: int):
    from pagellm.core.kv.groups import STATE

    tmp_path.mkdir(exist_ok=True)
    tier = DiskKVTier(str(tmp_path), DiskKVTier.slot_size(16) * 64, 16, bytes(16))
    return tier, KVCoordinator(num_blocks=num_blocks, block_size=BS, windows=[None, STATE], state_blocks=1, tier=tier)


def _copy(blocks: Blocks, kv) -> None:
    for src, dst in kv.take_copies():
        blocks.held[dst] = blocks.held[src]


def _run_and_swap(kv, blocks, tier, tokens: list[int]) -> tuple[Request, dict, bytes]:
    """Compute `tokens`, sample one more, swap out: what its blocks and its state held."""
    req = Request("a", tokens, SamplingParams())
    assert kv.allocate_slots(req, len(tokens))
    blocks.apply(kv.take_tier_ops(), tier)
    full, state = kv.group_tables("a")
    held = {b: bytes([i]) * 16 for i, b in enumerate(full)}
    for b, content in held.items():
        blocks.held[b] = content
    blocks.held[state[0]] = b"state after %04d" % len(tokens)  # 16 bytes: a block of this tier
    req.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(req)
    _copy(blocks, kv)
    req.append_token(99)
    assert kv.swap_out(req)
    kv.free(req)
    req.num_computed_tokens = 0
    blocks.apply(kv.take_tier_ops(), tier)
    return req, held, blocks.held[state[0]]


def test_a_swapped_recurrent_request_resumes_with_its_state(tmp_path):
    """With a recurrent group, swapping sends the state too, as a checkpoint after exactly the
    computed tokens (mid-block: under the partial block's key; at a boundary: the last full
    block's). Pushed out of the pool, the request resumes with every block and its state back
    and only its sampled token to compute."""
    for length in (7, 8):
        tier, kv = _state_coordinator(tmp_path / str(length), 8)
        blocks = Blocks(8)
        req, held, state = _run_and_swap(kv, blocks, tier, list(range(10, 10 + length)))
        for i in range(3):  # other prompts take every block, cached ones too
            _serve(kv, blocks, tier, f"other{i}", list(range(40 + 20 * i, 46 + 20 * i)))
            _copy(blocks, kv)  # their checkpoints, as the next step hands them out
        computed, skipped = kv.get_computed_blocks(req)
        assert skipped == length, (length, skipped)
        req.num_computed_tokens = skipped
        assert kv.allocate_slots(req, 1, computed)
        blocks.apply(kv.take_tier_ops(), tier)
        _copy(blocks, kv)  # the checkpoint restored into the request's own state block
        full, own_state = kv.group_tables("a")
        assert [blocks.held[b] for b in full[:len(held)]] == list(held.values())
        assert blocks.held[own_state[0]] == state
        kv.check_integrity()
        tier.close()


def test_an_evicted_state_checkpoint_comes_back_from_the_tier(tmp_path):
    """A prompt's checkpoint (the state after its last full block before the final token),
    evicted with its blocks, is promoted with them: the same prompt again skips all but its
    last token and restores that state."""
    tier, kv = _state_coordinator(tmp_path, 8)  # 7 blocks and the null block
    blocks = Blocks(8)
    prompt = list(range(10, 15))  # 5 tokens: a checkpoint after 4
    req = Request("a", prompt, SamplingParams())
    assert kv.allocate_slots(req, 4)  # the prefill stops at the boundary, as chunk_tokens says
    full, state = kv.group_tables("a")
    blocks.held[state[0]] = b"state after 0004"
    req.num_computed_tokens = 4
    kv.cache_full_blocks(req)  # takes the checkpoint: a copy of the state block
    _copy(blocks, kv)
    kv.free(req)
    _serve(kv, blocks, tier, "other", list(range(40, 52)))  # 6 blocks and its state: evicts all of a's
    _copy(blocks, kv)
    assert kv.tier_stats().demoted_blocks >= 3
    again = Request("b", prompt, SamplingParams())
    computed, skipped = kv.get_computed_blocks(again)
    assert skipped == 4
    again.num_computed_tokens = 4
    assert kv.allocate_slots(again, 1, computed)
    blocks.apply(kv.take_tier_ops(), tier)
    _copy(blocks, kv)
    assert blocks.held[kv.group_tables("b")[1][0]] == b"state after 0004"
    kv.check_integrity()
    tier.close()
