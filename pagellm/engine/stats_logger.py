"""What a server says about its work, as vLLM's does: one line when a request arrives and when
it ends, and every few seconds while busy a line of throughput, queues, KV use and prefix hits."""
from __future__ import annotations

import logging
import time

from pagellm.core.stats import EngineStats
from pagellm.outputs import RequestOutput

request_logger = logging.getLogger("pagellm.requests")
stats_logger = logging.getLogger("pagellm.stats")


def log_added(request_id: str, num_prompt_tokens: int | None, max_tokens: int | None, n: int) -> None:
    request_logger.info("request %s added: %s prompt tokens, max_tokens %s, n %d", request_id,
                        "?" if num_prompt_tokens is None else num_prompt_tokens, max_tokens, n)


def log_finished(out: RequestOutput, now: float) -> None:
    reasons = ",".join(sorted({c.finish_reason or "?" for c in out.outputs})) or "none"
    request_logger.info("request %s finished (%s): %d prompt tokens (%d cached), %d generated, %.2f s",
                        out.request_id, reasons, len(out.prompt_token_ids), out.num_cached_tokens,
                        sum(len(c.token_ids) for c in out.outputs), now - out.metrics.arrival_time)


class StatsLogger:
    """Logs engine throughput every `interval` seconds, while there is anything to report."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last: tuple[float, EngineStats] | None = None

    def maybe_log(self, stats: EngineStats, now: float | None = None) -> bool:
        """Log a line if `interval` has passed since the last one and the engine did work or holds
        requests; True when it did."""
        now = time.monotonic() if now is None else now
        if self._last is None:
            self._last = (now, stats)
            return False
        then, before = self._last
        elapsed = now - then
        if elapsed < self.interval:
            return False
        prompt = stats.prompt_tokens_computed - before.prompt_tokens_computed
        generated = stats.generation_tokens - before.generation_tokens
        sched = stats.scheduler
        self._last = (now, stats)
        if not (prompt or generated or sched.num_running or sched.num_waiting):
            return False
        queries = stats.prefix_cache.queries - before.prefix_cache.queries
        hits = stats.prefix_cache.hits - before.prefix_cache.hits
        stats_logger.info(
            "prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s; running %d, waiting %d, "
            "preemptions %d (%d since start); KV cache %.1f%% used; prefix cache hit rate %s",
            prompt / elapsed, generated / elapsed, sched.num_running, sched.num_waiting,
            sched.num_preemptions - before.scheduler.num_preemptions, sched.num_preemptions,
            100 * stats.kv.usage, f"{100 * hits / queries:.1f}%" if queries else "-")
        return True
