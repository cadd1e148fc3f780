"""KV managers: which physical blocks hold each request's tokens.

`interface.KVManager` is what the scheduler, the engine and the block map use; `paged`
is PagedAttention's manager, `contiguous` the one-region-a-request baselines it is
measured against. `make_kv_manager` picks one by policy name.
"""
from __future__ import annotations

from typing import Callable, Sequence

from pagellm.config import KV_POLICIES
from pagellm.core.kv.contiguous import ContiguousKVManager
from pagellm.core.kv.hybrid import HybridKVManager
from pagellm.core.kv.interface import KVManager
from pagellm.core.kv.paged import KVCacheManager
from pagellm.core.request import Request

__all__ = ["KVManager", "KVCacheManager", "HybridKVManager", "ContiguousKVManager", "make_kv_manager", "KV_POLICIES"]


def make_kv_manager(policy: str, num_blocks: int, block_size: int, max_model_len: int,
                    final_len: Callable[[Request], int] | None = None,
                    windows: Sequence[int | None | str] = (None,), max_chunk_tokens: int = 2048,
                    state_blocks: int = 0, **paged_kwargs) -> KVManager:
    """The KV manager for an allocation policy, one of KV_POLICIES. `paged_kwargs` (e.g.
    enable_prefix_caching) go to the paged manager; `final_len` to the contiguous ones. `windows`:
    the KV groups' kinds (core/kv/groups.py); a sliding or recurrent one makes the paged manager
    hybrid, `state_blocks` being the blocks a sequence's recurrent state takes."""
    if policy == "paged":
        if any(w is not None for w in windows):
            return HybridKVManager(num_blocks, block_size, windows, max_chunk_tokens=max_chunk_tokens,
                                   state_blocks=state_blocks, **paged_kwargs)
        return KVCacheManager(num_blocks, block_size, **paged_kwargs)
    if policy.startswith("contiguous-") and policy in KV_POLICIES:
        return ContiguousKVManager(num_blocks, block_size, max_model_len, policy.removeprefix("contiguous-"),
                                   final_len=final_len)
    raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {policy!r}")
