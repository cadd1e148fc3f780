"""Prometheus metrics, named `pagellm:*` after vLLM's `vllm:*` ones, in a registry of their own.

Gauges and the engine's cumulative counters (preemptions, prefix cache) are read from the
engine's last published stats at scrape time; token counters and latency histograms are
fed by the engine thread after each step (`ServerMetrics` is the async engine's observer).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from pagellm.core.stats import NO_ENGINE, EngineStats
from pagellm.engine.async_engine import max_new_tokens, num_sequences
from pagellm.outputs import RequestOutput

# vLLM's buckets.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


# Request-level time histograms (queue, prefill, decode, inference) use vLLM's latency buckets.
REQUEST_TIME_BUCKETS = E2E_BUCKETS
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]


def one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


def powers_of_two(limit: int) -> list[float]:
    """1, 8, 16, 32, ... up to `limit` (vLLM's buckets for tokens per step)."""
    out, b = [1.0], 8
    while b <= limit:
        out.append(float(b))
        b *= 2
    return out


@dataclass
class _Progress:
    arrival_time: float
    tokens: int = 0
    last_token_time: float = 0.0  # 0.0: no output yet


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's stats when Prometheus scrapes."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        labels = [self.model_name]

        def family(kind, name: str, doc: str, value: float):
            f = kind(name, doc, labels=["model_name"])
            f.add_metric(labels, value)
            return f

        yield family(GaugeMetricFamily, "pagellm:num_requests_running", "Number of requests in the running batch.",
                     s.scheduler.num_running)
        yield family(GaugeMetricFamily, "pagellm:num_requests_waiting", "Number of requests waiting to be scheduled.",
                     s.scheduler.num_waiting)
        yield family(GaugeMetricFamily, "pagellm:kv_cache_usage_perc",
                     "Fraction of KV cache blocks in use (1 means 100 percent).", s.kv.usage)
        yield family(GaugeMetricFamily, "pagellm:kv_cache_total_blocks", "Number of physical KV cache blocks.",
                     s.kv.total_blocks)
        yield family(GaugeMetricFamily, "pagellm:kv_cache_free_blocks", "Number of free KV cache blocks.",
                     s.kv.free_blocks)
        groups = GaugeMetricFamily("pagellm:kv_cache_group_used_blocks",
                                   "KV blocks held per group of layers (kind: full, sliding, state (the "
                                   "recurrent layers' per-sequence state), latent (one latent row per token "
                                   "read by every head) or chunked; window: none, else the sliding window; a "
                                   "block holds one group's layers).",
                                   labels=["model_name", "group", "kind", "window"])
        for g, group in enumerate(s.kv.groups):
            window = "none" if group.window is None else str(group.window)
            groups.add_metric(labels + [str(g), group.kind, window], group.used_blocks)
        yield groups
        state = next((g for g in s.kv.groups if g.kind == "state"), None)
        if state is not None:  # recurrent models: prefix caching by state checkpoints (core/kv/coordinator.py)
            yield family(CounterMetricFamily, "pagellm:state_checkpoints_taken",
                         "State checkpoints taken at block boundaries of prompts.", state.checkpoints_taken)
            yield family(CounterMetricFamily, "pagellm:state_checkpoints_restored",
                         "Prefix-cache hits resumed from a state checkpoint.", state.checkpoints_restored)
        spec = s.spec_decode
        if spec is not None:  # --speculative-config: vLLM's spec_decode_* counters
            for name, key, doc in (("spec_decode_num_drafts", "num_drafts", "Proposals verified (one per sequence "
                                                                            "and step)."),
                                   ("spec_decode_num_draft_tokens", "num_draft_tokens", "Proposed tokens verified."),
                                   ("spec_decode_num_accepted_tokens", "num_accepted_tokens",
                                    "Proposed tokens accepted.")):
                yield family(CounterMetricFamily, f"pagellm:{name}", doc, getattr(spec, key))
            per_pos = CounterMetricFamily("pagellm:spec_decode_num_accepted_tokens_per_pos",
                                          "Proposed tokens accepted, by their position in the proposal.",
                                          labels=["model_name", "position"])
            for position, count in enumerate(spec.accepted_per_position):
                per_pos.add_metric(labels + [str(position)], count)
            yield per_pos
            steps = SummaryMetricFamily("pagellm:spec_decode_step_seconds",
                                        "Steps that only decoded (each sequence its token and the proposals it "
                                        "verifies), by their rows: what a verified row costs.",
                                        labels=["model_name", "rows"])
            for rows, count in sorted(spec.decode_steps_by_rows.items()):
                steps.add_metric(labels + [str(rows)], count, spec.decode_seconds_by_rows[rows])
            yield steps
        yield family(CounterMetricFamily, "pagellm:num_preemptions", "Cumulative number of preemptions.",
                     s.scheduler.num_preemptions)
        yield family(CounterMetricFamily, "pagellm:prefix_cache_queries",
                     "Prefix cache queries (as the engine counts them).", s.prefix_cache.queries)
        yield family(CounterMetricFamily, "pagellm:prefix_cache_hits",
                     "Prefix cache hits (as the engine counts them).", s.prefix_cache.hits)
        replicas = s.replicas
        if replicas is not None:  # --data-parallel-size: each replica's own, beside the totals above
            per = {name: GaugeMetricFamily(f"pagellm:replica_{name}", doc, labels=["model_name", "replica"])
                   for name, doc in (("up", "1 while the engine replica serves, 0 once it died."),
                                     ("requests_in_flight", "Requests the router has routed to the replica and not "
                                                            "seen finish."),
                                     ("num_requests_running", "Requests in the replica's running batch."),
                                     ("num_requests_waiting", "Requests waiting in the replica's queue."),
                                     ("kv_cache_usage_perc", "Fraction of the replica's KV cache blocks in use."),
                                     ("prefix_cache_hits", "The replica's prefix cache hits (tokens)."))}
            routed_counts = s.router.routed  # ReplicaSet.stats() gives both
            routed = CounterMetricFamily("pagellm:replica_requests_routed", "Requests the router sent to the "
                                         "replica (retries included).", labels=["model_name", "replica"])
            for r in replicas:
                label = labels + [str(r.replica)]
                routed.add_metric(label, routed_counts[r.replica])
                st = r.stats or NO_ENGINE
                per["up"].add_metric(label, 1 if r.alive else 0)
                per["requests_in_flight"].add_metric(label, r.in_flight)
                per["num_requests_running"].add_metric(label, st.scheduler.num_running)
                per["num_requests_waiting"].add_metric(label, st.scheduler.num_waiting)
                per["kv_cache_usage_perc"].add_metric(label, st.kv.usage)
                per["prefix_cache_hits"].add_metric(label, st.prefix_cache.hits)
            yield from per.values()
            yield routed
            yield family(CounterMetricFamily, "pagellm:router_prefix_routed",
                         "Requests the cache-aware router sent to a replica that had seen their prefix.",
                         s.router.prefix_routed)
        if s.kv_offload is not None:  # the prefix cache's second tier (--kv-offload-dir)
            store, moves = s.kv_offload.store, s.kv_offload.moves
            yield family(GaugeMetricFamily, "pagellm:kv_offload_blocks", "KV blocks held by the second tier.",
                         store.blocks)
            yield family(GaugeMetricFamily, "pagellm:kv_offload_capacity_blocks",
                         "KV blocks the second tier can hold.", store.capacity_blocks)
            for name, value, doc in (
                    ("kv_offload_demoted_blocks", moves.demoted_blocks,
                     "Blocks evicted from the pool to the second tier."),
                    ("kv_offload_promoted_blocks", moves.promoted_blocks,
                     "Blocks brought back from the second tier on a prefix hit instead of recomputed."),
                    ("kv_offload_misses", store.misses, "Second-tier lookups that found nothing usable."),
                    ("kv_offload_corrupt_entries", store.corrupt,
                     "Second-tier entries refused on load (checksum, key or model fingerprint wrong, file cut short)."),
                    ("kv_offload_bytes_written", store.bytes_written, "Bytes written to the second tier."),
                    ("kv_offload_bytes_read", store.bytes_read, "Bytes read back from the second tier.")):
                yield family(CounterMetricFamily, f"pagellm:{name}", doc, value)
            yield family(CounterMetricFamily, "pagellm:kv_offload_dropped_blocks",
                         "Blocks the second tier skipped because its writer was too far behind.", store.dropped)
            write_errors = CounterMetricFamily("pagellm:kv_offload_write_errors",
                                               "Blocks the second tier failed to write and skipped, by cause (the "
                                               "errno name: ENOSPC the volume full, EROFS read-only, EIO, ...); "
                                               "serving goes on without them.", labels=["model_name", "cause"])
            for cause, count in sorted(store.write_errors_by_cause.items()):
                write_errors.add_metric(labels + [cause], count)
            yield write_errors
        yield family(CounterMetricFamily, "pagellm:stalled_streams",
                     "Streamed requests aborted because their client stopped reading (--max-stream-buffer).",
                     s.num_stalled_streams or 0)
        yield family(CounterMetricFamily, "pagellm:engine_step_failures",
                     "Engine steps whose batch raised; the requests that caused it failed, the others carried on.",
                     s.num_step_failures)
        failures = CounterMetricFamily("pagellm:request_failures",
                                       "Requests that failed while generating, by cause (step_error: raised in "
                                       "the forward pass or sampling when run alone; non_finite_logits; "
                                       "no_token_allowed; grammar_error: a token the structured-output grammar "
                                       "rejected; "
                                       "output_error: detokenizing or formatting).",
                                       labels=["model_name", "cause"])
        for cause, count in sorted(s.request_failures.items()):
            failures.add_metric(labels + [cause], count)
        yield failures


class ServerMetrics:
    """The server's registry, and the engine observer that feeds it."""

    def __init__(self, model_name: str, max_model_len: int = 4096, max_num_batched_tokens: int = 2048,
                 cache_info: dict | None = None, model_cost: dict | None = None) -> None:
        # No `*_created` series: like vLLM, which turns them off too (the switch is process-wide).
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._stats: Callable[[], EngineStats] = lambda: NO_ENGINE
        self.registry.register(_EngineCollector(model_name, lambda: self._stats()))
        reg, name = self.registry, ["model_name"]
        self.prompt_tokens = Counter("pagellm:prompt_tokens", "Number of prefill tokens processed.", name,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("pagellm:generation_tokens", "Number of generation tokens processed.",
                                         name, registry=reg).labels(model_name)
        self.api_requests = Counter("pagellm:api_requests", "HTTP requests by the client API they were sent to "
                                    "(openai_chat, responses, anthropic_messages, ollama_chat, ...) and the status "
                                    "answered.", name + ["api", "status"], registry=reg)
        self.request_success = Counter("pagellm:request_success", "Count of finished requests by finish reason.",
                                       name + ["finished_reason"], registry=reg)
        self.ttft = Histogram("pagellm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              name, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("pagellm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             name, buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("pagellm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", name, buckets=E2E_BUCKETS,
                             registry=reg).labels(model_name)
        tokens = one_two_five(max_model_len)

        def histogram(metric: str, doc: str, buckets: list[float]):
            return Histogram(metric, doc, name, buckets=buckets, registry=reg).labels(model_name)

        self.request_prompt_tokens = histogram("pagellm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram("pagellm:request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.request_max_generation_tokens = histogram(
            "pagellm:request_max_num_generation_tokens",
            "Histogram of the most tokens one sequence of a request generated (the longest of its n).", tokens)
        self.request_prefill_kv_computed = histogram(
            "pagellm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding the prefix cache's).", tokens)
        self.params_n = histogram("pagellm:request_params_n", "Histogram of the n request parameter.",
                                  PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("pagellm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.iteration_tokens = histogram("pagellm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          powers_of_two(max(max_num_batched_tokens, 8)))
        self.queue_time = histogram("pagellm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_TIME_BUCKETS)
        self.inference_time = histogram("pagellm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("pagellm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("pagellm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_TIME_BUCKETS)
        self.request_tpot = histogram("pagellm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS)
        info = Gauge("pagellm:cache_config_info", "Information of the LLMEngine's KV cache configuration.",
                     sorted((cache_info or {}).keys()), registry=reg)
        if cache_info:
            info.labels(**{k: str(v) for k, v in cache_info.items()}).set(1)
        # The roofline's numerators: with iteration_tokens_total's count (steps) and sum (tokens)
        # they give the GFLOP/s and weight GB/s a load achieved.
        for key, doc in (("flops_per_token", "FLOPs one computed token costs the model's linear layers and head "
                                             "(2 x their multiply-adds)."),
                         ("weight_bytes_per_step", "Bytes of weights one engine step of one token streams (linear "
                                                   "layers and head, in their stored form; of experts, its top-k)."),
                         ("expert_weight_bytes", "Bytes of every expert's weights (models with experts)."),
                         ("expert_share", "The share of its experts one token reads: top_k / experts (models "
                                          "with experts).")):
            if model_cost and key in model_cost:
                Gauge(f"pagellm:model_{key}", doc, name, registry=reg).labels(model_name).set(model_cost[key])
        self._requests: dict[str, _Progress] = {}
        # Plain totals for the dashboard (read from the event loop; ints are safe to share).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.total_finished = 0

    def count_api_request(self, api: str, status: int) -> None:
        self.api_requests.labels(self.model_name, api, str(status)).inc()

    def bind(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the engine observer (called on the engine thread) --------------------------------
    def on_added(self, request_id: str, params, num_prompt_tokens: int) -> None:
        self._requests[request_id] = _Progress(time.time())
        self.params_n.observe(num_sequences(params))
        if max_new_tokens(params):  # neither unbounded nor an embedding
            self.params_max_tokens.observe(max_new_tokens(params))

    def on_step(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            p = self._requests.get(out.request_id)
            tokens = sum(len(c.token_ids) for c in out.outputs)
            if p is None or not p.last_token_time:  # the request's first output
                arrival = out.metrics.arrival_time
                p = self._requests[out.request_id] = _Progress(arrival, last_token_time=now)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.total_prompt_tokens += len(out.prompt_token_ids)
                first = out.metrics.first_token_time or now
                self.ttft.observe(max(0.0, first - arrival))
            elif tokens > p.tokens:
                self.itl.observe(now - p.last_token_time)
                p.last_token_time = now
            if tokens > p.tokens:
                self.generation_tokens.inc(tokens - p.tokens)
                self.total_generation_tokens += tokens - p.tokens
                p.tokens = tokens
            if out.finished:
                del self._requests[out.request_id]
                reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "stop"
                self._finish(reason, (out.metrics.finished_time or now) - p.arrival_time)
                self._finished_request(out, now)

    def on_abort(self, request_id: str, now: float) -> None:
        p = self._requests.pop(request_id, None)
        self._finish("abort", None if p is None else now - p.arrival_time)

    def on_error(self, request_id: str, now: float) -> None:
        p = self._requests.pop(request_id, None)
        self._finish("error", None if p is None else now - p.arrival_time)

    def _finished_request(self, out: RequestOutput, now: float) -> None:
        """The request-level series of a request that finished normally."""
        m = out.metrics
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_prefill_kv_computed.observe(max(0, len(out.prompt_token_ids) - out.num_cached_tokens))
        lengths = [len(c.token_ids) for c in out.outputs]
        self.request_generation_tokens.observe(sum(lengths))
        self.request_max_generation_tokens.observe(max(lengths, default=0))
        finished = m.finished_time or now
        scheduled = m.first_scheduled_time
        if scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - m.arrival_time))
            self.inference_time.observe(max(0.0, finished - scheduled))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - scheduled))
        if m.first_token_time is not None:
            decode = max(0.0, finished - m.first_token_time)
            self.decode_time.observe(decode)
            if max(lengths, default=0) > 1:
                self.request_tpot.observe(decode / (max(lengths) - 1))

    def _finish(self, reason: str, latency: float | None) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.total_finished += 1
        if latency is not None:
            self.e2e.observe(max(0.0, latency))
