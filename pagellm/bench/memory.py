"""`pagellm bench memory`: how much of the KV memory each allocation policy fills with
token states, how many requests it batches, and what request rate it sustains.

A request stream is replayed through the real Scheduler and the real KV managers (the
paged KVCoordinator at several block sizes, and the contiguous-reservation allocators
of pagellm.core.kv.contiguous) under one fixed budget of token slots. The model's forward
pass is a stub that returns a token at once; time is simulated with a cost model, so a
run takes seconds and needs no torch.

Cost model (simulated seconds per step), roughly OPT-13B on one A100, the setting of the
PagedAttention paper: `step_s + token_s * tokens computed + ctx_s * context tokens read`,
i.e. a fixed cost for reading the weights, a per-token cost for the matrix products and a
per-cached-token cost for reading K/V in attention. Only the rates in req/s depend on it;
the memory shares and batch sizes do not.

Workloads: input and output lengths are drawn with a fixed seed from lognormal
distributions whose location is solved so that the clipped means match ShareGPT
(161 in / 338 out) or Alpaca (19 / 58), the means the paper reports; the shapes (sigma)
are assumptions. Every request sets max_tokens to its output length with ignore_eos,
so the oracle policy knows each final length exactly. Arrivals are Poisson.

KV cache formats (bench/kv_cache.py): at the bytes of the token budget in bfloat16, for the
bundled SmolLM2's and Llama-3-8B's KV shapes, how many tokens each format's real row size fits
and how many requests the scheduler then runs at once.

Sliding windows (bench/windows.py): KV bytes per generating request at 8k and 32k context for a
Mistral-like and a Gemma-3-like shape, the hybrid manager against full caching, and how many such
requests fit 16 GiB.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field

from pagellm.bench import doc_sections, report
from pagellm.bench.kv_cache import capacity_rows, print_capacity_rows
from pagellm.bench.windows import print_window_rows, window_rows
from pagellm.core.kv import ContiguousKVManager, KVCoordinator, make_kv_manager
from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler
from pagellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    name: str
    input_mean: float
    output_mean: float
    input_sigma: float
    output_sigma: float
    max_input: int


WORKLOADS = {
    "sharegpt": Workload("sharegpt", 161, 338, 1.0, 0.9, 1024),
    "alpaca": Workload("alpaca", 19, 58, 0.5, 0.8, 256),
}

# (policy, block size). Contiguous reservations are token-granular (block size 1).
DEFAULT_POLICIES = [("paged", b) for b in (1, 8, 16, 32, 64, 128)] + [
    ("contiguous-max", 1), ("contiguous-pow2", 1), ("contiguous-oracle", 1)]


@dataclass(frozen=True)
class CostModel:
    step_s: float = 0.020
    token_s: float = 0.00013
    ctx_s: float = 0.0000005

    def step_time(self, num_tokens: int, num_context: int) -> float:
        return self.step_s + self.token_s * num_tokens + self.ctx_s * num_context


def _solve_mu(z: list[float], sigma: float, target: float, lo_clip: int, hi_clip: list[int]) -> list[int]:
    """Lengths exp(mu + sigma*z), clipped per sample, with mu bisected so their mean is the target."""
    def lengths(mu: float) -> list[int]:
        return [min(max(lo_clip, round(math.exp(mu + sigma * x))), hi) for x, hi in zip(z, hi_clip)]

    lo, hi = -5.0, 15.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(lengths(mid)) / len(z) < target:
            lo = mid
        else:
            hi = mid
    return lengths((lo + hi) / 2)


def sample_lengths(w: Workload, n: int, seed: int, max_model_len: int) -> list[tuple[int, int]]:
    """n (input, output) pairs; input + output <= max_model_len."""
    rng = random.Random(seed)
    zi = [rng.gauss(0, 1) for _ in range(n)]
    zo = [rng.gauss(0, 1) for _ in range(n)]
    max_in = min(w.max_input, max_model_len // 2)
    ins = _solve_mu(zi, w.input_sigma, w.input_mean, 1, [max_in] * n)
    outs = _solve_mu(zo, w.output_sigma, w.output_mean, 1, [max_model_len - i for i in ins])
    return list(zip(ins, outs))


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if math.isfinite(rate) else 0.0
        out.append(t)
    return out


@dataclass
class SimResult:
    policy: str
    block_size: int
    rate: float
    num_requests: int
    sim_time_s: float
    num_steps: int
    # Time-averaged over steps, weighted by each step's simulated duration.
    token_share_of_reserved: float  # slots holding token states / slots reserved
    token_share_of_pool: float  # slots holding token states / all slots
    breakdown: dict  # share of the pool: token states, reserved for later, never used, free
    mean_batch: float
    peak_batch: int
    num_preemptions: int
    mean_queue_delay_s: float
    mean_normalized_latency_s: float  # e2e latency / output tokens, mean over requests
    throughput_req_s: float
    diverged: bool
    queue_delay_first_half_s: float = 0.0
    queue_delay_last_quarter_s: float = 0.0
    wall_s: float = 0.0


def _reserved(kv, rid: str) -> int:
    if isinstance(kv, ContiguousKVManager):
        return kv.reserved_slots(rid)
    return len(kv.block_table(rid)) * kv.block_size


def _new_kv(policy: str, num_blocks: int, block_size: int, max_model_len: int):
    kwargs = {}
    # Prefix caching (where the paged manager has it) is off: this measures allocation alone.
    if policy == "paged" and "enable_prefix_caching" in inspect.signature(KVCoordinator).parameters:
        kwargs["enable_prefix_caching"] = False
    return make_kv_manager(policy, num_blocks, block_size, max_model_len, **kwargs)


def simulate(policy: str, block_size: int, lengths: list[tuple[int, int]], arrivals: list[float], *,
             budget_slots: int, max_model_len: int, cost: CostModel = CostModel(), max_num_seqs: int = 256,
             max_num_batched_tokens: int = 2048, divergence_slack: float = 0.02, seed: int = 0,
             rate: float | None = None) -> SimResult:
    """Replay the stream through the real scheduler; the model is a stub, time is simulated."""
    wall = time.perf_counter()
    num_blocks = budget_slots // block_size
    pool_slots = num_blocks * block_size
    kv = _new_kv(policy, num_blocks, block_size, max_model_len)
    sched = Scheduler(kv, max_num_seqs, max_num_batched_tokens)
    rng = random.Random(seed + 2)
    n = len(lengths)
    final = {}
    admitted: dict[str, float] = {}
    finished: dict[str, float] = {}
    t = 0.0
    nxt = 0
    acc = dict(time=0.0, stored=0.0, reserved=0.0, later=0.0, unused=0.0, batch=0.0)
    peak = steps = 0
    while nxt < n or sched.num_unfinished:
        if not sched.num_unfinished and arrivals[nxt] > t:
            t = arrivals[nxt]
        while nxt < n and arrivals[nxt] <= t:
            p, o = lengths[nxt]
            rid = str(nxt)
            req = Request(rid, [rng.randrange(1, 32000) for _ in range(p)],
                          SamplingParams(max_tokens=o, ignore_eos=True), max_model_len=max_model_len)
            final[rid] = p + o
            sched.add_request(req)
            nxt += 1
        out = sched.schedule()
        if out.is_empty:
            if nxt < n:
                t = max(t, arrivals[nxt])
                continue
            raise RuntimeError(f"{policy}: no request fits the KV budget of {budget_slots} slots")
        for s in out.scheduled:
            admitted.setdefault(s.request.request_id, t)
        # Token states held once this step has run, and what each request has reserved.
        new = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        stored = reserved = later = 0
        for req in sched.running:
            rid = req.request_id
            held = req.num_computed_tokens + new.get(rid, 0)
            r = _reserved(kv, rid)
            stored += held
            reserved += r
            later += max(0, min(r, final[rid]) - held)
        num_context = sum(s.start + s.num_new_tokens for s in out.scheduled)
        dt = cost.step_time(out.num_batched_tokens, num_context)
        acc["time"] += dt
        acc["stored"] += stored * dt
        acc["reserved"] += reserved * dt
        acc["later"] += later * dt
        acc["unused"] += (reserved - stored - later) * dt
        acc["batch"] += len(out.scheduled) * dt
        peak = max(peak, len(out.scheduled))
        t += dt
        steps += 1
        sampled = {s.request.request_id: [7] for s in out.scheduled if s.samples}
        for req in sched.update_after_step(out, sampled):
            if req.is_finished:
                finished[req.request_id] = t
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    T = acc["time"] or 1.0
    delays = [admitted[str(i)] - arrivals[i] for i in range(n)]
    norm = [(finished[str(i)] - arrivals[i]) / lengths[i][1] for i in range(n)]
    first_half = sum(delays[: n // 2]) / max(1, n // 2)
    last_q = delays[n - n // 4:] or delays[-1:]
    last_quarter = sum(last_q) / len(last_q)
    return SimResult(
        policy=policy, block_size=block_size,
        rate=rate if rate is not None else ((n / arrivals[-1]) if arrivals[-1] else math.inf),
        num_requests=n, sim_time_s=t, num_steps=steps,
        token_share_of_reserved=acc["stored"] / acc["reserved"] if acc["reserved"] else 0.0,
        token_share_of_pool=acc["stored"] / (pool_slots * T),
        breakdown={
            "token_states": acc["stored"] / (pool_slots * T),
            "reserved_for_later": acc["later"] / (pool_slots * T),
            "reserved_never_used": acc["unused"] / (pool_slots * T),
            "free": 1 - acc["reserved"] / (pool_slots * T),
        },
        mean_batch=acc["batch"] / T, peak_batch=peak, num_preemptions=sched.num_preemptions,
        mean_queue_delay_s=sum(delays) / n, mean_normalized_latency_s=sum(norm) / n,
        throughput_req_s=n / t if t else 0.0,
        # Queueing delay that keeps growing over the run: the arrivals outpace the service.
        # The slack, a share of the arrival span, absorbs noise in a stable queue.
        diverged=last_quarter > 2 * first_half + divergence_slack * arrivals[-1],
        queue_delay_first_half_s=first_half, queue_delay_last_quarter_s=last_quarter,
        wall_s=time.perf_counter() - wall,
    )


def policy_label(policy: str, block_size: int) -> str:
    return f"paged-{block_size}" if policy == "paged" else policy


@dataclass
class MemoryBenchConfig:
    workloads: list[str] = field(default_factory=lambda: ["sharegpt", "alpaca"])
    policies: list[tuple[str, int]] = field(default_factory=lambda: list(DEFAULT_POLICIES))
    budget_slots: int = 16384
    max_model_len: int = 2048
    # Per workload: Alpaca's requests are short, so more of them make a run of similar length.
    num_requests: dict = field(default_factory=lambda: {"sharegpt": 400, "alpaca": 1000})
    # Offered load for the headline figures: above what any policy sustains, so batches are memory-bound.
    rate: dict = field(default_factory=lambda: {"sharegpt": 20.0, "alpaca": 400.0})
    # Request rates swept (req/s, simulated) for the sustained-rate search, per workload.
    sweep: dict = field(default_factory=lambda: {
        "sharegpt": [0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0],
        "alpaca": [4.0, 8.0, 16.0, 32.0, 48.0, 64.0, 96.0, 128.0]})
    refine_steps: int = 3
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)


def max_sustained_rate(run, rates: list[float], refine_steps: int) -> tuple[float | None, list[SimResult]]:
    """The highest rate whose queueing delay does not diverge: the grid, then bisection
    between the last sustained and the first diverging rate."""
    results = [run(r) for r in rates]
    ok = [res for res in results if not res.diverged]
    bad = [res for res in results if res.diverged]
    if not ok:
        return None, results
    lo = max(r.rate for r in ok)
    higher = [r.rate for r in bad if r.rate > lo]
    if not higher:
        return lo, results
    hi = min(higher)
    for _ in range(refine_steps):
        mid = (lo + hi) / 2
        res = run(mid)
        results.append(res)
        lo, hi = (mid, hi) if not res.diverged else (lo, mid)
    return lo, results


def _bench_policy(cfg: MemoryBenchConfig, wname: str, policy: str, bs: int) -> dict:
    """Headline run and sustained-rate search for one policy on one workload."""
    lengths = sample_lengths(WORKLOADS[wname], cfg.num_requests[wname], cfg.seed, cfg.max_model_len)

    def run(rate: float) -> SimResult:
        return simulate(policy, bs, lengths, poisson_arrivals(len(lengths), rate, cfg.seed),
                        budget_slots=cfg.budget_slots, max_model_len=cfg.max_model_len, cost=cfg.cost,
                        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                        seed=cfg.seed, rate=rate)

    head = run(cfg.rate[wname])
    sustained, sweep = max_sustained_rate(run, cfg.sweep[wname], cfg.refine_steps)
    sweep.sort(key=lambda r: r.rate)
    return {**asdict(head), "max_sustained_rate": sustained,
            "sweep": [{k: getattr(r, k) for k in (
                "rate", "mean_normalized_latency_s", "mean_queue_delay_s", "mean_batch", "peak_batch",
                "throughput_req_s", "diverged", "num_preemptions")} for r in sweep]}


def run_memory_bench(cfg: MemoryBenchConfig, show_progress: bool = True, workers: int | None = None) -> dict:
    """Every (workload, policy) pair, spread over the CPU cores (each pair is independent)."""
    tasks = [(w, p, b) for w in cfg.workloads for p, b in cfg.policies]
    workers = workers or min(len(tasks), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                             else (os.cpu_count() or 1))
    bar = report.progress(total=len(tasks), desc="bench memory", enable=show_progress, unit="policy")
    done: dict = {}
    if workers <= 1:
        for t in tasks:
            done[t] = _bench_policy(cfg, *t)
            bar.update(1)
    else:
        with ProcessPoolExecutor(workers) as pool:
            futures = {pool.submit(_bench_policy, cfg, *t): t for t in tasks}
            for f in as_completed(futures):
                done[futures[f]] = f.result()
                bar.update(1)
    bar.close()
    results: dict = {"config": _config_dict(cfg), "workloads": {}}
    for wname in cfg.workloads:
        lengths = sample_lengths(WORKLOADS[wname], cfg.num_requests[wname], cfg.seed, cfg.max_model_len)
        ins = [p for p, _ in lengths]
        outs = [o for _, o in lengths]
        results["workloads"][wname] = {
            "mean_input": sum(ins) / len(ins), "mean_output": sum(outs) / len(outs),
            "num_requests": len(lengths), "max_input": max(ins), "max_output": max(outs),
            "offered_rate": cfg.rate[wname],
            "policies": {policy_label(p, b): done[(wname, p, b)] for p, b in cfg.policies},
        }
    results["windows"] = window_rows()
    results["kv_formats"] = kv_format_rows(cfg)
    results["targets"] = check_targets(results) + results["windows"]["targets"] + results["kv_formats"]["targets"]
    return results


def kv_format_rows(cfg: MemoryBenchConfig) -> dict:
    """KV cache formats (bench/kv_cache.py): the same bytes as `budget_slots` bfloat16 tokens of a
    real model shape, in each format's real bytes per token; ShareGPT-like requests all waiting at
    the start, so the number admitted at once is set by memory alone (up to max_num_seqs)."""
    lengths = sample_lengths(WORKLOADS["sharegpt"], cfg.num_requests["sharegpt"], cfg.seed, cfg.max_model_len)

    def peak(slots: int) -> dict:
        res = simulate("paged", 16, lengths, [0.0] * len(lengths), budget_slots=slots,
                       max_model_len=cfg.max_model_len, cost=cfg.cost, max_num_seqs=cfg.max_num_seqs,
                       max_num_batched_tokens=cfg.max_num_batched_tokens, seed=cfg.seed)
        return {"peak_requests": res.peak_batch, "mean_batch": res.mean_batch,
                "num_preemptions": res.num_preemptions, "sim_time_s": res.sim_time_s}

    return capacity_rows(peak, cfg.budget_slots)


def _config_dict(cfg: MemoryBenchConfig) -> dict:
    d = asdict(cfg)
    d["policies"] = [policy_label(p, b) for p, b in cfg.policies]
    return d


def check_targets(results: dict) -> list[dict]:
    """The issue's memory targets, on the ShareGPT-like workload."""
    w = results["workloads"].get("sharegpt")
    if not w:
        return []
    p = w["policies"]
    out = []
    if "paged-16" in p:
        v = p["paged-16"]["token_share_of_reserved"]
        out.append({"target": "paged block 16: share of reserved slots holding tokens >= 96%", "value": v,
                    "met": v >= 0.96})
    if "contiguous-max" in p:
        v = p["contiguous-max"]["token_share_of_reserved"]
        out.append({"target": "contiguous-max: share of reserved slots holding tokens <= 40%", "value": v,
                    "met": v <= 0.40})
    if "paged-16" in p and "contiguous-oracle" in p:
        v = p["paged-16"]["peak_batch"] / max(1, p["contiguous-oracle"]["peak_batch"])
        out.append({"target": "paged block 16 peak batch >= 2x contiguous-oracle's, same budget", "value": v,
                    "met": v >= 2.0})
    return out


