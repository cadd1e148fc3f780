"""Which engine replica serves a request: the policies of `--router-policy`.

The prefix cache pays only when requests that share a prefix reach the replica that holds it. The
cache-aware policy remembers, per replica, the chained block hashes of the prompts it sent there
(the prefix cache's own keys, core/kv/block_hash.py; bounded, least recently used first) and sends a
request to the replica that has seen the longest run of its leading blocks (at least half of them:
a shorter match, such as a chat template's header, says little), unless that replica is
overloaded against the least loaded one, which then gets it (as SGLang's cache-aware router does:
an absolute and a relative threshold on the load gap), or its KV cache is nearly full while the
least loaded one's is not (a request sent there would queue or preempt for blocks). A request no
replica has seen goes to the least loaded (ties: the one sent the fewest blocks). Load is the
router's own count of requests in flight on each replica (exact and immediate), then the KV usage
each replica last reported. The router is bookkeeping only: the replica set that owns the replicas calls `route`, `finished`, `remove` and
`report_kv_usage`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from pagellm.config import ROUTER_POLICIES
from pagellm.core.kv.block_hash import hash_block
from pagellm.core.stats import RouterStats
from pagellm.engine.async_engine import EngineDeadError


class NoReplicaError(EngineDeadError):
    """Every replica is out of rotation (the server answers 503, as for a dead engine)."""


class Router:
    def __init__(self, num_replicas: int, policy: str = "cache_aware", block_size: int = 16,
                 max_blocks_per_replica: int = 1 << 16, balance_abs: int = 4, balance_rel: float = 1.5,
                 kv_high: float = 0.9, kv_gap: float = 0.2, min_match: float = 0.5) -> None:
        """`balance_abs`, `balance_rel`: the best-matching replica is skipped when it has more than
        `balance_abs` requests in flight beyond the least loaded one and more than `balance_rel`
        times as many. `kv_high`, `kv_gap`: or when its KV usage is at least `kv_high` and the
        least loaded one's is lower by more than `kv_gap`. `min_match`: a match shorter than this
        share of the prompt's blocks does not count (a chat template's header, which every prompt
        starts with, would otherwise pull every request to the first replica that saw one)."""
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        self.policy = policy
        self.block_size = block_size
        self.max_blocks = max_blocks_per_replica
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.kv_high, self.kv_gap = kv_high, kv_gap
        self.min_match = min_match
        self.alive = list(range(num_replicas))
        self.in_flight = [0] * num_replicas
        self.kv_usage = [0.0] * num_replicas
        self._seen: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._next = 0
        self.num_routed = [0] * num_replicas
        self.num_prefix_routed = 0  # requests sent where their prefix was seen

    def route(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """The replica for a request with these prompt tokens; counts it in flight there."""
        if not self.alive:
            raise NoReplicaError("no engine replica is serving (all are out of rotation)")
        if self.policy == "round_robin":
            chosen = self.alive[self._next % len(self.alive)]
            self._next += 1
        elif self.policy == "least_loaded":
            chosen = self._least_loaded()
        else:
            chosen = self._cache_aware(token_ids, salt)
        self.in_flight[chosen] += 1
        self.num_routed[chosen] += 1
        return chosen

    def finished(self, replica: int) -> None:
        """A request routed to `replica` is done (finished, aborted or failed)."""
        self.in_flight[replica] = max(0, self.in_flight[replica] - 1)

    def report_kv_usage(self, replica: int, usage: float) -> None:
        """The fraction of its KV blocks a replica last reported in use."""
        self.kv_usage[replica] = usage

    def remove(self, replica: int) -> None:
        """Take a replica out of rotation (it died); what it had seen is forgotten."""
        if replica in self.alive:
            self.alive.remove(replica)
        self._seen[replica].clear()
        self.in_flight[replica] = 0

    def _least_loaded(self) -> int:
        # Ties (an idle pool: nothing in flight anywhere) go to the replica that has been sent the
        # fewest blocks, as SGLang's router picks the smallest tree: else at low load every new
        # prefix lands on replica 0, whose cache then holds them all while the others idle.
        return min(self.alive, key=lambda r: (self.in_flight[r], self.kv_usage[r], len(self._seen[r]), r))

    def _cache_aware(self, token_ids: Sequence[int], salt: str | None) -> int:
        hashes, parent = [], None
        for i in range(len(token_ids) // self.block_size):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size], salt)
            hashes.append(parent)
        least = self._least_loaded()
        best, match = least, 0
        for r in self.alive:
            seen = self._seen[r]
            n = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
            if n > match or (n == match and n > 0 and self.in_flight[r] < self.in_flight[best]):
                best, match = r, n
        gap = self.in_flight[best] - self.in_flight[least]
        overloaded = ((gap > self.balance_abs and self.in_flight[best] > self.balance_rel * self.in_flight[least])
                      or (self.kv_usage[best] >= self.kv_high
                          and self.kv_usage[least] < self.kv_usage[best] - self.kv_gap))
        by_prefix = match > 0 and match >= self.min_match * len(hashes) and not overloaded
        chosen = best if by_prefix else least
        self.num_prefix_routed += by_prefix
        seen = self._seen[chosen]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)
        return chosen

    def stats(self) -> RouterStats:
        return RouterStats(self.policy, list(self.alive), list(self.in_flight), list(self.kv_usage),
                           list(self.num_routed), self.num_prefix_routed)
