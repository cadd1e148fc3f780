"""KV managers: which physical blocks hold each request's tokens.

`interface.KVManager` is what the scheduler, the engine and the block map use; `coordinator`
is PagedAttention's manager for every model (one group of layers or several, with an optional
second tier: `tiered`), `contiguous` the one-region-a-request baselines it is measured against.
`make_kv_manager` picks one by policy name.
"""
from __future__ import annotations

from typing import Callable, Sequence

from pagellm.config import KV_POLICIES
from pagellm.core.kv.contiguous import ContiguousKVManager
from pagellm.core.kv.coordinator import KVCoordinator
from pagellm.core.kv.interface import KVManager
from pagellm.core.kv.tiered import BlockTier
from pagellm.core.request import Request

__all__ = ["KVManager", "KVCoordinator", "ContiguousKVManager", "make_kv_manager", "KV_POLICIES"]


def make_kv_manager(policy: str, num_blocks: int, block_size: int, max_model_len: int,
                    final_len: Callable[[Request], int] | None = None,
                    windows: Sequence[int | None | str] = (None,), max_chunk_tokens: int = 2048,
                    state_blocks: int = 0, tier: BlockTier | None = None, **paged_kwargs) -> KVManager:
    """The KV manager for an allocation policy, one of KV_POLICIES. `paged_kwargs` (e.g.
    enable_prefix_caching) go to the coordinator; `final_len` to the contiguous ones. `windows`:
    the KV groups' kinds (core/kv/groups.py), `state_blocks` the blocks a sequence's recurrent
    state takes; `tier`: a second tier behind the prefix cache (paged only)."""
    if policy == "paged":
        return KVCoordinator(num_blocks, block_size, windows, max_chunk_tokens=max_chunk_tokens,
                             state_blocks=state_blocks, tier=tier, **paged_kwargs)
    if tier is not None:
        raise ValueError(f"a second KV tier needs kv_policy 'paged', got {policy!r}")
    if policy.startswith("contiguous-") and policy in KV_POLICIES:
        return ContiguousKVManager(num_blocks, block_size, max_model_len, policy.removeprefix("contiguous-"),
                                   final_len=final_len)
    raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {policy!r}")
