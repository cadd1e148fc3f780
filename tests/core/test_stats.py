"""The typed stats (core/stats.py): their wire form is the flat dict LLM.stats() returns, key for
key and in order, and a replica set's sum adds what adds and keeps the rest from the first."""
from __future__ import annotations

from pagellm.core.spec_decode import SpecDecodeStats
from pagellm.core.stats import (NO_ENGINE, EngineStats, KVCacheStats, KVGroupStats, KVOffloadStats, PrefixCacheStats,
                                SchedulerStats, TierMoveStats, TierStoreStats, summed)

STORE = TierStoreStats(path="/t/kv", blocks=3, pending_writes=0, capacity_blocks=9, block_bytes=64, hits=1, misses=2,
                       corrupt=0, dropped=0, write_errors=1, write_errors_by_cause={"ENOSPC": 1}, bytes_written=192,
                       bytes_read=64, persist=False)


def engine_stats(used: int, hits: int, usage: float = 0.5) -> EngineStats:
    groups = [KVGroupStats("full", None, used), KVGroupStats("state", None, 1, 4, 2)]
    return EngineStats(KVCacheStats(10, 10 - used, used, 16, usage, groups), SchedulerStats(2, 1, 3, 0),
                       PrefixCacheStats(1, 2 * hits, hits), 100, 120, 20, 0,
                       SpecDecodeStats(2, 6, 3, [2, 1], {1: 2}, {1: 0.01}), KVOffloadStats(STORE, TierMoveStats(5, 1, 0)),
                       request_failures={"step_error": 1}, max_model_len=512)


def test_to_dict_is_the_flat_dict_of_llm_stats():
    d = engine_stats(used=4, hits=7).to_dict()
    assert list(d) == ["total_blocks", "free_blocks", "used_blocks", "block_size", "kv_cache_usage", "kv_groups",
                       "num_running", "num_waiting", "num_preemptions", "num_swaps", "cached_blocks",
                       "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed", "tokens_computed",
                       "generation_tokens", "num_step_failures", "spec_decode", "kv_offload", "request_failures",
                       "max_model_len"]
    assert d["kv_groups"] == [{"kind": "full", "window": None, "used_blocks": 4},
                              {"kind": "state", "window": None, "used_blocks": 1, "checkpoints_taken": 4,
                               "checkpoints_restored": 2}]
    assert d["spec_decode"] == {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3,
                                "acceptance_rate": 0.5, "accepted_per_position": [2, 1],
                                "decode_steps_by_rows": {1: {"steps": 2, "mean_ms": 5.0}}}
    assert list(d["kv_offload"])[-4:] == ["persist", "demoted_blocks", "promoted_blocks", "swapped_out_requests"]
    assert d["kv_offload"]["write_errors_by_cause"] == {"ENOSPC": 1} and d["prefix_cache_hits"] == 7


def test_replicas_sum_what_adds_and_keep_the_first_for_the_rest():
    a, b = engine_stats(used=4, hits=7, usage=0.4), engine_stats(used=8, hits=1, usage=0.8)
    total = summed([a, b])
    assert (total.kv.total_blocks, total.kv.used_blocks, total.kv.usage) == (20, 12, 0.6)
    assert total.prefix_cache.hits == 8 and total.scheduler.num_running == 4 and total.generation_tokens == 40
    assert total.kv.groups == a.kv.groups and total.kv_offload is a.kv_offload and total.max_model_len == 512
    assert summed([]) is NO_ENGINE and NO_ENGINE.to_dict()["num_running"] == 0


def test_groups_are_named_by_what_all_their_layers_hold():
    from pagellm.core.kv.coordinator import KVCoordinator
    from pagellm.core.kv.groups import STATE, group_names, plan_kv_groups

    # Latent layers alone: one group, named latent; recurrent layers beside them keep "state".
    plan = plan_kv_groups([None, None, STATE, STATE], 64)
    assert group_names(plan, ["latent", "latent", None, None]) == ("latent", "state")
    # A group whose layers differ (chunked beside full attention, Llama 4) keeps its window kind.
    assert group_names(plan_kv_groups([None, None], 64), ["chunked", None]) == ("full",)
    assert group_names(plan_kv_groups([8, None], 64), [None, "chunked"]) == ("chunked", "sliding")
    kv = KVCoordinator(8, 4, plan.windows, state_blocks=1, group_names=("latent", "state"))
    assert [g.kind for g in kv.group_stats()] == ["latent", "state"]
    assert [g.kind for g in KVCoordinator(8, 4, (None, 8)).group_stats()] == ["full", "sliding"]
