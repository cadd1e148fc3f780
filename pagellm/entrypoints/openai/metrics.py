"""Prometheus metrics, named `pagellm:*` after vLLM's `vllm:*` ones, in a registry of their own.

Gauges and the engine's cumulative counters (preemptions, prefix cache) are read from the
engine's last published stats at scrape time; token counters and latency histograms are
fed by the engine thread after each step (`ServerMetrics` is the async engine's observer).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagellm.outputs import RequestOutput

# vLLM's buckets.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


@dataclass
class _Progress:
    arrival_time: float
    tokens: int = 0
    last_token_time: float = 0.0


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's stats when Prometheus scrapes."""

    def __init__(self, model_name: str, stats: Callable[[], dict]) -> None:
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
                     s.get("num_running", 0))
        yield family(GaugeMetricFamily, "pagellm:num_requests_waiting", "Number of requests waiting to be scheduled.",
                     s.get("num_waiting", 0))
        yield family(GaugeMetricFamily, "pagellm:kv_cache_usage_perc",
                     "Fraction of KV cache blocks in use (1 means 100 percent).", s.get("kv_cache_usage", 0.0))
        yield family(GaugeMetricFamily, "pagellm:kv_cache_total_blocks", "Number of physical KV cache blocks.",
                     s.get("total_blocks", 0))
        yield family(GaugeMetricFamily, "pagellm:kv_cache_free_blocks", "Number of free KV cache blocks.",
                     s.get("free_blocks", 0))
        yield family(CounterMetricFamily, "pagellm:num_preemptions", "Cumulative number of preemptions.",
                     s.get("num_preemptions", 0))
        yield family(CounterMetricFamily, "pagellm:prefix_cache_queries",
                     "Prefix cache queries (as the engine counts them).", s.get("prefix_cache_queries", 0))
        yield family(CounterMetricFamily, "pagellm:prefix_cache_hits",
                     "Prefix cache hits (as the engine counts them).", s.get("prefix_cache_hits", 0))
        yield family(CounterMetricFamily, "pagellm:engine_step_failures",
                     "Engine steps whose batch raised; the requests that caused it failed, the others carried on.",
                     s.get("num_step_failures", 0))
        failures = CounterMetricFamily("pagellm:request_failures",
                                       "Requests that failed while generating, by cause (step_error: raised in "
                                       "the forward pass or sampling when run alone; non_finite_logits; "
                                       "no_token_allowed; grammar_error: a token the structured-output grammar "
                                       "rejected; "
                                       "output_error: detokenizing or formatting).",
                                       labels=["model_name", "cause"])
        for cause, count in sorted(s.get("request_failures", {}).items()):
            failures.add_metric(labels + [cause], count)
        yield failures


class ServerMetrics:
    """The server's registry, and the engine observer that feeds it."""

    def __init__(self, model_name: str) -> None:
        # No `*_created` series: like vLLM, which turns them off too (the switch is process-wide).
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._stats: Callable[[], dict] = dict
        self.registry.register(_EngineCollector(model_name, lambda: self._stats()))
        reg, name = self.registry, ["model_name"]
        self.prompt_tokens = Counter("pagellm:prompt_tokens", "Number of prefill tokens processed.", name,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("pagellm:generation_tokens", "Number of generation tokens processed.",
                                         name, registry=reg).labels(model_name)
        self.request_success = Counter("pagellm:request_success", "Count of finished requests by finish reason.",
                                       name + ["finished_reason"], registry=reg)
        self.ttft = Histogram("pagellm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              name, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("pagellm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             name, buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("pagellm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", name, buckets=E2E_BUCKETS,
                             registry=reg).labels(model_name)
        self._requests: dict[str, _Progress] = {}
        # Plain totals for the dashboard (read from the event loop; ints are safe to share).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.total_finished = 0

    def bind(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the engine observer (called on the engine thread) --------------------------------
    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            p = self._requests.get(out.request_id)
            tokens = sum(len(c.token_ids) for c in out.outputs)
            if p is None:
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

    def on_abort(self, request_id: str, now: float) -> None:
        p = self._requests.pop(request_id, None)
        self._finish("abort", None if p is None else now - p.arrival_time)

    def on_error(self, request_id: str, now: float) -> None:
        p = self._requests.pop(request_id, None)
        self._finish("error", None if p is None else now - p.arrival_time)

    def _finish(self, reason: str, latency: float | None) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.total_finished += 1
        if latency is not None:
            self.e2e.observe(max(0.0, latency))
