"""The engine's stats as typed parts, each filled where its data lives (the KV coordinator, the
scheduler, the second tier, the engine) and read by attribute inside the package. `to_dict()` is
the wire form that `LLM.stats()`, /metrics and /dashboard/state are drawn from: its keys and their
order are a public interface (docs/python.md), so a new field is appended, never renamed."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from pagellm.core.spec_decode import SpecDecodeStats


@dataclass(frozen=True)
class KVGroupStats:
    """One group of layers sharing a cache kind (full, sliding, state; latent or chunked where
    every layer of the group is: core/kv/groups.group_names)."""

    kind: str
    window: int | None  # None: not sliding
    used_blocks: int
    # Recurrent-state groups only: prefix caching by state checkpoints.
    checkpoints_taken: int | None = None
    checkpoints_restored: int | None = None

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "window": self.window, "used_blocks": self.used_blocks}
        if self.checkpoints_taken is not None:
            d.update(checkpoints_taken=self.checkpoints_taken, checkpoints_restored=self.checkpoints_restored)
        return d


@dataclass(frozen=True)
class KVCacheStats:
    total_blocks: int
    free_blocks: int
    used_blocks: int
    block_size: int
    usage: float  # used over total, 1.0 full
    groups: list[KVGroupStats]


@dataclass(frozen=True)
class PrefixCacheStats:
    cached_blocks: int  # free blocks still holding reusable data
    queries: int
    hits: int


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_swaps: int


@dataclass(frozen=True)
class TierStoreStats:
    """The second tier's file (worker/kv_tier.py)."""

    path: str
    blocks: int
    pending_writes: int
    capacity_blocks: int
    block_bytes: int
    hits: int
    misses: int
    corrupt: int
    dropped: int
    write_errors: int
    write_errors_by_cause: dict[str, int]
    bytes_written: int
    bytes_read: int
    persist: bool


@dataclass(frozen=True)
class TierMoveStats:
    """Blocks moved between the pool and the second tier (core/kv/tiered.py)."""

    demoted_blocks: int
    promoted_blocks: int
    swapped_out_requests: int


@dataclass(frozen=True)
class KVOffloadStats:
    store: TierStoreStats
    moves: TierMoveStats | None

    def to_dict(self) -> dict:
        return {**asdict(self.store), **(asdict(self.moves) if self.moves is not None else {})}


@dataclass(frozen=True)
class RouterStats:
    policy: str
    alive: list[int]
    in_flight: list[int]
    kv_usage: list[float]
    routed: list[int]
    prefix_routed: int


@dataclass(frozen=True)
class ReplicaStats:
    replica: int
    alive: bool
    pid: int | None
    in_flight: int
    stats: EngineStats | None  # as of its last poll; None before the first, or once it died

    def to_dict(self) -> dict:
        return {"replica": self.replica, "alive": self.alive, "pid": self.pid, "in_flight": self.in_flight,
                "stats": None if self.stats is None else self.stats.to_dict()}


@dataclass(frozen=True)
class EngineStats:
    kv: KVCacheStats
    scheduler: SchedulerStats
    prefix_cache: PrefixCacheStats
    prompt_tokens_computed: int
    tokens_computed: int
    generation_tokens: int
    num_step_failures: int
    spec_decode: SpecDecodeStats | None  # None without --speculative-config
    kv_offload: KVOffloadStats | None  # None without --kv-offload-dir
    # Filled by LLMEngine: failed requests by cause.
    request_failures: dict[str, int] = field(default_factory=dict)
    max_model_len: int | None = None
    # Filled by AsyncLLMEngine: streams not yet started, and those aborted for a client not reading.
    num_unstarted: int | None = None
    num_stalled_streams: int | None = None
    # Filled by ReplicaSet (--data-parallel-size): each replica's own, and the router's.
    replicas: list[ReplicaStats] | None = None
    router: RouterStats | None = None

    def to_dict(self) -> dict:
        """The wire form: the flat dict `LLM.stats()` has always returned (the keys of the layers
        above the engine only where they filled them)."""
        kv, sched, prefix = self.kv, self.scheduler, self.prefix_cache
        d = {
            "total_blocks": kv.total_blocks,
            "free_blocks": kv.free_blocks,
            "used_blocks": kv.used_blocks,
            "block_size": kv.block_size,
            "kv_cache_usage": kv.usage,
            "kv_groups": [g.to_dict() for g in kv.groups],
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "num_preemptions": sched.num_preemptions,
            "num_swaps": sched.num_swaps,
            "cached_blocks": prefix.cached_blocks,
            "prefix_cache_queries": prefix.queries,
            "prefix_cache_hits": prefix.hits,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "tokens_computed": self.tokens_computed,
            "generation_tokens": self.generation_tokens,
            "num_step_failures": self.num_step_failures,
            "spec_decode": None if self.spec_decode is None else self.spec_decode.as_dict(),
            "kv_offload": None if self.kv_offload is None else self.kv_offload.to_dict(),
            "request_failures": dict(self.request_failures),
            "max_model_len": self.max_model_len,
        }
        if self.num_unstarted is not None:
            d["num_unstarted"] = self.num_unstarted
        if self.num_stalled_streams is not None:
            d["num_stalled_streams"] = self.num_stalled_streams
        if self.replicas is not None:
            d["replicas"] = [r.to_dict() for r in self.replicas]
        if self.router is not None:
            d["router"] = asdict(self.router)
        return d


# No engine at all (every replica dead): nothing held, nothing counted.
NO_ENGINE = EngineStats(KVCacheStats(0, 0, 0, 0, 0.0, []), SchedulerStats(0, 0, 0, 0), PrefixCacheStats(0, 0, 0),
                        0, 0, 0, 0, None, None)


def _added(parts: list) -> object:
    """Dataclasses of counts, added field by field."""
    return type(parts[0])(*(sum(getattr(p, f.name) for p in parts) for f in fields(parts[0])))


def summed(parts: list[EngineStats]) -> EngineStats:
    """Several engines' stats as one: counts and blocks added, KV usage over the blocks of all;
    what does not add (block size, groups, second tier, spec decode, failures by cause) is the
    first one's."""
    if not parts:
        return NO_ENGINE
    first = parts[0]
    used, blocks = sum(p.kv.used_blocks for p in parts), sum(p.kv.total_blocks for p in parts)
    return replace(
        first,
        kv=replace(first.kv, total_blocks=blocks, free_blocks=sum(p.kv.free_blocks for p in parts), used_blocks=used,
                   usage=used / blocks if blocks else first.kv.usage),
        scheduler=_added([p.scheduler for p in parts]),
        prefix_cache=_added([p.prefix_cache for p in parts]),
        prompt_tokens_computed=sum(p.prompt_tokens_computed for p in parts),
        tokens_computed=sum(p.tokens_computed for p in parts),
        generation_tokens=sum(p.generation_tokens for p in parts),
        num_step_failures=sum(p.num_step_failures for p in parts),
        num_unstarted=None if first.num_unstarted is None else sum(p.num_unstarted or 0 for p in parts))
