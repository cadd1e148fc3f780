"""`pagellm bench soak`: hours of mixed traffic against one server, and whether anything grows.

For `--duration`, `--concurrency` clients send a seeded mix of well-formed requests through the
official `openai` client (chat and completions, streamed and not, n > 1, beam search, JSON-schema
grammars, forced tool calls, prompts sharing a long system prompt, prompts long enough to force
preemption), fuzzed fields (pagellm.bench.fuzz's generator), streams dropped mid-way and
requests whose client gives up (httpx and short client timeouts). Every `--interval` it records
the server process's RSS, open fds and threads (its descendants too: tensor-parallel ranks),
the KV blocks held, p50/p99 TTFT and TPOT of the interval's streamed requests, and requests by
outcome and failure cause.

The verdict fails (exit status 1) on any failed well-formed request, any fuzzed request that
harmed (a 5xx, an error in its stream, no answer), blocks still held once idle at the end, or
growth after warm-up (the first WARMUP_FRACTION of the samples, and at least until every kind of
request has finished once): an RSS least-squares slope
above RSS_SLOPE_LIMIT of the mean RSS per 10 minutes, or fds / threads in the last
WARMUP_FRACTION of the samples above their warm-up maximum plus FD_SLACK / THREAD_SLACK.
Fewer than MIN_TREND_SAMPLES samples after warm-up leave the growth checks inconclusive.

`--launch` starts `pagellm serve` here with the disk tier on and a small KV pool, so long
prompts preempt by swapping; `--url` soaks a running loopback server (its process is found by
its port to read RSS, fds and threads; if it is not readable here they are omitted, and said so).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from urllib.parse import urlparse

from pagellm.bench import procfs, report
from pagellm.bench.fuzz import held_blocks, idle_state
from pagellm.bench.serve import check_loopback, get_model, launch, percentile, stop, wait_ready, words
from pagellm.bench.soak_traffic import MIX, OUTCOMES, Record, SoakConfig, Traffic

# The growth verdict's tolerances.
WARMUP_FRACTION = 0.2
RSS_SLOPE_LIMIT = 0.01        # of the mean RSS, per RSS_SLOPE_PERIOD_S
RSS_SLOPE_PERIOD_S = 600.0
# A sample lands at a random moment of the load: each open connection holds an fd, and the
# server's thread pools start threads on demand up to their bound.
FD_SLACK = 8
THREAD_SLACK = 4
MIN_TREND_SAMPLES = 5

# What /metrics says at the end about failures, preemptions and the disk tier.
SERVER_COUNTERS = ("pagellm:request_failures", "pagellm:engine_step_failures", "pagellm:num_preemptions",
                   "pagellm:kv_offload_demoted", "pagellm:kv_offload_promoted", "pagellm:kv_offload_write_errors")
# A pool of 68 SmolLM2 blocks (1,088 tokens): a long prompt (half of max_model_len) beside any other
# request preempts, and preempting swaps to the disk tier.
DEFAULT_ENGINE_ARGS = "--kv-cache-memory 48M --max-model-len 2048 --kv-offload-size 256M --preemption-mode swap"


def parse_duration(text: str) -> float:
    """Seconds in '90', '90s', '45m', '1.5h'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--duration must be a positive number of seconds, or end with s, m or h "
                         f"(e.g. 90s, 60m, 1h), got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def interval_summary(records: list[Record]) -> dict:
    """Requests finished in one interval: counts by outcome and failure cause, TTFT and TPOT percentiles."""
    outcomes = {o: 0 for o in OUTCOMES}
    causes: dict[str, int] = {}
    for r in records:
        outcomes[r.outcome] += 1
        if r.cause:
            causes[f"{r.outcome}: {r.cause}"] = causes.get(f"{r.outcome}: {r.cause}", 0) + 1
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    tpot = [r.tpot_s for r in records if r.tpot_s is not None]
    return {"requests": outcomes, "causes": causes,
            "ttft_s": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
            "tpot_s": {"p50": percentile(tpot, 0.5), "p99": percentile(tpot, 0.99)}}


