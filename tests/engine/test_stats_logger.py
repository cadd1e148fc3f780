"""The server's work in its log: one line per request added and finished, and a periodic line
of throughput, queues, KV use and prefix-cache hits while busy."""
from __future__ import annotations

import asyncio
import logging

from pagellm.config import EngineConfig
from pagellm.core.stats import EngineStats, KVCacheStats, PrefixCacheStats, SchedulerStats
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.stats_logger import StatsLogger
from pagellm.sampling_params import SamplingParams

IDLE = dict(prompt_tokens_computed=100, generation_tokens=50, num_running=0, num_waiting=0, num_preemptions=1,
            kv_cache_usage=0.0, prefix_cache_queries=200, prefix_cache_hits=50)


def stats(d: dict) -> EngineStats:
    return EngineStats(KVCacheStats(64, 0, 0, 16, d["kv_cache_usage"], []),
                       SchedulerStats(d["num_running"], d["num_waiting"], d["num_preemptions"], 0),
                       PrefixCacheStats(0, d["prefix_cache_queries"], d["prefix_cache_hits"]),
                       d["prompt_tokens_computed"], 0, d["generation_tokens"], 0, None, None)


def test_periodic_line_reports_rates_since_the_last(caplog):
    caplog.set_level(logging.INFO, logger="pagellm.stats")
    log = StatsLogger(interval=5.0)
    assert not log.maybe_log(stats(IDLE), now=0.0)  # the baseline
    busy = {**IDLE, "prompt_tokens_computed": 600, "generation_tokens": 250, "num_running": 3, "num_waiting": 2,
            "num_preemptions": 2, "kv_cache_usage": 0.25, "prefix_cache_queries": 400, "prefix_cache_hits": 150}
    assert not log.maybe_log(stats(busy), now=4.0)  # too soon
    assert log.maybe_log(stats(busy), now=10.0)
    line = caplog.records[-1].getMessage()
    assert "prompt throughput 50.0 tokens/s, generation throughput 20.0 tokens/s" in line
    assert "running 3, waiting 2, preemptions 1 (2 since start)" in line
    assert "KV cache 25.0% used" in line and "prefix cache hit rate 50.0%" in line
    assert not log.maybe_log(stats(busy | {"num_running": 0, "num_waiting": 0}), now=20.0)  # idle: nothing to say


def test_requests_are_logged_as_they_come_and_go(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="pagellm.requests")

    async def main():
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=32)))
        engine.start()
        try:
            async for _ in engine.generate("r-1", {"prompt_token_ids": [5, 6, 7]},
                                           SamplingParams(max_tokens=4, ignore_eos=True)):
                pass
        finally:
            await engine.shutdown()

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "pagellm.requests"]
    assert "request r-1 added: 3 prompt tokens, max_tokens 4, n 1" in lines
    assert any(line.startswith("request r-1 finished (length): 3 prompt tokens (0 cached), 4 generated")
               for line in lines), lines
