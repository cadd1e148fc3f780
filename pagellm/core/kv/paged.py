"""Per-request block tables over the block pool: growth, prefix reuse, forking and
copy-on-write.

A block table maps a request's logical block i (its tokens i*block_size ..
(i+1)*block_size - 1) to a physical block id in the pool. Tables grow one block at a
time, only when a step is about to write past the last block. With prefix caching,
every full block is identified by a hash chained over its parent's hash, its token
ids and the request's cache salt, so a new request can start from the blocks an
earlier one computed.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

from pagellm.core.block_pool import BlockPool
from pagellm.core.kv.interface import KVManager, cdiv
from pagellm.core.request import Request


def hash_block(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """Identity of a full block: its tokens and, through the parent hash, every token
    before it. The salt (first block only; the chain carries it) isolates tenants."""
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"salt:" + (salt or "").encode())
    else:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def request_block_hashes(request: Request, block_size: int, num_full_blocks: int) -> list[bytes]:
    """The hashes of the request's first `num_full_blocks` full blocks, computed once each and
    kept on the request (forks inherit them)."""
    hashes = request.block_hashes
    tokens = None
    while len(hashes) < num_full_blocks:
        if tokens is None:
            tokens = request.all_token_ids
        i = len(hashes)
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * block_size:(i + 1) * block_size],
                                 request.cache_salt))
    return hashes


class KVCacheManager(KVManager):
    """PagedAttention's manager: block tables over one pool, blocks shared by reference."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        # (src, dst) block copies that must happen before the next forward pass.
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of those, tokens found cached

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free_blocks

    @property
    def block_tables(self) -> dict[str, list[int]]:
        return self._tables

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def ref_counts(self) -> list[int]:
        return list(self.pool.ref_cnt)

    def cached_flags(self) -> list[bool]:
        return [c == 0 and h is not None for c, h in zip(self.pool.ref_cnt, self.pool.block_hash)]

    def check_integrity(self) -> None:
        """Reference counts equal the references in block tables; no table holds a block twice;
        copies queued for the runner write into blocks some table holds; and the pool's own
        invariants (free lists, hash index) hold."""
        self.pool.check_integrity()
        held = [0] * self.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"{rid}'s table holds a block twice: {table}"
            for b in table:
                held[b] += 1
        wrong = [(b, c, h) for b, (c, h) in enumerate(zip(self.pool.ref_cnt, held)) if c != h]
        assert not wrong, f"ref counts differ from the tables' references (block, ref_cnt, held): {wrong[:5]}"
        owned = {b for t in self._tables.values() for b in t}
        assert all(dst in owned for _, dst in self.pending_copies), f"a copy into an unowned block: " \
            f"{self.pending_copies}"

    # ---- prefix caching -------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest chain of cached blocks that starts the request's tokens, and how
        many tokens they let it skip. Takes no references (allocate_slots does).

        At least the last token is always left to compute, so the first sampled token
        comes from a real forward pass.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return [], 0
        blocks = []
        for h in request_block_hashes(request, self.block_size, request.num_tokens // self.block_size):
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, min(len(blocks) * self.block_size, request.num_tokens - 1)

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        full = min(request.num_computed_tokens // self.block_size, len(table))
        start = request.num_hashed_blocks
        if full <= start:
            return
        hashes = request_block_hashes(request, self.block_size, full)
        for i in range(start, full):
            self.pool.cache(table[i], hashes[i])
        request.num_hashed_blocks = full

    # ---- growth, sharing, release -------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for the next `num_new_tokens` of `request` (after `computed_blocks`,
        a cached prefix it starts with, if any).

        All or nothing: returns False, changing nothing, when the pool lacks blocks.
        A block about to be written that other sequences share is first copied
        (copy-on-write); the copy is queued in `pending_copies`.
        """
        bs = self.block_size
        table = self._tables.get(request.request_id, [])
        if computed_blocks:
            assert not table, "a cached prefix is only taken at admission"
            table = list(computed_blocks)
        start = request.num_computed_tokens
        end = start + num_new_tokens
        revived = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        extra = {b: 1 for b in computed_blocks}
        first, last = start // bs, min(cdiv(end, bs), len(table))
        shared = [i for i in range(first, last) if self.pool.ref_cnt[table[i]] + extra.get(table[i], 0) > 1]
        grow = max(0, self.blocks_for(end) - len(table))
        if revived + len(shared) + grow > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.incref(computed_blocks)
        for i in shared:
            (new,) = self.pool.allocate(1)
            self.pending_copies.append((table[i], new))
            self.pool.free([table[i]])
            table[i] = new
        if grow:
            table.extend(self.pool.allocate(grow))
        self._tables[request.request_id] = table
        return True

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Drop the table's blocks past the first `num_tokens` tokens, tail first. They hold no
        computed full block (none was hashed), so they go back as plain free blocks."""
        table = self._tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if table and len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's blocks by reference: nothing is copied until one
        of them writes into a shared block."""
        table = list(self._tables.get(parent.request_id, []))
        self.pool.incref(table)
        self._tables[child.request_id] = table
        child.block_hashes = list(parent.block_hashes)
        child.num_hashed_blocks = parent.num_hashed_blocks

    def free(self, request: Request) -> None:
        """Drop the request's reference to each of its blocks, tail first. Blocks that
        reach zero keep their cached contents until evicted."""
        table = self._tables.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))
