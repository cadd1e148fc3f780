"""The pool of physical KV blocks: ids, reference counts and the free list.

Pure bookkeeping: no tensors live here. A physical block id indexes the first
dimension of every layer's K and V cache tensors.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out physical blocks and takes them back.

    Invariants: every block is either on the free list with ref_cnt 0, or off it with
    ref_cnt >= 1; `num_free_blocks + num_used_blocks == num_blocks`. The free list is
    kept in least-recently-freed-first order (an OrderedDict gives O(1) removal from
    the middle, which a later cache hit on a freed block needs).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def allocate(self, n: int = 1) -> list[int]:
        """Take n blocks off the free list (oldest first), each with ref_cnt 1."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share blocks that are already in use."""
        for b in block_ids:
            assert self.ref_cnt[b] > 0, f"incref of free block {b}"
            self.ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 is free again.

        Callers pass a request's blocks in reverse so that its tail goes to the free
        list first and, under LRU reuse, is the first to be overwritten.
        """
        for b in block_ids:
            cnt = self.ref_cnt[b] - 1
            assert cnt >= 0, f"double free of block {b}"
            self.ref_cnt[b] = cnt
            if cnt == 0:
                self._free[b] = None
