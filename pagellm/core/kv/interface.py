"""What the scheduler, the engine and the block map ask of a KV manager.

A KV manager decides which physical KV blocks hold each request's tokens. The coordinator
(core/kv/coordinator.py: PagedAttention's blocks anywhere, shared by reference, copy-on-write,
prefix caching, per group of layers, with an optional second tier) and the contiguous baselines
(one reserved region a request) both implement this. Every method the scheduler, the engine and
the block map call is declared here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

from pagellm.core.request import Request
from pagellm.core.stats import KVGroupStats, TierMoveStats


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager(ABC):
    block_size: int
    # The physical blocks: anything with num_blocks and num_free_blocks.
    pool: Any
    # (src, dst) block copies that must happen before the next forward pass.
    pending_copies: list[tuple[int, int]]
    # Prefix-cache accounting: prompt tokens looked up, and of those, found cached.
    prefix_queries: int = 0
    prefix_hits: int = 0
    enable_prefix_caching: bool = False

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable cached prefix."""
        return 0

    def group_stats(self) -> list[KVGroupStats]:
        """Per KV group: its kind ("full", "sliding" or "state"), window (None unless sliding) and the
        blocks it holds."""
        return [KVGroupStats("full", None, self.num_used_blocks)]

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- tables --------------------------------------------------------------------------------
    @abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        """The physical blocks that hold the request's computed and scheduled tokens, in order."""

    @property
    def num_groups(self) -> int:
        """KV groups: block tables per request (more than one when some layers slide)."""
        return 1

    def group_tables(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in each KV group, in group order."""
        return (self.block_table(request_id),)

    def holds(self, request_id: str) -> bool:
        """Whether the request holds blocks now."""
        return request_id in self.block_tables

    @property
    @abstractmethod
    def block_tables(self) -> dict[str, list[int]]:
        """Every request's blocks (what it holds, which may be more than `block_table`)."""

    # ---- the scheduler's calls -------------------------------------------------------------------
    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks that start the request's tokens, and how many tokens they let it skip."""

    def record_prefix_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count one admitted request's lookup (not the failed attempts before it)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_cached

    def chunk_tokens(self, request: Request, num_tokens: int) -> int:
        """How many of the request's next `num_tokens` to compute this step (a layout may end
        prefill chunks at block boundaries: core/kv/coordinator.py's state checkpoints)."""
        return num_tokens

    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Room for the request's next `num_new_tokens`; all or nothing (False changes nothing)."""

    @abstractmethod
    def cache_full_blocks(self, request: Request) -> None:
        """Make the blocks its computed tokens filled findable by later requests (if this layout can)."""

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past those holding its first `num_tokens` tokens: the slots of
        proposed tokens that verification rejected (speculative decoding), dropped without a copy.
        A layout that reserves a request's whole region up front keeps it."""

    @abstractmethod
    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's KV as it is now."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release everything the request holds."""

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must make before the next forward pass."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def swap_out(self, request: Request) -> bool:
        """Preemption by swapping: send the request's computed blocks to a second tier before they
        are freed, so that it resumes from them. False: this manager has no tier (recompute)."""
        return False

    def take_tier_ops(self) -> list:
        """Block moves to and from a second tier, in order, to make before the block copies and
        the next forward pass (core/kv/tiered.py); none without a tier."""
        return []

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """(block, tier key) of every block the prefix cache indexes now that a second tier can keep
        (what a persisted tier writes out at shutdown); none without a tier."""
        return []

    def tier_stats(self) -> TierMoveStats | None:
        """The second tier's moves (None without a tier)."""
        return None

    # ---- inspection ------------------------------------------------------------------------------
    @abstractmethod
    def ref_counts(self) -> list[int]:
        """Per physical block, how many sequences hold it."""

    def cached_flags(self) -> list[bool]:
        """Per physical block: free, but holding a reusable cached prefix."""
        return [False] * self.num_blocks

    def snapshot(self) -> dict:
        """Who holds which physical block right now: the data behind a block map."""
        return {"block_size": self.block_size, "num_blocks": self.num_blocks, "ref_cnt": self.ref_counts(),
                "cached": self.cached_flags(), "tables": {rid: list(t) for rid, t in self.block_tables.items()}}

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError, saying what is wrong, if any bookkeeping invariant is broken.
        O(blocks + table entries): for tests and PAGELLM_CHECK_INVARIANTS=1, not for every step."""
