"""Contiguous-reservation KV allocators: the baselines PagedAttention is measured against.

Before paging, a serving system (Orca, FasterTransformer) stored each request's KV cache
in one contiguous region reserved when the request was admitted, sized for the longest
the request could become. These allocators do that over the same pool of slots the paged
manager uses, so the two can be swapped in the scheduler and the engine and compared at
one KV budget:

- `max`: reserve `max_model_len` tokens per request (Orca (Max) in the PagedAttention paper).
- `pow2`: reserve the prompt plus the final output length rounded up to a power of two,
  so outputs are over-reserved by at most 2x (Orca (Pow2)).
- `oracle`: reserve exactly the final length, known in advance (Orca (Oracle)).

The final length: by default `len(prompt) + sampling_params.max_tokens`, capped at
`max_model_len`. The benchmarks set `max_tokens` to each request's true output length
with `ignore_eos=True`, so this is exact there; a request without `max_tokens` reserves
`max_model_len`. Pass `final_len=` to supply another oracle.

Granularity: a region is a run of whole blocks with consecutive ids, so the model runner's
slot mapping (`block_id * block_size + offset`) turns it into consecutive slots and the
engine runs on it unchanged. With `block_size=1` a region is exactly token-granular. The
free space is a list of extents in address order; allocation is first-fit (the lowest
address extent that is large enough), and freeing coalesces a region with free neighbours.
A request that fits in the total free space but in no single extent waits: that is the
external fragmentation paging removes.
"""
from __future__ import annotations

import bisect
from typing import Callable, Sequence

from pagellm.core.kv.interface import KVManager
from pagellm.core.request import Request