def print_tables(results: dict) -> None:
    headers = ["policy", "tokens/reserved", "tokens/pool", "mean batch", "peak batch", "preempt",
               "max rate req/s", "norm lat s/tok"]
    for wname, w in results["workloads"].items():
        print(f"\n{wname}: {w['num_requests']} requests, mean {w['mean_input']:.0f} in / "
              f"{w['mean_output']:.0f} out, KV budget {results['config']['budget_slots']} token slots, "
              f"offered {results['config']['rate'][wname]} req/s")
        rows = [[name, f"{r['token_share_of_reserved']:.1%}", f"{r['token_share_of_pool']:.1%}", r["mean_batch"],
                 r["peak_batch"], r["num_preemptions"], r["max_sustained_rate"], r["mean_normalized_latency_s"]]
                for name, r in w["policies"].items()]
        print(report.format_table(headers, rows))
    if "windows" in results:
        print_window_rows(results["windows"])
    if "kv_formats" in results:
        print_capacity_rows(results["kv_formats"])
    report.print_targets(results.get("targets", []))


def doc_table(results: dict) -> str:
    """docs/benchmarks.md's table: one row per policy, ShareGPT's figures then Alpaca's."""
    share, alpaca = results["workloads"]["sharegpt"]["policies"], results["workloads"]["alpaca"]["policies"]
    rows = [[name, f"{r['token_share_of_reserved']:.1%}", f"{r['token_share_of_pool']:.1%}", f"{r['mean_batch']:.1f}",
             r["peak_batch"], f"{r['max_sustained_rate']:.3g}", f"{alpaca[name]['token_share_of_reserved']:.1%}",
             alpaca[name]["peak_batch"], f"{alpaca[name]['max_sustained_rate']:.3g}"] for name, r in share.items()]
    return doc_sections.markdown_table(["policy", "ShareGPT tokens / reserved", "tokens / pool", "mean batch",
                                      "peak batch", "max rate (req/s)", "Alpaca tokens / reserved", "peak batch",
                                      "max rate"], rows, "lrrrrrrrr")


