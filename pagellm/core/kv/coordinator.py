"""The KV coordinator: every model's block tables over one block pool. A plain model is one group
of full-attention layers; a model with sliding-window or recurrent layers has one group per kind
(core/kv/groups.py plans them). Growth, prefix reuse, forking, copy-on-write, truncation and the
second tier's hook are written here once, for any number of groups.

A request keeps one table per group. Logical block i of an attention group holds tokens
i*block_size .. (i+1)*block_size - 1; the attention groups' tables have one length. All groups
draw blocks from one pool, and a block holds the K/V of one group's layers at a time (the runner's
KV tensors are shared by one layer of each group). Tables grow one block at a time, only when a
step is about to write past the last block.

Sliding groups: a token at position p reads only positions p - W + 1 .. p, so the blocks wholly
before the window of the next token to compute go back to the pool (or to the prefix cache's LRU,
if cached) and their entries point at NULL_BLOCK, a block that is never handed out and stays zero:
kernels that read a whole table under a mask read zeros there. A sliding request thus holds about
ceil(W / block_size) + 1 blocks per sliding group however long it runs. Only sliding tables hold
null entries; the null block is reserved only for models with more than plain full attention.

Recurrent groups (kind STATE): a sequence's table in such a group is `state_blocks` blocks from
its first step to its end, holding its layers' state (its bytes, layers/recurrent.py), overwritten
every step. A fork shares them by reference like any block, so the first step of either sequence
copies them (copy-on-write); preemption by recompute frees them and the recomputation starts from
zeros. Their tables are not positions.

State checkpoints (prefix caching for recurrent models): a cached prefix is only of use with the
recurrent state at its end. So prefill chunks end at block boundaries (`chunk_tokens`: the last
one is split at the prompt's last boundary), and when a step leaves a prompt's computed tokens at
a boundary, the state blocks are copied into `state_blocks` new blocks per state group, indexed by
the hash of the block the state follows (and the group and part). They are pinned until the copy
is handed to the runner, then left to the pool's LRU like any cached block: no request holds
them, and memory pressure evicts them first-cached first. A request whose prompt starts with k
cached blocks and a checkpoint after block k restores it (copied into its own state blocks) and
computes from token k * block_size. Where its cached attention blocks reach further than any
checkpoint (a shared system prompt ending mid-prompt), its prefill also stops there, leaving a
checkpoint for the prompts after it. Each checkpoint costs state_blocks blocks per state group.
A checkpoint's key says which tokens its state follows, so the second tier keeps it like any
cached block: evicted, it is demoted; a lookup brings back the latest one the prefix reaches.

Prefix caching: a group's cached blocks are found by the chained block hash qualified with the
group (group 0's key is the block hash itself); a prefix of k blocks is a hit only if every full
group holds all k and every sliding group holds the ones inside the window of the prefix's end.

The second tier (core/kv/tiered.py) hooks into the pool: an evicted cached block is demoted under
its group-qualified key, and a lookup that the pool misses asks the tier for exactly the blocks a
hit needs (full groups' blocks, sliding groups' blocks inside the window, the latest checkpoint the
prefix reaches) before the pool's answer. A request preempted by swapping sends its blocks there,
its last partial block and, with recurrent layers, its state as a checkpoint after exactly its
computed tokens: when it is admitted again, it resumes where it stopped.
"""
from __future__ import annotations

from typing import Sequence

from pagellm.core.block_pool import BlockPool
from pagellm.core.kv.block_hash import hash_block, request_block_hashes
from pagellm.core.kv.groups import STATE, kind_name
from pagellm.core.kv.interface import KVManager, cdiv
from pagellm.core.kv.tiered import BlockTier, TierHook, TierOp
from pagellm.core.request import Request
from pagellm.core.stats import KVGroupStats, TierMoveStats

