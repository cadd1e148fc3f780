"""`pagellm bench serve`: a load generator against a running OpenAI-compatible server.

Requests arrive as a Poisson process at each rate given; each one is a streamed
`POST /v1/completions` (stream=true, ignore_eos, max_tokens set, usage requested) and
is timed from the moment it is sent: time to first token (TTFT), time per output token
after the first (TPOT), end-to-end latency, and normalized latency (end-to-end seconds
per output token, the PagedAttention paper's measure). Per rate: percentiles, throughput,
and how many requests failed.

Targets: `--url` (repeatable, `LABEL=URL` to name it) for servers already running, or
`--launch POLICY` (repeatable) to start `pagellm serve` here once per KV policy, one
after another, on a free loopback port (`pagellm serve --kv-policy POLICY`), and stop it
afterwards. `--launch llama-server` starts llama.cpp's own server instead, the peer for
quantized GGUF serving: the same `--model` file, `--threads` threads, and `--parallel` set to
`--max-concurrency` (built by benchmarks/build_llama_cpp.sh; PAGELLM_LLAMA_CPP_BIN names
another build's bin directory).

`--workload shared-prefix` is the workload of a replica router: `--num-systems K` system
prompts (`--system-prompt-len` tokens each) shared by all users, each request one of them
(chosen at random) followed by its own question; every rate draws new system prompts, so no
rate starts with another's cache. The prefix-cache hit rate per rate comes from the server's
/metrics (pagellm:prefix_cache_{queries,hits}). `--router-policy P` (repeatable) launches each
POLICY once per router policy (`--router-policy P` added to `--engine-args`, which should give
`--data-parallel-size N`), so cache_aware and round_robin are measured at the same load.

`--max-concurrency N` keeps at most N requests in flight (the rest wait their turn, as
vLLM's benchmark does); with `--rates inf` every request is sent at once, so the server runs
N streams until the work is done.

Only loopback addresses are accepted: this is a load generator.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from pagellm import envs
from pagellm.bench import doc_sections, report, roofline
from pagellm.config import ROUTER_POLICIES



@dataclass
class ServeConfig:
    rates: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0, 4.0])
    num_requests: int = 32
    workload: str = "alpaca"
    max_prompt: int = 512
    max_output: int = 128
    seed: int = 0
    timeout_s: float = 600.0
    max_concurrency: int | None = None
    num_systems: int = 4  # the shared-prefix workload's system prompts
    system_prompt_len: int = 384


# Tokens of each user's own question after the shared system prompt (shared-prefix workload).
QUESTION_LEN = 32
# Replicas report their stats to the server once a second: wait that long before reading its counters.
REPLICA_STATS_LAG_S = 1.5
WORKLOADS = ("alpaca", "sharegpt", "shared-prefix")


@dataclass
class RequestRecord:
    sent: float
    first_token: float | None = None
    done: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"--url must point at this machine (127.0.0.0/8, ::1 or localhost), got {url!r}")


def words(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of common words (a word is about 1.3 tokens; usage reports the true count)."""
    return " ".join(rng.choice(report.COMMON_WORDS) for _ in range(max(1, round(tokens / 1.3))))