def plot(results: dict, path) -> None:
    plt = report.pyplot()
    names = list(next(iter(results["workloads"].values()))["policies"])
    nw = len(results["workloads"])
    fig, axes = plt.subplots(2, nw, figsize=(6.5 * nw, 9), squeeze=False)
    parts = [("token_states", "token states", "tab:green"), ("reserved_for_later", "reserved, used later", "tab:olive"),
             ("reserved_never_used", "reserved, never used", "tab:red"), ("free", "free / fragmented", "lightgray")]
    for col, (wname, w) in enumerate(results["workloads"].items()):
        ax = axes[0][col]
        bottom = [0.0] * len(names)
        for key, label, color in parts:
            vals = [w["policies"][n]["breakdown"][key] * 100 for n in names]
            ax.bar(names, vals, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, n in enumerate(names):
            ax.text(i, 101, f"{w['policies'][n]['token_share_of_reserved']:.0%}", ha="center", fontsize=7)
        ax.set_ylabel("% of KV pool (time-averaged)")
        ax.set_title(f"{wname}: KV pool use (label: tokens / reserved)")
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        ax.set_ylim(0, 108)
        if col == 0:
            ax.legend(fontsize=7, loc="lower left")
        ax = axes[1][col]
        for n in names:
            sw = w["policies"][n]["sweep"]
            ax.plot([s["rate"] for s in sw], [s["mean_normalized_latency_s"] for s in sw], marker=".", label=n)
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s, simulated)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_title(f"{wname}: latency vs rate")
        ax.legend(fontsize=7)
    report.save_figure(fig, path)


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="KV memory use, batch size and sustained rate per allocation policy "
                                      "(real scheduler and allocators, stub model, simulated time)")
    p.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="default: all")
    p.add_argument("--policy", action="append", default=None,
                   help="paged-<block size> or contiguous-{max,pow2,oracle}; repeat (default: all of the issue's)")
    p.add_argument("--budget-slots", type=int, default=16384, help="KV budget in token slots")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-requests", type=int, default=None, help="default: 400 ShareGPT-like, 1000 Alpaca-like")
    p.add_argument("--rate", type=float, default=None, help="offered rate for the headline figures (req/s)")
    p.add_argument("--sweep", type=float, nargs="+", default=None, help="request rates to sweep (req/s)")
    p.add_argument("--refine-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/memory-<date>)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU core)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def parse_policy(text: str) -> tuple[str, int]:
    if text.startswith("paged-"):
        return "paged", int(text.removeprefix("paged-"))
    if text in ("contiguous-max", "contiguous-pow2", "contiguous-oracle"):
        return text, 1
    raise ValueError(f"--policy must be paged-<block size> or contiguous-{{max,pow2,oracle}}, got {text!r}")


def main(args: argparse.Namespace) -> int:
    cfg = MemoryBenchConfig(budget_slots=args.budget_slots, max_model_len=args.max_model_len,
                            refine_steps=args.refine_steps, seed=args.seed)
    if args.workload:
        cfg.workloads = list(dict.fromkeys(args.workload))
    if args.num_requests is not None:
        cfg.num_requests = {w: args.num_requests for w in WORKLOADS}
    if args.policy:
        cfg.policies = [parse_policy(p) for p in args.policy]
    if args.rate is not None:
        cfg.rate = {w: args.rate for w in cfg.workloads}
    if args.sweep:
        cfg.sweep = {w: sorted(args.sweep) for w in cfg.workloads}
    results = {**report.metadata("memory"),
               **run_memory_bench(cfg, show_progress=not args.no_progress, workers=args.workers)}
    json_path, png_path = report.output_paths("memory", args.out)
    print_tables(results)
    report.write_json(json_path, results)
    plot(results, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 0