# The block that released and skipped sliding-table entries point at; allocated at start, never freed.
NULL_BLOCK = 0
# A checkpoint's pool key: the block hash, the state group and the part (three lengths of key:
# 16 bytes for group 0's blocks, 17 for another group's, 18 for a checkpoint's).
CHECKPOINT_KEY_BYTES = 18


class KVCoordinator(KVManager):
    """Per-group block tables over one pool; sliding groups release what slid out; an optional
    second tier behind the pool's prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None | str] = (None,),
                 enable_prefix_caching: bool = True, max_chunk_tokens: int = 2048, state_blocks: int = 0,
                 tier: BlockTier | None = None, group_names: Sequence[str] | None = None) -> None:
        """`windows`: per group, None (full attention), its window W >= 1, or STATE (recurrent
        layers, whose state takes `state_blocks` blocks a sequence). `max_chunk_tokens`: the most
        tokens a sequence computes in one step (how far a sliding group's blocks reach). `tier`:
        a second tier that keeps evicted prefix-cache blocks. `group_names`: how stats name each
        group (groups.group_names: "latent" for latent rows, say); None: by window kind."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or any(w is not None and w != STATE and w < 1 for w in windows) or windows[0] == STATE:
            raise ValueError(f"windows must be a non-empty list of None, ints >= 1 or {STATE!r} (not first), "
                             f"got {windows}")
        if (STATE in windows) != (state_blocks > 0):
            raise ValueError(f"state_blocks must be > 0 exactly when a group is {STATE!r}, got {state_blocks}")
        self.windows = list(windows)
        if group_names is not None and len(group_names) != len(self.windows):
            raise ValueError(f"group_names must name each of the {len(self.windows)} groups, got {group_names}")
        self.group_names = list(group_names) if group_names is not None else [kind_name(w) for w in self.windows]
        # Anything but plain full attention reserves the null block (sliding tables point at it).
        self._reserves_null = any(w is not None for w in self.windows)
        if self._reserves_null and num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 with sliding windows (one is the null block), got {num_blocks}")
        if tier is not None and not enable_prefix_caching:
            raise ValueError("a second KV tier keeps prefix-cache blocks by their hash: it needs "
                             "enable_prefix_caching=True")
        self.block_size = block_size
        self.state_blocks = state_blocks
        self._state_groups = [g for g, w in enumerate(self.windows) if w == STATE]
        self._attention_groups = [g for g, w in enumerate(self.windows) if w != STATE]
        self._full_groups = [g for g, w in enumerate(self.windows) if w is None]
        self._sliding_groups = [g for g, w in enumerate(self.windows) if w is not None and w != STATE]
        self.enable_prefix_caching = enable_prefix_caching
        self.max_chunk_tokens = max_chunk_tokens
        # Checkpoint blocks whose copies are queued (taken or restored): held until take_copies.
        self._pinned: list[tuple[int, int]] = []
        # Per request, where cached attention blocks end beyond the last checkpoint: its prefill stops there.
        self._cuts: dict[str, int] = {}
        self.num_checkpoints = 0  # taken
        self.num_restores = 0  # prefix hits resumed from one
        self.pool = BlockPool(num_blocks)
        if self._reserves_null:
            (null,) = self.pool.allocate(1)
            assert null == NULL_BLOCK
        self.tier = None if tier is None else TierHook(tier, self.pool)
        if self.tier is not None:
            self.pool.on_evict = self._on_evict
        self._tables: dict[str, list[list[int]]] = {}
        # Blocks held per group, kept as blocks are taken and given back (stats read it every step).
        self._held = [0] * len(self.windows)
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold: the pool less the null block, if reserved."""
        return self.pool.num_blocks - self._reserves_null

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` holds at once, all groups together."""
        full = cdiv(num_tokens, self.block_size)
        return sum(full if w is None else self.state_blocks if w == STATE
                   else min(full, cdiv(w - 1 + self.max_chunk_tokens, self.block_size) + 1)
                   for w in self.windows)

    @staticmethod
    def _key(group: int, block_hash: bytes) -> bytes:
        return block_hash if group == 0 else block_hash + bytes([group])

    def _first_needed(self, group: int, position: int) -> int:
        """The first logical block a token at `position` reads in `group`."""
        w = self.windows[group]
        return 0 if w is None or w == STATE else max(0, position - w + 1) // self.block_size

    def _real(self, group: int, table: list[int]) -> list[int]:
        """The table's blocks without null entries (only sliding tables have them)."""
        return [b for b in table if b != NULL_BLOCK] if group in self._sliding_groups else table

    # ---- tables ----------------------------------------------------------------------------------
    def group_tables(self, request_id: str) -> tuple[list[int], ...]:
        tables = self._tables.get(request_id)
        return tuple(tables) if tables else tuple([] for _ in self.windows)

    def block_table(self, request_id: str) -> list[int]:
        """The first group's table (the runner reads every group's through group_tables)."""
        tables = self._tables.get(request_id)
        return tables[0] if tables else []

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables  # block_tables builds every request's flat list

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Every request's blocks, all groups, without the null entries."""
        return {rid: [b for g, t in enumerate(tables) for b in self._real(g, t)] for rid, tables in self._tables.items()}

    def ref_counts(self) -> list[int]:
        return list(self.pool.ref_cnt)

    def cached_flags(self) -> list[bool]:
        return [c == 0 and h is not None for c, h in zip(self.pool.ref_cnt, self.pool.block_hash)]

    def group_stats(self) -> list[KVGroupStats]:
        state = set(self._state_groups)
        return [KVGroupStats(name, None if w == STATE else w, n,
                             *((self.num_checkpoints, self.num_restores) if g in state else ()))
                for g, (name, w, n) in enumerate(zip(self.group_names, self.windows, self._held))]

    def snapshot(self) -> dict:
        """The block map's data, every pool block drawn (the null block among them, held)."""
        return {**super().snapshot(), "num_blocks": self.pool.num_blocks}

    def check_integrity(self) -> None:
        """Reference counts equal the tables' references (plus the coordinator's own on the null
        block and on pinned checkpoint blocks); no block appears twice in one table or in two
        groups; a request's attention tables have one length, its state tables state_blocks blocks;
        only sliding tables hold null entries; copies go to held blocks; and the pool's own
        invariants (free lists, hash index) hold."""
        self.pool.check_integrity()
        held = [0] * self.pool.num_blocks
        if self._reserves_null:
            held[NULL_BLOCK] = 1
        group_of: dict[int, int] = {}
        for rid, tables in self._tables.items():
            assert len(tables) == self.num_groups, f"{rid} has {len(tables)} tables for {self.num_groups} groups"
            lengths = [len(tables[g]) for g in self._attention_groups]
            assert len(set(lengths)) == 1, f"{rid}'s attention tables differ in length: {lengths}"
            assert all(len(tables[g]) in (0, self.state_blocks) for g in self._state_groups), \
                f"{rid}'s state tables are not {self.state_blocks} blocks: {[tables[g] for g in self._state_groups]}"
            for g, table in enumerate(tables):
                real = self._real(g, table)
                assert len(set(real)) == len(real), f"{rid}'s table of group {g} holds a block twice: {table}"
                if self._reserves_null and g not in self._sliding_groups:
                    assert NULL_BLOCK not in table, f"{rid}: a full-attention or state group's table has null entries"
                for b in real:
                    held[b] += 1
                    assert group_of.setdefault(b, g) == g, f"block {b} is held by groups {group_of[b]} and {g}"
        for g, b in self._pinned:
            held[b] += 1
            assert group_of.setdefault(b, g) == g, f"block {b} is held by groups {group_of[b]} and {g}"
        if self.pool.ref_cnt != held:  # compared in C; the message built only on failure
            wrong = [(b, c, h) for b, (c, h) in enumerate(zip(self.pool.ref_cnt, held)) if c != h]
            raise AssertionError(f"ref counts differ from the tables' references (block, ref_cnt, held): {wrong[:5]}")
        held_per_group = [0] * self.num_groups
        for g in group_of.values():
            held_per_group[g] += 1
        assert held_per_group == self._held, f"blocks held per group {self._held}, counted {held_per_group}"
        owned = set(group_of)
        assert all(dst in owned for _, dst in self.pending_copies), f"a copy into an unowned block: " \
            f"{self.pending_copies}"

    # ---- prefix caching ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """The longest cached prefix every group can serve: per group, its blocks (null before a
        sliding group's window; a state group's checkpoint to restore), and how many tokens they
        let the request skip (at least its last token is left to compute, so the first sampled
        token comes from a real forward pass). Takes no references (allocate_slots does); blocks
        promoted from the tier stay in the pool's index even if the request is not admitted now."""
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return [], 0
        bs, n = self.block_size, request.num_tokens
        hashes = request_block_hashes(request, bs, n // bs)
        if self.tier is not None:
            self._promote_prefix(request, hashes)
        blocks, computed = self._cached_prefix(request, hashes)
        if self.tier is not None:
            return self._promote_partial(request, hashes, blocks, computed)
        return blocks, computed

    def _cached_prefix(self, request: Request, hashes: list[bytes]) -> tuple[list[list[int]], int]:
        """get_computed_blocks from the pool's index alone."""
        bs, n = self.block_size, request.num_tokens
        k = len(hashes)
        if self._state_groups:  # the state must be restorable exactly where computing resumes
            k = min(k, (n - 1) // bs)
        lookup = self.pool.cached.get
        found: list[list[int | None]] = [[] for _ in self.windows]
        for g in self._full_groups:  # the longest chain every full group holds whole
            chain = found[g]
            for h in hashes[:k]:
                b = lookup(self._key(g, h))
                if b is None:
                    break
                chain.append(b)
            k = len(chain)
        # Per sliding group, run[i]: cached blocks in a row ending at block i.
        runs = {}
        for g in self._sliding_groups:
            found[g] = [lookup(self._key(g, h)) for h in hashes[:k]]
            run, r = [], 0
            for b in found[g]:
                r = r + 1 if b is not None else 0
                run.append(r)
            runs[g] = run

        def served(k: int, with_state: bool) -> bool:
            computed = min(k * bs, n - 1)
            return (all(runs[g][k - 1] >= k - self._first_needed(g, computed) for g in runs)
                    and (not with_state or all(self._checkpoint(g, hashes[k - 1]) for g in self._state_groups)))

        longest = next((j for j in range(k, 0, -1) if served(j, False)), 0)
        k = next((j for j in range(longest, 0, -1) if served(j, True)), 0) if self._state_groups else longest
        if k < longest:
            # The attention blocks reach further than any checkpoint: this request's prefill stops at
            # their end too (chunk_tokens), so that the next prompt sharing them finds a checkpoint there.
            self._cuts[request.request_id] = longest * bs
        if k == 0:
            return [], 0
        computed = min(k * bs, n - 1)
        blocks = []
        for g, w in enumerate(self.windows):
            if w == STATE:
                blocks.append(self._checkpoint(g, hashes[k - 1]))
            elif w is None:
                blocks.append(found[g][:k])
            else:
                first = self._first_needed(g, computed)
                blocks.append([NULL_BLOCK] * first + found[g][first:k])
        return blocks, computed

    def _checkpoint_key(self, group: int, block_hash: bytes, part: int) -> bytes:
        return block_hash + bytes([group, part])

    def _checkpoint(self, group: int, block_hash: bytes) -> list[int] | None:
        """The blocks of state group `group`'s checkpoint after the block hashed `block_hash`, if
        all are cached."""
        blocks = [self.pool.lookup(self._checkpoint_key(group, block_hash, j)) for j in range(self.state_blocks)]
        return None if None in blocks else blocks

    def chunk_tokens(self, request: Request, num_tokens: int) -> int:
        """With state checkpoints, a prefill chunk ends at a block boundary: the last one is cut at
        the last boundary before the final token, so that the prompt's state there is kept."""
        if not (self._state_groups and self.enable_prefix_caching) or num_tokens <= 1:
            return num_tokens
        bs, start = self.block_size, request.num_computed_tokens
        end = start + num_tokens
        if end == request.num_tokens:
            boundary = (end - 1) // bs * bs
        else:
            boundary = end // bs * bs
        cut = self._cuts.get(request.request_id, 0)
        if start < cut < boundary:
            boundary = cut
        return boundary - start if boundary > start else num_tokens

    def _take_checkpoint(self, request: Request, tables: list[list[int]], block_hash: bytes) -> None:
        """Copy the request's state blocks into new blocks indexed as the checkpoint after the
        block hashed `block_hash` (skipped when one exists or the pool lacks the blocks)."""
        if all(self._checkpoint(g, block_hash) for g in self._state_groups):
            return
        if len(self._state_groups) * self.state_blocks > self.pool.num_free_blocks:
            return
        for g in self._state_groups:
            for j, (src, dst) in enumerate(zip(tables[g], self._take(g, self.state_blocks))):
                self.pending_copies.append((src, dst))
                self.pool.cache(dst, self._checkpoint_key(g, block_hash, j))
                self._pinned.append((g, dst))
        self.num_checkpoints += 1

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued copies; the checkpoint blocks they read or write are released to the cache
        (the runner makes the copies before anything can reuse them)."""
        copies = super().take_copies()
        for g, b in self._pinned:
            self._give_back(g, [b])
        self._pinned = []
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Index, in every group, the blocks its computed tokens have filled (those still held)."""
        if not self.enable_prefix_caching:
            return
        tables = self._tables.get(request.request_id)
        if not tables:
            return
        full = min(request.num_computed_tokens // self.block_size, len(tables[0]))
        start = request.num_hashed_blocks
        if full <= start:
            return
        hashes = request_block_hashes(request, self.block_size, full)
        computed = request.num_computed_tokens
        if self._state_groups and computed % self.block_size == 0 and computed <= request.num_prompt_tokens:
            self._take_checkpoint(request, tables, hashes[full - 1])
        cache = self.pool.cache
        for g in self._attention_groups:
            table = tables[g]
            for i in range(start, full):
                if table[i] != NULL_BLOCK or not self._reserves_null:
                    cache(table[i], self._key(g, hashes[i]))
        request.num_hashed_blocks = full

    # ---- the second tier ------------------------------------------------------------------------------
    def _on_evict(self, block: int, key: bytes) -> None:
        self.tier.demote(block, key)

    def _hold_or_promote(self, group: int, block_hash: bytes, held: list[int]) -> int | None:
        """The pool's block for `group`'s block hashed `block_hash`, or one promoted from the tier
        into the pool's index; held (in `held`) so that later promotions do not evict it."""
        return self._hold_or_promote_key(self._key(group, block_hash), held)

    def _hold_or_promote_key(self, key: bytes, held: list[int], cache: bool = True) -> int | None:
        """The pool's block under `key`, or one promoted from the tier (indexed in the pool under
        `key` only if `cache`), held in `held`; None if neither has it."""
        b = self.pool.lookup(key)
        if b is None:
            b = self.tier.promote(key)
            if b is None:
                return None
            if cache:
                self.pool.cache(b, key)
        else:
            self.pool.incref([b])
        held.append(b)
        return b

    def _promote_prefix(self, request: Request, hashes: list[bytes]) -> None:
        """Bring back from the tier what a hit on the request's prefix needs and the pool lost: every
        full group's chain, then each sliding group's blocks inside the window of the chain's end."""
        bs, n = self.block_size, request.num_tokens
        k = len(hashes)
        if self._state_groups:
            k = min(k, (n - 1) // bs)
        held: list[int] = []
        try:
            for i in range(k):
                if any(self._hold_or_promote(g, hashes[i], held) is None for g in self._full_groups):
                    k = i
                    break
            computed = min(k * bs, n - 1)
            for g in self._sliding_groups:
                for i in range(self._first_needed(g, computed), k):
                    if self._hold_or_promote(g, hashes[i], held) is None:
                        break
            if self._state_groups:  # the latest checkpoint the chain reaches, whole or not at all
                for j in range(k, 0, -1):
                    if self._hold_checkpoint(hashes[j - 1], held):
                        break
        finally:
            self.pool.free(reversed(held))  # back to ref 0: free and cached, as the pool's hits are

    def _hold_checkpoint(self, state_hash: bytes, held: list[int], cache: bool = True) -> list[list[int]] | None:
        """Every state group's checkpoint after the tokens hashed `state_hash`, from the pool or
        promoted from the tier (indexed in the pool only if `cache`), held in `held`; None if a
        part is in neither (the parts found stay held: the caller frees `held`)."""
        out = []
        for g in self._state_groups:
            parts = []
            for j in range(self.state_blocks):
                b = self._hold_or_promote_key(self._checkpoint_key(g, state_hash, j), held, cache)
                if b is None:
                    return None
                parts.append(b)
            out.append(parts)
        return out

    def _promote_partial(self, request: Request, hashes: list[bytes], blocks: list[list[int]],
                         computed: int) -> tuple[list[list[int]], int]:
        """A request swapped out mid-block (swap_out) finds its last, partial block in the tier under
        the key of the tokens it held (all but the last, which was still to be computed), and with
        recurrent layers its state after those tokens, as a checkpoint under the same key."""
        bs, n = self.block_size, request.num_tokens
        k = (n - 1) // bs
        if not (n - 1) % bs:
            return blocks, computed
        # Group 0 is always an attention group: its table's length is the prefix's block count.
        attention = blocks if not self._state_groups else self._attention_chain(request, hashes, k)
        if attention is None or (len(attention[0]) if attention else 0) != k:
            return blocks, computed
        tokens = request.all_token_ids[k * bs:n - 1]
        partial = hash_block(hashes[k - 1] if k else None, tokens, request.cache_salt)
        held = [b for g, t in enumerate(attention) for b in self._real(g, t)]  # state groups' are empty
        self.pool.incref(held)  # the prefix's blocks, while promotions allocate
        got: list[int] = []
        state = None
        try:
            for g in self._attention_groups:
                b = self.tier.promote(self._key(g, partial))
                if b is None:
                    return blocks, computed
                got.append(b)
            if self._state_groups:
                state = self._hold_checkpoint(partial, got, cache=False)
                if state is None:
                    return blocks, computed
        finally:
            self.pool.free(reversed(held + got))  # promoted but not taken: plain free blocks again
        out = [list(t) for t in attention] if attention else [[] for _ in self.windows]
        for g, b in zip(self._attention_groups, got):
            out[g].append(b)
        for g, parts in zip(self._state_groups, state or ()):
            out[g] = parts
        for g in self._sliding_groups:  # the window of the last token moved on past the partial block's start
            first = self._first_needed(g, n - 1)
            out[g][:first] = [NULL_BLOCK] * first
        return out, n - 1

    def _attention_chain(self, request: Request, hashes: list[bytes], k: int) -> list[list[int]] | None:
        """Every attention group's first k blocks from the pool's index (a sliding group's inside
        the window of the request's last token, null before it), or None if one is missing."""
        lookup = self.pool.cached.get
        n = request.num_tokens
        out: list[list[int]] = [[] for _ in self.windows]
        for g in self._attention_groups:
            first = self._first_needed(g, n - 1) if g in self._sliding_groups else 0
            chain = [lookup(self._key(g, h)) for h in hashes[first:k]]
            if None in chain:
                return None
            out[g] = [NULL_BLOCK] * first + chain
        return out

    def swap_out(self, request: Request) -> bool:
        """Preemption by swapping (before `free`): every block the request has computed goes to
        the tier now, so that when it is admitted again get_computed_blocks brings all of its K/V
        back. A last block that is not full goes under hash_block of the tokens it holds: fewer
        than a full block's, so its key is never a full block's. Recurrent groups' state goes as
        the checkpoint after exactly those tokens (under the last full block's hash, or the
        partial block's)."""
        tables = self._tables.get(request.request_id)
        done = request.num_computed_tokens
        if self.tier is None or not tables or not done:
            return False
        bs = self.block_size
        hashes = request_block_hashes(request, bs, done // bs)
        partial = None
        if done % bs:
            tokens = request.all_token_ids[len(hashes) * bs:done]
            partial = hash_block(hashes[-1] if hashes else None, tokens, request.cache_salt)
        for g in self._attention_groups:
            table = tables[g]
            for i, h in enumerate(hashes):
                if table[i] != NULL_BLOCK or not self._reserves_null:
                    self.tier.demote(table[i], self._key(g, h))
            if partial is not None:
                self.tier.demote(table[len(hashes)], self._key(g, partial))
        state_hash = partial if partial is not None else hashes[-1]
        for g in self._state_groups:
            for j, b in enumerate(tables[g]):
                self.tier.demote(b, self._checkpoint_key(g, state_hash, j))
        self.tier.num_swapped_out += 1
        return True

    def take_tier_ops(self) -> list[TierOp]:
        return [] if self.tier is None else self.tier.take_ops()

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """(block, tier key) of every block the pool's prefix cache indexes now, checkpoints too."""
        if self.tier is None:
            return []
        return [(b, self.tier.tier_key(k)) for k, b in self.pool.cached.items()]

    def tier_stats(self) -> TierMoveStats | None:
        return None if self.tier is None else self.tier.stats()

    # ---- growth, sliding, sharing, release ------------------------------------------------------------
    def _take(self, group: int, n: int) -> list[int]:
        self._held[group] += n
        return self.pool.allocate(n)

    def _revive(self, group: int, blocks: list[int]) -> None:
        """One more reference to each block (a cached prefix, or a fork's)."""
        ref = self.pool.ref_cnt
        self._held[group] += sum(1 for b in blocks if ref[b] == 0)
        self.pool.incref(blocks)

    def _give_back(self, group: int, blocks: list[int]) -> None:
        """Drop a reference to each block (distinct blocks, in the order they are to be reused)."""
        self.pool.free(blocks)
        ref = self.pool.ref_cnt
        self._held[group] -= sum(1 for b in blocks if ref[b] == 0)

    def _release_slid_out(self, tables: list[list[int]], position: int) -> None:
        """Give back, in each sliding group, the blocks before the window of `position`."""
        for g in self._sliding_groups:
            table = tables[g]
            for i in range(min(self._first_needed(g, position), len(table))):
                if table[i] != NULL_BLOCK:
                    self._give_back(g, [table[i]])
                    table[i] = NULL_BLOCK

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[Sequence[int]] = ()) -> bool:
        """Room for the request's next `num_new_tokens` in every group (after `computed_blocks`,
        get_computed_blocks' per-group prefix, at admission). First gives back what slid out of
        the windows (a release that stands even when the rest fails: those blocks are never read
        again). Then all or nothing: False, changing nothing more, when the pool lacks blocks;
        shared blocks about to be written are copied first (copy-on-write, `pending_copies`)."""
        bs = self.block_size
        rid = request.request_id
        tables = self._tables.get(rid)
        start = request.num_computed_tokens
        end = start + num_new_tokens
        ref = self.pool.ref_cnt
        extra: set[int] = set()
        revived = 0
        if computed_blocks:
            assert tables is None, "a cached prefix is only taken at admission"
            # A state group's "blocks" are the checkpoint to restore: copied, never shared.
            tables = [[] if g in self._state_groups else list(t) for g, t in enumerate(computed_blocks)]
            extra = {b for g, t in enumerate(computed_blocks) for b in self._real(g, t)}
            revived = sum(1 for b in extra if ref[b] == 0)
        elif tables is None:
            tables = [[] for _ in self.windows]
        elif self._sliding_groups:
            self._release_slid_out(tables, start)
        end_block = cdiv(end, bs)
        first, last = start // bs, min(end_block, len(tables[0]))
        # Blocks this step writes that others share: its positions' in attention groups, all of a
        # state group's. (A cached prefix's blocks count one more reference: they are about to be taken.)
        if extra:
            shared = [(g, i) for g in self._attention_groups for i in range(first, last)
                      if ref[tables[g][i]] + (tables[g][i] in extra) > 1]
        else:
            shared = [(g, i) for g in self._attention_groups for i in range(first, last) if ref[tables[g][i]] > 1]
        new_state: list[int] = []
        if self._state_groups:
            for g in self._state_groups:
                shared += [(g, i) for i, b in enumerate(tables[g]) if ref[b] + (b in extra) > 1]
            new_state = [g for g in self._state_groups if not tables[g]]
        grow = max(0, end_block - len(tables[0]))
        need = revived + len(shared) + grow * len(self._attention_groups) + len(new_state) * self.state_blocks
        if need > self.pool.num_free_blocks:
            return False
        for g, table in enumerate(computed_blocks):
            self._revive(g, self._real(g, table))
        for g, i in shared:
            (new,) = self._take(g, 1)
            self.pending_copies.append((tables[g][i], new))
            self._give_back(g, [tables[g][i]])
            tables[g][i] = new
        if grow:
            for g in self._attention_groups:
                tables[g].extend(self._take(g, grow))
        for g in new_state:
            tables[g].extend(self._take(g, self.state_blocks))
            if computed_blocks:  # restore the checkpoint: pinned until the copy is handed out
                self.pending_copies.extend(zip(computed_blocks[g], tables[g]))
                self._pinned.extend((g, b) for b in computed_blocks[g])
        if computed_blocks and self._state_groups:
            self.num_restores += 1
        self._tables[rid] = tables
        return True

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Drop every attention group's blocks past the first `num_tokens` tokens, tail first (a
        sliding group's tail is inside its window: real blocks). They hold no computed full block
        (none was hashed), so they go back as plain free blocks. State groups are not positions and
        keep their blocks: the state in them is rolled back by the runner that wrote it (a target's
        from the states it traced while verifying, a draft model's from the ones it kept while drafting)."""
        tables = self._tables.get(request.request_id)
        if not tables:
            return
        keep = cdiv(num_tokens, self.block_size)
        for g in self._attention_groups:
            table = tables[g]
            if len(table) > keep:
                self._give_back(g, self._real(g, table[keep:][::-1]))
                del table[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of every group by reference: nothing is copied until one
        of them writes into a shared block."""
        tables = [list(t) for t in self._tables.get(parent.request_id, [[] for _ in self.windows])]
        for g, table in enumerate(tables):
            self._revive(g, self._real(g, table))
        self._tables[child.request_id] = tables
        child.block_hashes = list(parent.block_hashes)
        child.num_hashed_blocks = parent.num_hashed_blocks

    def free(self, request: Request) -> None:
        """Drop the request's reference to each of its blocks, each group's tail first. Blocks that
        reach zero keep their cached contents until evicted."""
        tables = self._tables.pop(request.request_id, None)
        self._cuts.pop(request.request_id, None)
        for g, table in enumerate(tables or ()):
            self._give_back(g, self._real(g, table[::-1]))