async def server_sample(http, url: str, pid: int | None, start: float) -> dict:
    """The server's process figures and its block map's counts, now (`server_error` if it did not answer)."""
    import httpx

    sample = {"t_s": round(time.perf_counter() - start, 2), "loadavg": os.getloadavg()}
    try:
        r = await http.get(url + "/dashboard/state")
        r.raise_for_status()
        state = r.json()
    except (httpx.HTTPError, ValueError) as e:
        sample["server_error"] = f"{type(e).__name__}: {e}"[:300]
    else:
        stats = state["stats"]
        sample.update(held_blocks=held_blocks(state)["held_blocks"], used_blocks=stats["used_blocks"],
                      num_running=stats["num_running"], num_waiting=stats["num_waiting"],
                      num_preemptions=stats["num_preemptions"], prefix_cache_hit_rate=stats["prefix_cache_hit_rate"],
                      kv_offload=stats.get("kv_offload"))
    proc = procfs.process_sample(pid) if pid is not None else None
    if proc is not None:
        sample.update(rss_bytes=proc["total"]["rss_bytes"], fds=proc["total"]["fds"],
                      threads=proc["total"]["threads"], processes=1 + len(proc["children"]))
    return sample


def slope(ts: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over ts."""
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


def warmup_length(samples: list[dict]) -> int:
    """Samples in the warm-up: the first WARMUP_FRACTION, and at least until every request kind has
    finished once (a first beam search, grammar or swap allocates what later ones reuse)."""
    covered = next((i + 1 for i, s in enumerate(samples) if s.get("all_kinds_done", True)), len(samples))
    return max(1, round(WARMUP_FRACTION * len(samples)), covered)


def growth_checks(samples: list[dict]) -> list[dict]:
    """RSS, fds and threads after warm-up, against the tolerances above. A check's `met` is None when
    the series was not measured or is too short to say."""
    checks = []
    for key in ("rss_bytes", "fds", "threads"):
        measured = [s for s in samples if s.get(key) is not None]
        if not measured:
            checks.append({"check": f"{key} growth", "met": None, "why": "not measured (no readable server process)"})
            continue
        k = warmup_length(measured)
        warm, after = measured[:k], measured[k:]
        tail = measured[-max(1, round(WARMUP_FRACTION * len(measured))):]
        if len(after) < MIN_TREND_SAMPLES:
            checks.append({"check": f"{key} growth", "met": None,
                           "why": f"{len(after)} samples after warm-up, fewer than {MIN_TREND_SAMPLES}"})
            continue
        if key == "rss_bytes":
            mean = sum(s[key] for s in after) / len(after)
            per_period = slope([s["t_s"] for s in after], [s[key] for s in after]) * RSS_SLOPE_PERIOD_S
            limit = RSS_SLOPE_LIMIT * mean
            checks.append({"check": f"RSS slope after warm-up <= {RSS_SLOPE_LIMIT:.0%} of mean RSS per "
                                    f"{RSS_SLOPE_PERIOD_S / 60:g} min", "value": per_period, "limit": limit,
                           "met": per_period <= limit})
        else:
            slack = FD_SLACK if key == "fds" else THREAD_SLACK
            last = max(s[key] for s in tail)
            limit = max(s[key] for s in warm) + slack
            checks.append({"check": f"{key} in the last {WARMUP_FRACTION:.0%} of samples <= warm-up max + {slack}",
                           "value": last, "limit": limit, "met": last <= limit})
    return checks


def verdict(results: dict) -> dict:
    totals = results["totals"]
    checks = [
        {"check": "failed well-formed requests == 0", "value": totals["failed"], "met": totals["failed"] == 0},
        {"check": "harmful fuzzed requests == 0", "value": totals["fuzz_harm"], "met": totals["fuzz_harm"] == 0},
        {"check": "held blocks once idle == 0", "value": results["idle_end"]["held_blocks"],
         "met": results["idle_end"]["held_blocks"] == 0 and not results["idle_end"]["tables"]},
        *growth_checks(results["samples"]),
    ]
    return {"pass": all(c["met"] is not False for c in checks), "checks": checks,
            "inconclusive": [c["check"] for c in checks if c["met"] is None]}


async def soak_async(url: str, cfg: SoakConfig, pid: int | None, show_progress: bool = True) -> dict:
    import httpx

    model = get_model(url)
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as http:
        max_model_len = (await http.get(url + "/dashboard/state")).json()["stats"]["max_model_len"]
    if max_model_len:  # words() counts about 1.3 tokens a word: leave room for the error and the output
        cfg = replace(cfg, long_prompt_tokens=min(cfg.long_prompt_tokens, max_model_len // 2))
    records: list[Record] = []
    samples: list[dict] = []
    system = words(random.Random(cfg.seed), cfg.system_prompt_tokens)
    start = time.perf_counter()
    deadline = start + cfg.duration_s

    async def client(i: int) -> None:
        traffic = Traffic(url, model, cfg, random.Random(cfg.seed * 1000 + i), system)
        try:
            while time.perf_counter() < deadline:
                records.append(await traffic.one())
        finally:
            await traffic.close()

    async with httpx.AsyncClient(timeout=cfg.timeout_s) as http:
        clients = [asyncio.ensure_future(client(i)) for i in range(cfg.concurrency)]
        seen = 0
        kinds_done: set[str] = set()
        next_at = start + cfg.interval_s
        while not all(c.done() for c in clients):
            await asyncio.wait(clients, timeout=max(0.0, next_at - time.perf_counter()))
            if time.perf_counter() < next_at or time.perf_counter() > deadline:
                continue  # the clients are draining after the deadline: the idle sample follows
            kinds_done.update(r.kind for r in records[seen:])
            sample = {**await server_sample(http, url, pid, start), **interval_summary(records[seen:]),
                      "all_kinds_done": kinds_done >= set(MIX)}
            seen = len(records)
            samples.append(sample)
            while next_at <= time.perf_counter():  # a slow sample skips the ticks it overran
                next_at += cfg.interval_s
            if show_progress:
                print(_progress_line(sample), flush=True)
        for c in clients:
            c.result()  # a bug in the load generator itself is raised, not counted
        idle = {**await server_sample(http, url, pid, start), **interval_summary(records[seen:])}
        try:  # the requests that finished after the deadline are in the idle sample's counts
            idle.update(held_blocks(await idle_state(http, url, cfg.timeout_s)))
            metrics = (await http.get(url + "/metrics")).text
        except httpx.HTTPError as e:  # the server is gone: the verdict fails, the JSON says why
            idle.update(held_blocks=None, tables=None, server_error=f"{type(e).__name__}: {e}"[:300])
            metrics = ""
    every = interval_summary(records)
    return {
        "config": asdict(cfg), "model": model, "elapsed_s": round(time.perf_counter() - start, 2),
        "samples": samples, "idle_end": idle,
        "totals": {**every["requests"], "sent": len(records), "causes": every["causes"],
                   "by_kind": {k: sum(r.kind == k for r in records) for k in MIX}},
        "failures": [asdict(r) for r in records if r.outcome in ("failed", "fuzz_harm")][:50],
        "server_counters": [line for line in metrics.splitlines() if line.startswith(SERVER_COUNTERS)],
    }


def _progress_line(s: dict) -> str:
    rss = f"RSS {s['rss_bytes'] / 2**20:.0f} MiB, fds {s['fds']}, threads {s['threads']}, " if "rss_bytes" in s else ""
    held = f"held blocks {s['held_blocks']}" if "held_blocks" in s else f"no answer ({s['server_error']})"
    r = s["requests"]
    return (f"[{s['t_s']:7.0f} s] {rss}{held}, ok {r['ok']}, failed {r['failed']}, "
            f"fuzz {r['refused'] + r['fuzz_served']} (harm {r['fuzz_harm']}), dropped {r['disconnected']}, "
            f"timed out {r['timed_out']}, TTFT p50 {_ms(s['ttft_s']['p50'])}, TPOT p50 {_ms(s['tpot_s']['p50'])}")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f} ms"


def plot(results: dict, path) -> None:
    plt = report.pyplot()
    samples = results["samples"]
    ts = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    if any("rss_bytes" in s for s in samples):
        axes[0].plot(ts, [s["rss_bytes"] / 2**20 if "rss_bytes" in s else None for s in samples], marker=".")
        axes[1].plot(ts, [s.get("fds") for s in samples], marker=".", label="open fds")
        axes[1].plot(ts, [s.get("threads") for s in samples], marker=".", label="threads")
    axes[2].plot(ts, [s.get("held_blocks") for s in samples], marker=".", label="held (sampled under load)")
    axes[2].plot(ts, [s["requests"]["failed"] for s in samples], marker="x", label="failed requests")
    for key, style in (("ttft_s", "-"), ("tpot_s", "--")):
        for q in ("p50", "p99"):
            axes[3].plot(ts, [s[key][q] for s in samples], ls=style, marker=".", label=f"{key[:4].upper()} {q}")
    report.label_axes(((axes[0], "server RSS (with children)", "MiB"), (axes[1], "fds and threads", "count"),
                       (axes[2], "KV blocks held, failures", "count"), (axes[3], "latency", "s")), "minutes")
    report.save_figure(fig, path)


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="mixed traffic for a long time: fails on any failed well-formed request, "
                                    "blocks held once idle, or RSS / fds / threads growing",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", default="60m", help="how long to send traffic: seconds, or 90s, 60m, 1h")
    p.add_argument("--url", default=None, help="a running server (loopback only)")
    p.add_argument("--launch", action="store_true",
                   help="start `pagellm serve` here with --engine-args and the disk tier in a temporary directory")
    p.add_argument("--model", default=None, help="the model --launch serves (default: the bundled SmolLM2 GGUF)")
    p.add_argument("--engine-args", default=DEFAULT_ENGINE_ARGS,
                   help="engine flags for --launch (a quoted string; --kv-offload-dir is added)")
    p.add_argument("--concurrency", type=int, default=4, help="clients sending requests at once")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between two samples")
    p.add_argument("--timeout", type=float, default=300.0, help="a well-formed request's client timeout (s)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per choice of a well-formed request")
    p.add_argument("--system-prompt-tokens", type=int, default=400,
                   help="tokens of the system prompt every prefix-sharing request starts with (approximately)")
    p.add_argument("--long-prompt-tokens", type=int, default=800,
                   help="tokens of a long prompt (approximately; at most half the server's max_model_len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/soak-<date>)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if bool(args.url) == bool(args.launch):
        raise ValueError("give exactly one of --url URL and --launch")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.interval <= 0:
        raise ValueError(f"--interval must be > 0 seconds, got {args.interval}")
    for flag in ("max_tokens", "system_prompt_tokens", "long_prompt_tokens"):
        if getattr(args, flag) < 2:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 2, got {getattr(args, flag)}")
    cfg = SoakConfig(duration_s=parse_duration(args.duration), concurrency=args.concurrency,
                     interval_s=args.interval, seed=args.seed, timeout_s=args.timeout, max_tokens=args.max_tokens,
                     system_prompt_tokens=args.system_prompt_tokens, long_prompt_tokens=args.long_prompt_tokens)
    json_path, png_path = report.output_paths("soak", args.out)
    server: dict = {"launched": bool(args.launch)}
    proc, tier_dir, url = None, None, args.url
    if args.launch:
        tier_dir = tempfile.mkdtemp(prefix="pagellm-soak-tier-")
        engine_args = [*([args.model] if args.model else []), *args.engine_args.split(), "--kv-offload-dir", tier_dir]
        server["engine_args"] = engine_args
        server["log"] = os.path.join(tempfile.gettempdir(), "soak-serve.log")
        proc, url = launch("paged", engine_args, server["log"])
    try:
        if proc is not None:
            wait_ready(url, proc, 600.0)
        check_loopback(url)
        url = url.rstrip("/")
        pid = proc.pid if proc is not None else procfs.listening_pid(urlparse(url).port or 80)
        server.update(url=url, pid=pid)
        if pid is None or procfs.process_sample(pid) is None:
            server["note"] = ("the server's process is not readable here (another user, or no /proc): RSS, fds "
                              "and threads are not recorded and their growth checks are left out")
        load = {"loadavg_start": os.getloadavg()}
        results = {**report.metadata("soak", extra_versions=("httpx", "openai")), "server": server, "load": load,
                   **asyncio.run(soak_async(url, cfg, pid, show_progress=not args.no_progress))}
        load["loadavg_end"] = os.getloadavg()
    finally:
        if proc is not None:
            stop(proc)
        if tier_dir is not None:
            shutil.rmtree(tier_dir, ignore_errors=True)
    results["verdict"] = verdict(results)
    report.write_json(json_path, results)
    plot(results, png_path)
    t = results["totals"]
    print(f"{t['sent']} requests: {t['ok']} ok, {t['failed']} failed, {t['refused']} fuzzed refused, "
          f"{t['fuzz_served']} fuzzed served, {t['fuzz_harm']} fuzzed harmful, {t['disconnected']} dropped, "
          f"{t['timed_out']} timed out; idle at the end: {results['idle_end']['held_blocks']} blocks held; "
          f"{results['idle_end'].get('num_preemptions')} preemptions")
    report.print_targets([{**c, "target": c["check"], "value": float("nan") if c["value"] is None else c["value"]}
                          for c in results["verdict"]["checks"] if c["met"] is not None])
    for c in results["verdict"]["checks"]:
        if c["met"] is None:
            print(f"n/a     {c['check']}: {c['why']}")
    print(f"{'PASS' if results['verdict']['pass'] else 'FAIL'}\nwrote {json_path} and {png_path}")
    return 0 if results["verdict"]["pass"] else 1
