"""The prefix cache with a second tier: blocks evicted from the pool are kept elsewhere by their
hash, and brought back on a later hit instead of being recomputed.

PagedAttention's prefix cache keeps a freed full block findable until the pool reuses it. With a
tier, the reuse itself demotes the block: the pool tells this manager (BlockPool.on_evict) while
the block still holds its K/V, and a "demote" move asks the runner to copy it out before the step
writes into it. A later request whose prefix runs past the pool's cached blocks looks the next
hashes up in the tier; each hit takes a pool block, a "promote" move writes the stored bytes into
it before the step runs, and the block joins the pool's index as any cached block would. (A
preempted request's full blocks come back the same way when it resumes, so preemption by
recomputation recomputes only what the tier does not hold.)

Moves are recorded in the order they must happen (a block demoted and then reused as a
promotion's target in the same step must be read before it is written, and the reverse) and
handed to the runner by `take_tier_ops`; the engine makes them before the step's block copies
and forward pass, and before anything else, so a step that schedules nothing still makes them.

The tier's contents are its own business (`BlockTier`: worker/kv_tier.py keeps them on disk with
checksums): `load` either returns a verified payload or None, so a lost, corrupt or foreign entry
is a miss and the block is recomputed, never served wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pagellm.core.kv.paged import KVCacheManager, hash_block, request_block_hashes
from pagellm.core.request import Request


class BlockTier(Protocol):
    def load(self, key: bytes) -> Any | None:
        """The payload stored under `key`, verified, or None."""

    def store(self, key: bytes, payload: Any) -> None:
        """Keep `payload` under `key` (best effort: a full or failing tier may drop it)."""


@dataclass(frozen=True)
class TierOp:
    """One move: "demote" copies pool block `block` out under `key`; "promote" writes `payload`
    (loaded from the tier under `key`) into `block`."""

    kind: str
    block: int
    key: bytes
    payload: Any = None


class TieredKVManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, tier: BlockTier, enable_prefix_caching: bool = True) -> None:
        if not enable_prefix_caching:
            raise ValueError("a second KV tier keeps prefix-cache blocks by their hash: it needs "
                             "enable_prefix_caching=True")
        super().__init__(num_blocks, block_size, enable_prefix_caching=True)
        self.tier = tier
        self.pending_tier_ops: list[TierOp] = []
        self.pool.on_evict = self._demote
        self.num_demoted = 0  # blocks sent to the tier
        self.num_promoted = 0  # blocks brought back from it
        self.num_swapped_out = 0  # requests preempted by swapping (swap_out)

    def _demote(self, block: int, key: bytes) -> None:
        self.pending_tier_ops.append(TierOp("demote", block, key))
        self.num_demoted += 1

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """(block, key) of every block the pool's prefix cache indexes now."""
        return [(b, h) for h, b in self.pool.cached.items()]

    def take_tier_ops(self) -> list[TierOp]:
        ops, self.pending_tier_ops = self.pending_tier_ops, []
        return ops

    def swap_out(self, request: Request) -> bool:
        """Preemption by swapping (before `free`): every block the request has computed goes to
        the tier now, so that when it is admitted again get_computed_blocks brings all of its K/V
        back. A last block that is not full goes under hash_block of the tokens it holds: fewer
        than a full block's, so its key is never a full block's."""
        table = self._tables.get(request.request_id)
        done = request.num_computed_tokens
        if not table or not done:
            return False
        bs = self.block_size
        hashes = request_block_hashes(request, bs, done // bs)
        for i, h in enumerate(hashes):
            self.pending_tier_ops.append(TierOp("demote", table[i], h))
        if done % bs:
            tokens = request.all_token_ids[len(hashes) * bs:done]
            key = hash_block(hashes[-1] if hashes else None, tokens, request.cache_salt)
            self.pending_tier_ops.append(TierOp("demote", table[len(hashes)], key))
        self.num_demoted += len(hashes) + (1 if done % bs else 0)
        self.num_swapped_out += 1
        return True

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The pool's cached prefix, continued block by block from the pool or the tier, and a
        swapped-out request's last, partial block. Full blocks promoted from the tier stay in the
        pool's index even if the request is not admitted now."""
        if request.num_computed_tokens:
            return [], 0
        bs = self.block_size
        hashes = request_block_hashes(request, bs, request.num_tokens // bs)
        blocks: list[int] = []
        partial = 0
        try:
            for h in hashes:
                b = self.pool.lookup(h)
                if b is None:
                    b = self._promote(h)
                    if b is None:
                        break
                    self.pool.cache(b, h)
                else:
                    # Held while later promotions allocate, so that none of them evicts it.
                    self.pool.incref([b])
                blocks.append(b)
            k = len(blocks)
            if k == (request.num_tokens - 1) // bs and (request.num_tokens - 1) % bs:
                # A request swapped out mid-block: its partial block is in the tier under the key of
                # the tokens it held (all but the last, which was still to be computed).
                tokens = request.all_token_ids[k * bs:request.num_tokens - 1]
                b = self._promote(hash_block(hashes[k - 1] if k else None, tokens, request.cache_salt))
                if b is not None:
                    blocks.append(b)
                    partial = len(tokens)
        finally:
            self.pool.free(reversed(blocks))  # back to ref 0: free, and cached if full, as the pool's hits are
        return blocks, min((len(blocks) - 1) * bs + partial if partial else len(blocks) * bs, request.num_tokens - 1)

    def _promote(self, key: bytes) -> int | None:
        """A pool block that will hold the tier's block `key` before the step runs, or None."""
        if self.pool.num_free_blocks == 0:
            return None
        payload = self.tier.load(key)
        if payload is None:
            return None
        (b,) = self.pool.allocate(1)  # may evict (and demote) another cached block
        self.pending_tier_ops.append(TierOp("promote", b, key, payload))
        self.num_promoted += 1
        return b