class ExtentPool:
    """Blocks 0..num_blocks-1 as one address range; hands out contiguous runs first-fit.

    Invariants: free extents are sorted, pairwise disjoint, never adjacent (freeing merges
    neighbours) and never overlap an allocated run; `num_free_blocks + num_used_blocks ==
    num_blocks`.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._starts: list[int] = [0]
        self._lens: list[int] = [num_blocks]
        self._num_free = num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def ref_cnt(self) -> list[int]:
        """1 for an allocated block, 0 for a free one (built on demand: O(num_blocks))."""
        out = [1] * self.num_blocks
        for start, length in zip(self._starts, self._lens):
            out[start:start + length] = [0] * length
        return out

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant of the class docstring is broken."""
        ends = [s + n for s, n in zip(self._starts, self._lens)]
        assert all(n > 0 for n in self._lens), "an empty free extent"
        assert all(e < s for e, s in zip(ends, self._starts[1:])), \
            f"free extents unsorted, overlapping or adjacent: {self.free_extents}"
        assert not self._starts or (self._starts[0] >= 0 and ends[-1] <= self.num_blocks), "an extent out of range"
        assert sum(self._lens) == self._num_free, f"{self._num_free} free counted, {sum(self._lens)} in extents"

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """(start, length) of every free run, in address order."""
        return list(zip(self._starts, self._lens))

    @property
    def largest_free_extent(self) -> int:
        return max(self._lens, default=0)

    def is_free(self, block_id: int) -> bool:
        i = bisect.bisect_right(self._starts, block_id) - 1
        return i >= 0 and block_id < self._starts[i] + self._lens[i]

    def allocate(self, n: int) -> int | None:
        """First-fit: the start of a run of n free blocks at the lowest address, or None."""
        assert n >= 1
        for i, length in enumerate(self._lens):
            if length >= n:
                return self._cut(i, n)
        return None

    def extend(self, start: int, length: int, extra: int) -> bool:
        """Grow the run [start, start+length) in place by `extra` blocks if they are free."""
        end = start + length
        i = bisect.bisect_left(self._starts, end)
        if i == len(self._starts) or self._starts[i] != end or self._lens[i] < extra:
            return False
        self._cut(i, extra)
        return True

    def free(self, start: int, n: int) -> None:
        """Return the run [start, start+n) and merge it with free neighbours."""
        i = bisect.bisect_left(self._starts, start)
        # The run must not overlap the free extents on either side of it (a double free).
        assert 0 <= start and start + n <= self.num_blocks, f"blocks {start}..{start + n - 1} out of range"
        assert i == 0 or self._starts[i - 1] + self._lens[i - 1] <= start, f"double free of block {start}"
        assert i == len(self._starts) or start + n <= self._starts[i], f"double free of block {start + n - 1}"
        self._num_free += n
        merge_prev = i > 0 and self._starts[i - 1] + self._lens[i - 1] == start
        merge_next = i < len(self._starts) and self._starts[i] == start + n
        if merge_prev and merge_next:
            self._lens[i - 1] += n + self._lens[i]
            del self._starts[i], self._lens[i]
        elif merge_prev:
            self._lens[i - 1] += n
        elif merge_next:
            self._starts[i] = start
            self._lens[i] += n
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, n)

    def _cut(self, i: int, n: int) -> int:
        """Take the first n blocks of free extent i; returns where they start."""
        start = self._starts[i]
        if self._lens[i] == n:
            del self._starts[i], self._lens[i]
        else:
            self._starts[i] += n
            self._lens[i] -= n
        self._num_free -= n
        return start


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class ContiguousKVManager(KVManager):
    """Per-request contiguous reservations, behind the same interface as the paged manager.

    `allocate_slots` reserves the whole region when a request is first scheduled (all or
    nothing, like the paged manager) and afterwards only checks that the step fits in it.
    Should a request outgrow its reservation (an oracle that guessed short), the region
    is extended in place when the next blocks are free, else the call fails and the
    scheduler preempts; the next reservation then covers at least what the request holds.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, policy: str = "max",
                 final_len: Callable[[Request], int] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if policy not in ("max", "pow2", "oracle"):
            raise ValueError(f"policy must be one of 'max', 'pow2', 'oracle', got {policy!r}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.policy = policy
        self.pool = ExtentPool(num_blocks)
        self._final_len = final_len or self.known_final_len
        # request_id -> [first block, reserved blocks, blocks holding computed or scheduled tokens]
        self._regions: dict[str, list[int]] = {}
        # (src, dst) block copies for the runner, as the paged manager queues them.
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = self.prefix_hits = 0  # no prefix cache: always zero

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Every request's whole reserved region, as block ids (what a block map draws)."""
        return {rid: list(range(s, s + n)) for rid, (s, n, _) in self._regions.items()}

    def ref_counts(self) -> list[int]:
        """1 for a block in a reserved region, 0 for a free one: nothing is shared."""
        return self.pool.ref_cnt

    def check_integrity(self) -> None:
        """The free extents' invariants; reserved regions are disjoint, inside the pool, never
        overlap a free extent, and with the free blocks account for every block."""
        self.pool.check_integrity()
        regions = sorted((s, n) for s, n, _ in self._regions.values())
        for (s, n), (s2, _) in zip(regions, regions[1:]):
            assert s + n <= s2, f"reserved regions overlap: {(s, n)} and the one at {s2}"
        for rid, (s, n, used) in self._regions.items():
            assert 0 < used <= n or used == 0, f"{rid} uses {used} of {n} reserved blocks"
            assert not any(self.pool.is_free(b) for b in (s, s + n - 1)), f"{rid}'s region overlaps free space"
        reserved = sum(n for _, n in regions)
        assert reserved + self.pool.num_free_blocks == self.num_blocks, \
            f"{reserved} reserved + {self.pool.num_free_blocks} free != {self.num_blocks} blocks"

    def known_final_len(self, request: Request) -> int:
        """prompt + max_tokens, capped at max_model_len; max_model_len with no max_tokens."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            return self.max_model_len
        return min(request.num_prompt_tokens + max_tokens, self.max_model_len)

    def reservation_tokens(self, request: Request) -> int:
        """How many token slots the policy reserves for the request."""
        if self.policy == "max":
            return self.max_model_len
        final = self._final_len(request)
        if self.policy == "oracle":
            return final
        out = max(1, final - request.num_prompt_tokens)
        return min(request.num_prompt_tokens + next_pow2(out), self.max_model_len)

    def reserved_slots(self, request_id: str) -> int:
        region = self._regions.get(request_id)
        return region[1] * self.block_size if region else 0

    def block_table(self, request_id: str) -> list[int]:
        """The blocks of the region that hold the request's computed and scheduled tokens."""
        region = self._regions.get(request_id)
        if region is None:
            return []
        start, _, used = region
        return list(range(start, start + used))

    # ---- the paged manager's prefix-caching hooks: no sharing in a contiguous layout -------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        return [], 0

    def cache_full_blocks(self, request: Request) -> None:
        pass

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` a region of its own and copy the parent's computed blocks into
        it: without paging a sibling shares nothing. Raises when no region fits, as
        the scheduler expects a fork to succeed."""
        start, n, used = self._regions[parent.request_id]
        new = self.pool.allocate(n)
        if new is None:
            raise RuntimeError(f"no contiguous region of {n} KV blocks is free to fork {parent.request_id!r}")
        self._regions[child.request_id] = [new, n, used]
        self.pending_copies.extend((start + i, new + i) for i in range(used))

    # ---- growth and release ------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for the next `num_new_tokens` of `request`; all or nothing.
        `computed_blocks` (a cached prefix) is always empty here."""
        assert not computed_blocks, "contiguous reservations share no cached prefix"
        need = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        region = self._regions.get(request.request_id)
        if region is None:
            tokens = max(self.reservation_tokens(request), request.num_computed_tokens + num_new_tokens)
            n = self.blocks_for(tokens)
            start = self.pool.allocate(n)
            if start is None:
                return False
            region = self._regions[request.request_id] = [start, n, 0]
        start, n, used = region
        if need > n:
            if not self.pool.extend(start, n, need - n):
                return False
            region[1] = n = need
        region[2] = max(used, need)
        return True

    def free(self, request: Request) -> None:
        region = self._regions.pop(request.request_id, None)
        if region is not None:
            self.pool.free(region[0], region[1])