def make_requests(cfg: ServeConfig, round_index: int = 0) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) per request; lengths from the memory bench's workloads, clipped
    for a CPU server. For shared-prefix, each `round_index` (rate) has its own system prompts."""
    if cfg.workload == "shared-prefix":
        rng = random.Random(cfg.seed * 1000 + round_index)
        systems = [words(rng, cfg.system_prompt_len) for _ in range(cfg.num_systems)]
        return [(f"{rng.choice(systems)}\n\nQ: {words(rng, QUESTION_LEN)}", cfg.max_output)
                for _ in range(cfg.num_requests)]
    from pagellm.bench.memory import WORKLOADS as LENGTHS, sample_lengths

    lengths = sample_lengths(LENGTHS[cfg.workload], cfg.num_requests, cfg.seed, 2048)
    rng = random.Random(cfg.seed)
    return [(words(rng, min(p, cfg.max_prompt)), max(1, min(o, cfg.max_output))) for p, o in lengths]


async def _one(client, url: str, model: str, prompt: str, max_tokens: int, rec: RequestRecord) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    rec.error = str(chunk["error"])[:200]
                    return
                usage = chunk.get("usage")
                if usage:
                    rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
                    rec.prompt_tokens = usage.get("prompt_tokens")
                if any(c.get("text") for c in chunk.get("choices") or []):
                    if rec.first_token is None:
                        rec.first_token = time.perf_counter()
                    if not usage:
                        rec.output_tokens += 1  # a lower bound until usage arrives
        rec.done = time.perf_counter()
    except Exception as e:  # a refused, reset or timed-out connection is a failed request, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:200]


async def run_rate(url: str, model: str, work: list[tuple[str, int]], rate: float, seed: int,
                   timeout_s: float, max_concurrency: int | None = None) -> list[RequestRecord]:
    import httpx

    rng = random.Random(seed + 17)
    slots = asyncio.Semaphore(max_concurrency or len(work))

    async def one(client, prompt: str, max_tokens: int, rec: RequestRecord) -> None:
        async with slots:  # waiting for a slot counts in the request's latency, as for a user
            await _one(client, url, model, prompt, max_tokens, rec)

    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=len(work) + 4, max_keepalive_connections=len(work) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        t_next = 0.0
        for prompt, max_tokens in work:
            delay = start + t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(sent=time.perf_counter())
            records.append(rec)
            tasks.append(asyncio.create_task(one(client, prompt, max_tokens, rec)))
            t_next += rng.expovariate(rate)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s + 60)
    return records


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(records: list[RequestRecord], rate: float) -> dict:
    ok = [r for r in records if r.error is None and r.done is not None and r.first_token is not None]
    ttft = [r.first_token - r.sent for r in ok]
    e2e = [r.done - r.sent for r in ok]
    tpot = [(r.done - r.first_token) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    norm = [(r.done - r.sent) / r.output_tokens for r in ok if r.output_tokens]
    span = (max(r.done for r in ok) - min(r.sent for r in records)) if ok else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]  # as usage reported them

    def stats(xs: list[float]) -> dict:
        return {"mean": sum(xs) / len(xs) if xs else None, "p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9),
                "p99": percentile(xs, 0.99)}

    return {
        "rate": rate, "num_requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok), "errors": sorted({r.error for r in records if r.error})[:5],
        "ttft_s": stats(ttft), "tpot_s": stats(tpot), "e2e_s": stats(e2e), "normalized_latency_s": stats(norm),
        "output_tokens": out_tokens, "duration_s": span,
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "throughput_tok_s": out_tokens / span if span else 0.0,
        "throughput_req_s": len(ok) / span if span else 0.0,
    }


def get_model(url: str, timeout: float = 10.0) -> str:
    import httpx

    r = httpx.get(url + "/v1/models", timeout=timeout)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def num_replicas(url: str) -> int:
    """The engine replicas a pagellm server lists in /health (0: a single engine, or another server)."""
    import httpx

    try:
        r = httpx.get(url + "/health", timeout=10)
        return len(r.json().get("replicas", [])) if r.status_code == 200 and r.content else 0
    except (httpx.HTTPError, ValueError, AttributeError):
        return 0


def wait_ready(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no answer from {url}/v1/models within {timeout_s:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LLAMA_SERVER = "llama-server"


def launch(policy: str, engine_args: list[str], log_path: str, llama: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start `pagellm serve --kv-policy POLICY ENGINE_ARGS`, or llama.cpp's server for policy
    "llama-server" with `llama` = {"model", "threads", "parallel", "ctx_per_slot"} and optionally
    "extra", more llama-server flags."""
    port = free_port()
    if policy == LLAMA_SERVER:
        binary = os.path.join(envs.llama_cpp_bin(), "llama-server")
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"{binary} not found: build it with benchmarks/build_llama_cpp.sh "
                                    "(or set PAGELLM_LLAMA_CPP_BIN)")
        cmd = [binary, "-m", llama["model"], "-t", str(llama["threads"]), "--parallel", str(llama["parallel"]),
               "-c", str(llama["parallel"] * llama["ctx_per_slot"]), "--host", "127.0.0.1", "--port", str(port),
               "--cont-batching", "--no-webui", "--metrics", *llama.get("extra", ())]
    else:
        cmd = [sys.executable, "-m", "pagellm", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--disable-access-log", "--kv-policy", policy, *engine_args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warm_up(url: str, model: str, timeout_s: float) -> None:
    """One short request before any timing, so a server's one-off start-up costs (kernels
    built or loaded, first allocations) do not land in the first rate's figures."""
    rec = RequestRecord(sent=time.perf_counter())

    async def go() -> None:
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
            await _one(client, url, model, "Hello", 2, rec)

    asyncio.run(go())
    if rec.error:
        raise RuntimeError(f"the warm-up request to {url} failed: {rec.error}")


# What a server's /metrics says about its work: engine steps and tokens computed (pagellm's
# iteration histogram, llama-server's decode calls and token totals), and pagellm's model cost.
SERVER_COUNTERS = {
    "steps": ("pagellm:iteration_tokens_total_count", "llamacpp:n_decode_total"),
    "tokens": ("pagellm:iteration_tokens_total_sum", ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total")),
    "flops_per_token": ("pagellm:model_flops_per_token",),
    "weight_bytes_per_step": ("pagellm:model_weight_bytes_per_step",),
    "expert_weight_bytes": ("pagellm:model_expert_weight_bytes",),
    "expert_share": ("pagellm:model_expert_share",),
    "prefix_queries": ("pagellm:prefix_cache_queries_total",),
    "prefix_hits": ("pagellm:prefix_cache_hits_total",),
}


def server_counters(url: str) -> dict:
    """SERVER_COUNTERS read from the server's /metrics now; {} when it has none."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(url + "/metrics", timeout=10)
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    out = {}
    for key, names in SERVER_COUNTERS.items():
        for name in names:
            parts = name if isinstance(name, tuple) else (name,)
            if all(p in samples for p in parts):
                out[key] = sum(samples[p] for p in parts)
                break
    return out


def reported_cost(counters: dict) -> dict | None:
    """The model cost a pagellm server reports in its /metrics (FLOPs per token, weight bytes per
    step); None for a server that reports none."""
    return {k: counters[k] for k in ("flops_per_token", "weight_bytes_per_step", "expert_weight_bytes", "expert_share")
            if k in counters} or None


def prefix_hit_rate(before: dict, after: dict) -> float | None:
    """The share of prompt tokens the prefix cache served over one rate (None: the server has no
    such counters, or computed no prompt)."""
    if not all("prefix_queries" in c and "prefix_hits" in c for c in (before, after)):
        return None
    queries = after["prefix_queries"] - before["prefix_queries"]
    return (after["prefix_hits"] - before["prefix_hits"]) / queries if queries > 0 else None


def rate_roofline(before: dict, after: dict, duration_s: float, limits: dict | None, cost: dict | None) -> dict | None:
    """The GFLOP/s and weight GB/s the server achieved over one rate, from its counters' growth."""
    cost = reported_cost(after) or cost
    if not cost or "tokens" not in after or "tokens" not in before or duration_s <= 0:
        return None
    steps = after["steps"] - before["steps"] if "steps" in after and "steps" in before else None
    return {"steps": steps, "tokens_computed": after["tokens"] - before["tokens"],
            **roofline.achieved(cost, after["tokens"] - before["tokens"], steps, duration_s, limits)}


def bench_target(url: str, cfg: ServeConfig, show_progress: bool, label: str | None = None,
                 limits: dict | None = None, cost: dict | None = None) -> dict:
    """`label` names the target in the progress bar (its policy, for a launched server). `cost`
    (FLOPs per token, weight bytes per step) stands in for a server that does not report its own."""
    model = get_model(url)
    warm_up(url, model, cfg.timeout_s)
    lag = REPLICA_STATS_LAG_S if num_replicas(url) else 0.0
    rows = []
    rates = report.progress(cfg.rates, desc=f"bench serve {label or url}", enable=show_progress, unit="rate")
    for i, rate in enumerate(rates):
        work = make_requests(cfg, i)
        time.sleep(lag)
        before = server_counters(url)
        records = asyncio.run(run_rate(url, model, work, rate, cfg.seed, cfg.timeout_s, cfg.max_concurrency))
        row = summarize(records, rate)
        time.sleep(lag)
        after = server_counters(url)
        row["roofline"] = rate_roofline(before, after, row["duration_s"], limits, cost)
        row["prefix_cache_hit_rate"] = prefix_hit_rate(before, after)
        rows.append(row)
    return {"url": url, "model": model, "rates": rows}


def run_serve_bench(cfg: ServeConfig, urls: list[tuple[str, str]], policies: list[str], engine_args: list[str],
                    out_dir: str, show_progress: bool = True, ready_timeout_s: float = 600.0,
                    llama: dict | None = None, router_policies: list[str] | None = None) -> dict:
    """`router_policies`: launch each pagellm policy once per router policy (label POLICY/ROUTER)."""
    targets: dict = {}
    skipped: dict = {}
    limits = roofline.machine_limits()
    cost = None  # a pagellm server's model cost, for a llama-server on the same file
    for label, url in urls:
        check_loopback(url)
        targets[label] = bench_target(url.rstrip("/"), cfg, show_progress, label, limits)
    # pagellm first: its reported model cost serves llama-server's roofline too.
    runs = [(p, None) for p in policies if p == LLAMA_SERVER or not router_policies]
    runs += [(p, r) for p in policies if p != LLAMA_SERVER for r in router_policies or ()]
    for policy, router in sorted(runs, key=lambda run: run[0] == LLAMA_SERVER):
        label = f"{policy}/{router}" if router else policy
        args = [*engine_args, "--router-policy", router] if router else engine_args
        log_path = os.path.join(out_dir, f"serve-{label.replace('/', '-')}.log")
        proc, url = launch(policy, args, log_path, llama)
        try:
            wait_ready(url, proc, ready_timeout_s)
            if policy != LLAMA_SERVER and cost is None:
                cost = reported_cost(server_counters(url))
            targets[label] = {**bench_target(url, cfg, show_progress, label, limits, cost), "launched": True,
                              "engine_args": proc.args[1:] if policy == LLAMA_SERVER else args,
                              # which build of llama.cpp (its cache directory names its instruction sets)
                              **({"binary": proc.args[0]} if policy == LLAMA_SERVER else {})}
        except (RuntimeError, TimeoutError) as e:
            skipped[label] = f"{e} (log: {log_path})"
        finally:
            stop(proc)
    out = {"config": asdict(cfg), "machine_limits": limits, "machine_limits_after": roofline.machine_limits(),
           "targets": targets, "skipped": skipped}
    if router_policies:
        out["router_targets"] = router_targets(targets, cfg.num_systems)
    return out


# Issue 21: with K = replicas x 2 system prompts, the cache-aware router's prefix-cache hit rate is
# at least 1.8x round-robin's at the same load.
ROUTER_HIT_RATE_TARGET = 1.8


def router_targets(targets: dict, num_systems: int) -> list[dict]:
    """Per launched policy and rate: cache_aware's hit rate (and mean TTFT) against round_robin's."""
    out = []
    for label, t in targets.items():
        policy, _, router = label.partition("/")
        other = targets.get(f"{policy}/round_robin")
        if router != "cache_aware" or other is None:
            continue
        for mine, theirs in zip(t["rates"], other["rates"]):
            ours, base = mine["prefix_cache_hit_rate"], theirs["prefix_cache_hit_rate"]
            ratio = ours / base if ours is not None and base else None
            out.append({"target": f"{policy} at {mine['rate']} req/s, K = {num_systems}: cache_aware prefix-cache "
                                  f"hit rate >= {ROUTER_HIT_RATE_TARGET}x round_robin's "
                                  f"({_fmt_pct(ours)} vs {_fmt_pct(base)}; mean TTFT "
                                  f"{_fmt_s(mine['ttft_s']['mean'])} vs {_fmt_s(theirs['ttft_s']['mean'])})",
                        "value": ratio if ratio is not None else float("nan"),
                        "met": ratio is not None and ratio >= ROUTER_HIT_RATE_TARGET})
    return out


def router_doc_table(runs: list[dict]) -> str:
    """docs/scaling.md's table: one run per KV pool size, each rate's prefix-cache hit rate and
    mean time to first token under cache_aware beside round_robin."""
    rows = []
    for results in runs:
        targets = results["targets"]
        for label, t in targets.items():
            policy, _, router = label.partition("/")
            other = targets.get(f"{policy}/round_robin")
            if router != "cache_aware" or other is None:
                continue
            args = t.get("engine_args", [])
            kv = args[args.index("--kv-cache-memory") + 1] if "--kv-cache-memory" in args else "default"
            for i, (mine, theirs) in enumerate(zip(t["rates"], other["rates"])):
                ours, base = mine["prefix_cache_hit_rate"], theirs["prefix_cache_hit_rate"]
                rows.append([kv if i == 0 else "", f"{mine['rate']:g}", _fmt_pct(ours), _fmt_pct(base),
                             f"{ours / base:.2f}x" if ours is not None and base else "-",
                             f"{mine['ttft_s']['mean']:.2f} s", f"{theirs['ttft_s']['mean']:.2f} s"])
    return doc_sections.markdown_table(["KV per replica", "rate req/s", "hit rate cache_aware", "round_robin", "ratio",
                                      "mean TTFT cache_aware", "round_robin"], rows, "lrrrrrr")


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def print_tables(results: dict) -> None:
    headers = ["target", "rate req/s", "done", "failed", "TTFT p50 s", "TTFT p99 s", "TPOT p50 s", "e2e p50 s",
               "e2e p99 s", "norm lat s/tok", "tok/s", "prefix hit %", "GFLOP/s", "weight GB/s"]
    rows = []
    for label, t in results["targets"].items():
        for r in t["rates"]:
            rows.append([label, r["rate"], r["completed"], r["failed"], r["ttft_s"]["p50"], r["ttft_s"]["p99"],
                         r["tpot_s"]["p50"], r["e2e_s"]["p50"], r["e2e_s"]["p99"], r["normalized_latency_s"]["mean"],
                         r["throughput_tok_s"], _fmt_pct(r.get("prefix_cache_hit_rate")),
                         (r.get("roofline") or {}).get("gflops"),
                         (r.get("roofline") or {}).get("weight_gbps")])
    print(report.format_table(headers, rows))
    for k, why in results["skipped"].items():
        print(f"skipped {k}: {why}")
    report.print_targets(results.get("router_targets", []), "{:.2f}x")


def doc_table(results: dict) -> str:
    """docs/benchmarks.md's table: per rate, each target's normalized latency, median time to
    first token and throughput, side by side."""
    by_rate = {label: {r["rate"]: r for r in t["rates"]} for label, t in results["targets"].items()}
    header = ["rate (req/s)"]
    for label in by_rate:
        header += [f"{label}: norm. latency s/token", "TTFT p50 s", "tok/s"]
    rows = []
    for rate in dict.fromkeys(rate for rates in by_rate.values() for rate in rates):
        row = [f"{rate:g}"]
        for rates in by_rate.values():
            r = rates.get(rate)
            row += ["-"] * 3 if r is None else [f"{r['normalized_latency_s']['mean']:.3f}", f"{r['ttft_s']['p50']:.2f}",
                                                f"{r['throughput_tok_s']:.1f}"]
        rows.append(row)
    return doc_sections.markdown_table(header, rows, "r" * len(header))


def plot(results: dict, path) -> bool:
    """The figures against the request rate, at `path`; False, and nothing written, when no rate is
    finite (`--rates inf`, a closed loop: there is no rate to place a point at)."""
    by_target = {label: [r for r in t["rates"] if math.isfinite(r["rate"])] for label, t in results["targets"].items()}
    if not any(by_target.values()):
        return False
    plt = report.pyplot()
    hits = any(r.get("prefix_cache_hit_rate") is not None for rows in by_target.values() for r in rows)
    fig, axes = plt.subplots(1, 4 if hits else 3, figsize=(20 if hits else 15, 4.5))
    for i, (label, rows) in enumerate(by_target.items()):
        rates = [r["rate"] for r in rows]
        color = f"C{i}"  # one color per target in every panel; p99 dashed beside its p50
        axes[0].plot(rates, [r["normalized_latency_s"]["mean"] for r in rows], marker="o", color=color, label=label)
        axes[1].plot(rates, [r["ttft_s"]["p50"] for r in rows], marker="o", color=color, label=f"{label} p50")
        axes[1].plot(rates, [r["ttft_s"]["p99"] for r in rows], marker="x", ls="--", color=color,
                     label=f"{label} p99")
        axes[2].plot(rates, [r["throughput_tok_s"] for r in rows], marker="o", color=color, label=label)
        if hits:
            axes[3].plot(rates, [100 * (r.get("prefix_cache_hit_rate") or 0.0) for r in rows], marker="o",
                         color=color, label=label)
    report.label_axes(((axes[0], "normalized latency vs rate", "s / output token"),
                       (axes[1], "time to first token", "s"), (axes[2], "throughput", "output tokens/s"),
                       *(((axes[3], "prefix cache hit rate", "% of prompt tokens"),) if hits else ())),
                      "request rate (req/s)")
    report.save_figure(fig, path)
    return True


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load-test a `pagellm serve` (OpenAI API, streaming): TTFT, TPOT, latency "
                                     "and throughput vs request rate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", default=[], help="a running server, as URL or LABEL=URL; repeatable")
    p.add_argument("--launch", action="append", default=[], metavar="POLICY",
                   help="start `pagellm serve` with this KV policy (paged, contiguous-max, ...), or llama.cpp's "
                        "server (llama-server); repeatable")
    p.add_argument("--engine-args", default="--kv-cache-memory 256M --max-model-len 1024",
                   help="engine flags for --launch (a quoted string)")
    p.add_argument("--model", default=None,
                   help="the model every launched server serves (default: the bundled SmolLM2 GGUF)")
    p.add_argument("--threads", type=int, default=None,
                   help="llama-server's threads (default: torch's, i.e. what pagellm uses)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: no limit); llama-server gets as many slots")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0], help="request rates (req/s)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate")
    p.add_argument("--workload", choices=WORKLOADS, default="alpaca",
                   help="request lengths as in alpaca or sharegpt, or shared-prefix: --num-systems system prompts "
                        "shared by all users")
    p.add_argument("--num-systems", type=int, default=None, help="shared-prefix: system prompts (default 4)")
    p.add_argument("--system-prompt-len", type=int, default=None,
                   help="shared-prefix: tokens per system prompt, approximately (default 384)")
    p.add_argument("--router-policy", action="append", default=[], choices=ROUTER_POLICIES,
                   help="launch each POLICY once per router policy (--engine-args should give "
                        "--data-parallel-size N); repeatable")
    p.add_argument("--max-prompt", type=int, default=512, help="clip prompts (tokens, approximately)")
    p.add_argument("--max-output", type=int, default=128, help="clip outputs (tokens)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/serve-<date>)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if not args.url and not args.launch:
        raise ValueError("give --url URL (a running server) or --launch POLICY (start one here)")
    if any(r <= 0 for r in args.rates) or args.num_requests < 1:
        raise ValueError("--rates must be > 0 and --num-requests >= 1")
    for flag, value in (("--num-systems", args.num_systems), ("--system-prompt-len", args.system_prompt_len)):
        if value is not None and args.workload != "shared-prefix":
            raise ValueError(f"{flag} shapes the shared-prefix workload; --workload is {args.workload!r}")
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    shared = {k: v for k, v in (("num_systems", args.num_systems), ("system_prompt_len", args.system_prompt_len))
              if v is not None}
    if args.router_policy and not args.launch:
        raise ValueError("--router-policy applies to launched servers: give --launch POLICY")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    urls = []
    for u in args.url:
        label, _, rest = u.partition("=")
        urls.append((label, rest) if rest and "://" not in label else (u, u))
    cfg = ServeConfig(rates=sorted(args.rates), num_requests=args.num_requests, workload=args.workload,
                      max_prompt=args.max_prompt, max_output=args.max_output, seed=args.seed, timeout_s=args.timeout,
                      max_concurrency=args.max_concurrency, **shared)
    engine_args = args.engine_args.split()
    if args.model:
        engine_args = [args.model, *engine_args]
    llama = None
    if LLAMA_SERVER in args.launch:
        import torch

        from pagellm.loader.bundled import default_model_path

        model = args.model or default_model_path()
        if not model.endswith(".gguf"):
            raise ValueError(f"llama-server serves GGUF files; --model {model} is not one")
        llama = {"model": model, "threads": args.threads or torch.get_num_threads(),
                 "parallel": args.max_concurrency or 16, "ctx_per_slot": args.max_prompt + args.max_output + 64}
    json_path, png_path = report.output_paths("serve", args.out)
    load = {"loadavg_start": os.getloadavg()}  # the cores must be idle for figures worth comparing
    results = {**report.metadata("serve", extra_versions=("httpx",)), "load": load,
               **run_serve_bench(cfg, urls, list(dict.fromkeys(args.launch)), engine_args,
                                 tempfile.gettempdir(), show_progress=not args.no_progress, llama=llama,
                                 router_policies=list(dict.fromkeys(args.router_policy)))}
    load["loadavg_end"] = os.getloadavg()
    print_tables(results)
    report.write_json(json_path, results)
    if plot(results, png_path):
        print(f"\nwrote {json_path} and {png_path}")
    else:
        print(f"\nwrote {json_path} (no plot: every rate is infinite)")
    return 0 if results["targets"] else 1
