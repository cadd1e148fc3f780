"""The prefix cache's second tier, as a hook on the block pool: blocks evicted from the pool are
kept elsewhere by their key, and brought back on a later hit instead of being recomputed.

PagedAttention's prefix cache keeps a freed full block findable until the pool reuses it. With a
tier, the reuse itself demotes the block: the pool tells the coordinator (BlockPool.on_evict)
while the block still holds its K/V, and a "demote" move asks the runner to copy it out before the
step writes into it. A later request whose prefix the pool has lost asks the tier for the blocks a
hit needs (core/kv/coordinator.py says which); each one found takes a pool block, a "promote" move
writes the stored bytes into it before the step runs, and the block joins the pool's index as any
cached block would. (A preempted request's blocks come back the same way when it resumes, so
preemption by recomputation recomputes only what the tier does not hold.)

Keys are the pool's: the chained block hash, qualified with the KV group for any group but the
first (so a sliding group's block is never taken for a full group's), reduced to the tier's 16
bytes. Moves are recorded in the order they must happen (a block demoted and then reused as a
promotion's target in the same step must be read before it is written, and the reverse) and
handed to the runner by `take_ops`; the engine makes them before the step's block copies and
forward pass, and before anything else, so a step that schedules nothing still makes them.

The tier's contents are its own business (`BlockTier`: worker/kv_tier.py keeps them on disk with
checksums, one file per tensor-parallel rank): `load` either returns a verified payload (or, for
tiers whose bytes wait in the runners, a token saying every rank has them) or None, so a lost,
corrupt or foreign entry is a miss and the block is recomputed, never served wrong.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

from pagellm.core.block_pool import BlockPool
from pagellm.core.stats import TierMoveStats

KEY_BYTES = 16  # what the tier stores a block under


class BlockTier(Protocol):
    def load(self, key: bytes) -> Any | None:
        """The payload stored under `key`, verified, or None."""


@dataclass(frozen=True)
class TierOp:
    """One move: "demote" copies pool block `block` out under `key`; "promote" writes the block
    stored under `key` (`payload`, what the tier's load returned) into `block`."""

    kind: str
    block: int
    key: bytes
    payload: Any = None


class TierHook:
    """The moves between one block pool and a tier, in order, and their counts."""

    def __init__(self, tier: BlockTier, pool: BlockPool) -> None:
        self.tier = tier
        self.pool = pool
        self.pending_ops: list[TierOp] = []
        self.num_demoted = 0  # blocks sent to the tier
        self.num_promoted = 0  # blocks brought back from it
        self.num_swapped_out = 0  # requests preempted by swapping

    @staticmethod
    def tier_key(pool_key: bytes) -> bytes:
        """The tier's key for a pool key: itself if it has the tier's length, else its hash."""
        return pool_key if len(pool_key) == KEY_BYTES else hashlib.blake2b(pool_key, digest_size=KEY_BYTES).digest()

    def demote(self, block: int, pool_key: bytes) -> None:
        """Copy `block` out to the tier before anything writes into it."""
        self.pending_ops.append(TierOp("demote", block, self.tier_key(pool_key)))
        self.num_demoted += 1

    def promote(self, pool_key: bytes) -> int | None:
        """A pool block (taken, ref 1) that will hold the tier's block `pool_key` before the step
        runs, or None: not in the tier, or no free block."""
        if self.pool.num_free_blocks == 0:
            return None
        key = self.tier_key(pool_key)
        payload = self.tier.load(key)
        if payload is None:
            return None
        (b,) = self.pool.allocate(1)  # may evict (and demote) another cached block
        self.pending_ops.append(TierOp("promote", b, key, payload))
        self.num_promoted += 1
        return b

    def take_ops(self) -> list[TierOp]:
        ops, self.pending_ops = self.pending_ops, []
        return ops

    def stats(self) -> TierMoveStats:
        return TierMoveStats(self.num_demoted, self.num_promoted, self.num_swapped_out)
