"""The pool of physical KV blocks: ids, reference counts, the free list and the
index of cached full blocks.

Pure bookkeeping: no tensors live here. A physical block id indexes the first
dimension of every layer's K and V cache tensors.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out physical blocks, takes them back, and remembers what full blocks hold.

    Invariants, kept by every method:
    - a block is free (on one of the two free lists) exactly when its ref_cnt is 0;
    - `num_free_blocks + num_used_blocks == num_blocks`;
    - `cached[h] == b` exactly when `block_hash[b] == h` for indexed blocks; a block
      keeps its hash (and stays findable) after it is freed, until it is evicted;
    - a free block is on `_free_cached` exactly when it holds a hash, else on `_free_plain`;
    - allocation takes plain free blocks first, and evicts a cached one only when no
      plain one is left, least recently freed first (LRU); a cached block that some
      request still references is never evicted (it is not free).
    The free lists are OrderedDicts: a cache hit on a free block removes it from the
    middle in O(1).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Free blocks that hold nothing reusable, and free blocks that hold a cached prefix
        # (least recently freed first): the first are handed out before any of the second.
        self._free_plain: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0
        # Told (block id, hash) when a cached block is evicted to be reused, while it still holds
        # its contents: a second tier keeps them (core/kv/tiered.py).
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable cached prefix."""
        return len(self._free_cached)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_plain or block_id in self._free_cached

    def free_block_ids(self) -> list[int]:
        """The free blocks in the order they will be reused (first = next)."""
        return [*self._free_plain, *self._free_cached]

    def allocate(self, n: int = 1) -> list[int]:
        """Take n free blocks, each with ref_cnt 1: blocks holding nothing reusable first
        (oldest first), then cached ones, least recently used first, evicting their prefix."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            free = self._free_plain if self._free_plain else self._free_cached
            block_id, _ = free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block, reviving it from the free lists if needed."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                self._free_list(b).pop(b)
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
                self._free_list(b)[b] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Index a full block by its hash. If another block already holds the same
        content, the first one stays the indexed copy."""
        if self.block_hash[block_id] is not None or block_hash in self.cached:
            return
        if self.ref_cnt[block_id] == 0:  # a free block now holds a reusable prefix
            del self._free_plain[block_id]
            self._free_cached[block_id] = None
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant of the class docstring is broken. Tests run it
        after every engine step, so the passes over the pool run in C (count, min, map over the
        free lists) and no set of the whole pool is built."""
        ref, hashes, plain, cached = self.ref_cnt, self.block_hash, self._free_plain, self._free_cached
        assert not plain.keys() & cached.keys(), f"blocks on both free lists: {sorted(plain.keys() & cached.keys())[:5]}"
        assert min(ref) >= 0, "a negative ref count"
        # No block is negative, so: free blocks all at 0, and as many as the blocks at 0.
        assert not any(map(ref.__getitem__, plain)) and not any(map(ref.__getitem__, cached)) and \
            len(plain) + len(cached) == ref.count(0), "free lists and zero ref counts differ: " \
            f"{[b for b in range(self.num_blocks) if (ref[b] == 0) != (b in plain or b in cached)][:5]}"
        assert None not in map(hashes.__getitem__, cached), "a block on the cached list holds no hash"
        assert not any(map(hashes.__getitem__, plain)), "a block on the plain list holds a hash"
        assert len(self.cached) == self.num_blocks - hashes.count(None) and \
            all(hashes[b] == h for h, b in self.cached.items()), "the hash index and the blocks' hashes differ"

    def _free_list(self, block_id: int) -> OrderedDict[int, None]:
        return self._free_plain if self.block_hash[block_id] is None else self._free_cached

    def _evict(self, block_id: int, keep: bool = True) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            del self.cached[h]
            self.block_hash[block_id] = None
            self.num_evictions += 1
            if keep and self.on_evict is not None:
                self.on_evict(block_id, h)

    def reset_cache(self) -> None:
        """Forget every cached prefix held by free blocks."""
        while self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            self._evict(block_id, keep=False)
            self._free_plain[block_id] = None
