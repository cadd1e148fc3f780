"""Per-request block tables over the block pool.

A block table maps a request's logical block i (its tokens i*block_size ..
(i+1)*block_size - 1) to a physical block id in the pool. Tables grow one block at a
time, only when a step is about to write past the last block.
"""
from __future__ import annotations

from pagellm.core.block_pool import BlockPool
from pagellm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for the next `num_new_tokens` of `request`.

        All or nothing: returns False, allocating nothing, when the pool lacks blocks.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool, tail first."""
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))

    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks
