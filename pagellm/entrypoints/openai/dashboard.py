"""The live KV block map: GET /dashboard (a self-contained page) and GET /dashboard/state (its data).

The page polls the state about once a second and draws every physical block, colored by the
request that holds it; the state is taken on the engine thread between two steps, so block
tables and reference counts are consistent with each other.
"""
from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI
from starlette.responses import HTMLResponse, JSONResponse

from pagellm.core.stats import EngineStats, KVOffloadStats
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai.metrics import ServerMetrics


def _snapshot(engine: LLMEngine) -> tuple[dict, EngineStats]:
    return engine.kv_snapshot(), engine.stats()


def cached_flags(snapshot: dict) -> list[int]:
    """Per block, 1 if it holds cached data but no request (reusable, evictable), else 0.

    The engine may mark them as a per-block list of flags or as a list of block ids.
    """
    n = snapshot["num_blocks"]
    cached = snapshot.get("cached")
    if not cached:
        return [0] * n
    ref = snapshot["ref_cnt"]
    if len(cached) == n and all(isinstance(x, bool) for x in cached):
        flags = [int(x) for x in cached]
    else:
        flags = [0] * n
        for b in cached:
            if 0 <= int(b) < n:
                flags[int(b)] = 1
    return [f if ref[i] == 0 else 0 for i, f in enumerate(flags)]


def _tier_state(tier: KVOffloadStats) -> dict:
    store, moves = tier.store, tier.moves
    return {"blocks": store.blocks, "capacity_blocks": store.capacity_blocks, "demoted_blocks": moves.demoted_blocks,
            "promoted_blocks": moves.promoted_blocks, "corrupt": store.corrupt, "bytes_written": store.bytes_written,
            "bytes_read": store.bytes_read}


def build_state(snapshot: dict, stats: EngineStats, metrics: ServerMetrics, model_name: str,
                num_unstarted: int) -> dict:
    queries, hits = stats.prefix_cache.queries, stats.prefix_cache.hits
    flags = cached_flags(snapshot)
    return {
        "model": model_name,
        "time": time.time(),
        "block_size": snapshot["block_size"],
        "num_blocks": snapshot["num_blocks"],
        "ref_cnt": snapshot["ref_cnt"],
        "cached": flags,
        "tables": snapshot["tables"],
        # Sequence id -> its user request: the n sequences of one request share a hue.
        "groups": snapshot.get("sequence_groups", {}),
        # Unfinished sequences (running, then the waiting queue in order) and the latest preemptions.
        "sequences": snapshot.get("sequences", []),
        "recent_preemptions": snapshot.get("recent_preemptions", []),
        "stats": {
            "total_blocks": stats.kv.total_blocks,
            "free_blocks": stats.kv.free_blocks,
            "used_blocks": stats.kv.used_blocks,
            "kv_cache_usage": stats.kv.usage,
            "kv_groups": [g.to_dict() for g in stats.kv.groups],
            "num_running": stats.scheduler.num_running,
            "num_waiting": stats.scheduler.num_waiting,
            "num_unstarted": num_unstarted,
            "num_preemptions": stats.scheduler.num_preemptions,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "cached_blocks": stats.prefix_cache.cached_blocks,
            "shared_blocks": sum(1 for r in snapshot["ref_cnt"] if r > 1),
            "max_model_len": stats.max_model_len,
            # The second tier, if any: blocks held and moved (--kv-offload-dir).
            "kv_offload": None if stats.kv_offload is None else _tier_state(stats.kv_offload),
        },
        "counters": {
            "prompt_tokens": metrics.total_prompt_tokens,
            "generation_tokens": metrics.total_generation_tokens,
            "finished_requests": metrics.total_finished,
        },
    }


def register(app: FastAPI, engine: AsyncLLMEngine, metrics: ServerMetrics, model_name: str) -> None:
    page = resources.files("pagellm.entrypoints.openai").joinpath("static/dashboard.html").read_text("utf-8")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/state")
    async def dashboard_state() -> JSONResponse:
        snapshot, stats = await engine.call(_snapshot)
        return JSONResponse(build_state(snapshot, stats, metrics, model_name, engine.num_unstarted),
                            headers={"Cache-Control": "no-store"})
