"""`pagellm bench fuzz`: one request must never harm another.

Sends request bodies whose fields hold extreme or ill-typed values (NaN, Infinity, 1e39,
1e-45, 2**64, "2", true, null, a lone surrogate, out-of-vocabulary ids, ...) to both
OpenAI endpoints, beside a steady load of well-formed requests, and reports harm:

- a fuzzed request answered with a 5xx, an error event in its stream, or no answer;
- a well-formed request that failed in any way;
- a KV block still held once everything has finished (read from /dashboard/state).

Fuzzed requests are drawn from a seeded generator, so a run can be repeated exactly.
The test suite runs a few hundred of them; this command runs as many as asked and
writes the report as JSON. Only loopback servers are accepted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagellm.bench import report
from pagellm.bench.serve import check_loopback, get_model, launch, stop, wait_ready

NAN, INF = float("nan"), float("inf")
# Values at the edges of every type: floats that are not finite (or not in float32), integers
# around the int32/int64/uint64 limits, values of the wrong type, text that is not valid UTF-8.
EXTREMES: list[Any] = [
    NAN, INF, -INF, 1e39, -1e39, 3.5e38, 1e-45, 1e-50, -1e-45, 0, 0.0, -1, -0.5, 1, 2, 1e9,
    2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, -(2 ** 63) - 1, 10 ** 30,
    True, False, None, "", "2", "8", "NaN", "Infinity", "yes", "true", "\ud800", "a\udfffb",
    [], [None], [-1], [2 ** 70], [10 ** 9], [True], ["\ud800"], {}, {"a": 1}, {"5": NAN}, {"-1": 1}, {"99999999": 5},
    "x" * 3000,
]
# Values at the edges of what each field accepts: these must be served, not refused.
VALID_EDGES: dict[str, list[Any]] = {
    "n": [1, 2, 3], "best_of": [2, 3], "temperature": [0, 1e-7, 1e-5, 0.01, 2.0, 100.0, 3.4e38],
    "top_p": [1e-9, 0.01, 1.0], "top_k": [-1, 1, 2, 320], "min_p": [0.0, 0.5, 1.0],
    "repetition_penalty": [0.01, 0.5, 1.5, 100.0], "presence_penalty": [-2, 2.0], "frequency_penalty": [-2.0, 2],
    "seed": [0, -1, -(2 ** 63), 2 ** 63 - 4, 12345], "max_tokens": [1, 2, 8], "min_tokens": [0, 1, 4],
    "stop": ["\n", ["a", "the"], ["é"], "  "], "stop_token_ids": [[0], [1, 2, 3], []],
    "ignore_eos": [True, False], "include_stop_str_in_output": [True, False], "skip_special_tokens": [False],
    "logit_bias": [{"1": 100}, {"2": -100, "3": 100}, {}], "allowed_token_ids": [[5], [5, 6, 7]],
    "stream": [True, False], "stream_options": [None], "user": ["fuzz"], "echo": [True, False],
    "logprobs": [0, 1, 5], "top_logprobs": [0, 20], "prompt": [[5, 6, 7], ["a", "b"], [[5], [6, 7]], "é" * 30],
    "messages": [[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]],
    "max_completion_tokens": [1, 3], "add_generation_prompt": [True, False],
    "chat_template_kwargs": [{"enable_thinking": False}, {}], "tools": [None],
}
SAMPLING_FIELDS = [
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "logit_bias", "allowed_token_ids", "stream", "stream_options", "model", "user",
]
FIELDS = {
    "/v1/completions": SAMPLING_FIELDS + ["prompt", "best_of", "echo", "logprobs", "suffix"],
    "/v1/chat/completions": SAMPLING_FIELDS + ["messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                               "add_generation_prompt", "chat_template_kwargs", "tools"],
}
# The combinations that failed every live request before the isolation work (kept as fixed cases).
KNOWN_CASES: list[tuple[str, dict]] = [
    ("/v1/completions", {"temperature": NAN}),
    ("/v1/completions", {"temperature": NAN, "top_k": 5}),
    ("/v1/chat/completions", {"temperature": "NaN", "top_p": 0.5, "min_p": 0.1}),
    ("/v1/completions", {"temperature": 1.0, "repetition_penalty": NAN}),
    ("/v1/completions", {"temperature": 1.0, "repetition_penalty": 1e-45}),
    ("/v1/chat/completions", {"temperature": 0.9, "repetition_penalty": 1e-50}),
    ("/v1/completions", {"temperature": 1e39, "min_tokens": 2}),
    ("/v1/completions", {"temperature": "Infinity", "allowed_token_ids": [5, 6]}),
    ("/v1/completions", {"seed": 2 ** 64 - 1, "n": 2, "temperature": 1.0}),
    ("/v1/completions", {"seed": 2 ** 63 - 1, "best_of": 2, "temperature": 1.0}),
    ("/v1/completions", {"prompt": "\ud800"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}),
    ("/v1/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False, "tools": []}}),
    ("/v1/completions", {"repetition_penalty": 1e9}),
    ("/v1/completions", {"repetition_penalty": INF}),
    ("/v1/completions", {"temperature": 0, "presence_penalty": NAN}),
    ("/v1/completions", {"stop_token_ids": [10 ** 9]}),
    ("/v1/completions", {"top_k": 10 ** 9}),
    ("/v1/completions", {"seed": True, "logprobs": True, "n": "2", "max_tokens": "8", "echo": "yes"}),
    ("/v1/chat/completions", {"stream": "true"}),
    ("/v1/completions", {"prompt": None}),
]


@dataclass
class FuzzConfig:
    num_requests: int = 300       # fuzzed requests, the fixed known cases included
    background_clients: int = 3   # well-formed requests in flight at any time
    interval_s: float = 0.0       # pause between two fuzzed requests
    seed: int = 0
    max_fields: int = 3           # fields made extreme in one request
    timeout_s: float = 120.0


@dataclass
class Outcome:
    endpoint: str
    fields: dict
    status: int | None = None
    message: str | None = None
    param: str | None = None
    harm: str | None = None


def fuzz_cases(cfg: FuzzConfig) -> list[tuple[str, dict]]:
    """The known cases, then random ones: 1..max_fields fields set to extremes, on top of a
    request that samples (half of the time) so that the sampler's paths are reached."""
    rng = random.Random(cfg.seed)
    cases = list(KNOWN_CASES[:cfg.num_requests])
    while len(cases) < cfg.num_requests:
        cases.append(random_case(rng, cfg.max_fields))
    return cases


def random_case(rng: random.Random, max_fields: int = 3) -> tuple[str, dict]:
    """One fuzzed request: an endpoint and 1..max_fields of its fields set to extremes or edges."""
    endpoint = rng.choice(list(FIELDS))
    fields: dict = {}
    if rng.random() < 0.5:
        fields["temperature"] = rng.choice([0.7, 1.0, 1.5])
    for name in rng.sample(FIELDS[endpoint], rng.randint(1, max_fields)):
        # Half extremes, half values at the edge of the valid range (which the engine must serve).
        edges = VALID_EDGES.get(name)
        fields[name] = rng.choice(edges) if edges and rng.random() < 0.5 else rng.choice(EXTREMES)
    return endpoint, fields


def body_for(endpoint: str, model: str, fields: dict) -> dict:
    base: dict = {"model": model, "max_tokens": 4}
    if endpoint == "/v1/completions":
        base["prompt"] = "The capital of France is"
    else:
        base["messages"] = [{"role": "user", "content": "Say hello."}]
    return {**base, **fields}


def encode(body: dict) -> bytes:
    # NaN and Infinity as the bare literals Python's json (and many clients) write;
    # lone surrogates as \ud800 escapes.
    return json.dumps(body, allow_nan=True).encode()


async def _send(client, url: str, endpoint: str, body: dict, timeout_s: float) -> tuple[int, str, list[str]]:
    """Status, body text, and the `data:` payloads of a streamed answer."""
    headers = {"Content-Type": "application/json"}
    async with client.stream("POST", url + endpoint, content=encode(body), headers=headers,
                             timeout=timeout_s) as r:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            return r.status_code, "", events
        return r.status_code, (await r.aread()).decode("utf-8", "replace"), []


async def fuzz_one(client, url: str, model: str, endpoint: str, fields: dict, timeout_s: float) -> Outcome:
    out = Outcome(endpoint, {k: _printable(v) for k, v in fields.items()})
    try:
        out.status, text, events = await _send(client, url, endpoint, body_for(endpoint, model, fields), timeout_s)
    except Exception as e:  # a hang or a dropped connection harms the client at least
        out.harm = f"no answer: {type(e).__name__}: {e}"
        return out
    if events:
        errors = [e for e in events if e.startswith('{"error"')]
        if errors:
            out.harm = f"error event in a 200 stream: {errors[0][:300]}"
        return out
    try:
        error = json.loads(text).get("error") if text else None
    except ValueError:
        error = None
    if error:
        out.message, out.param = error.get("message"), error.get("param")
    if out.status >= 500:
        out.harm = f"{out.status}: {text[:300]}"
    elif out.status >= 400 and not (error and error.get("message")):
        out.harm = f"{out.status} without an OpenAI error body: {text[:300]}"
    return out


async def background(client, url: str, model: str, stop_at: asyncio.Event, seed: int, timeout_s: float,
                     results: dict) -> None:
    """Well-formed requests, one after another, until told to stop; every one must succeed."""
    rng = random.Random(seed)
    while not stop_at.is_set():
        endpoint = rng.choice(list(FIELDS))
        stream = rng.random() < 0.5
        n = rng.choice([1, 1, 2])
        fields = {"max_tokens": rng.randint(4, 16), "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 99),
                  "n": n, "stream": stream, "ignore_eos": True}
        if endpoint == "/v1/completions":
            fields["logprobs"] = rng.choice([None, 2])
        body = body_for(endpoint, model, fields)
        results["sent"] += 1
        try:
            status, text, events = await _send(client, url, endpoint, body, timeout_s)
            problem = _check_background(status, text, events, n, fields["max_tokens"], stream)
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        if problem:
            results["failed"].append({"endpoint": endpoint, "fields": fields, "problem": problem})
        else:
            results["ok"] += 1


def _check_background(status: int, text: str, events: list[str], n: int, max_tokens: int, stream: bool) -> str | None:
    if status != 200:
        return f"status {status}: {text[:300]}"
    if stream:
        if not events or events[-1] != "[DONE]":
            return "the stream did not end with [DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):
            return f"error event: {next(c for c in chunks if 'error' in c)}"
        finished = [ch for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
        return None if len(finished) == n else f"{len(finished)} of {n} choices finished"
    body = json.loads(text)
    tokens = body["usage"]["completion_tokens"]
    if len(body["choices"]) != n or tokens != n * max_tokens:
        return f"{len(body['choices'])} choices and {tokens} tokens, expected {n} and {n * max_tokens}"
    return None


async def run_fuzz_async(url: str, cfg: FuzzConfig) -> dict:
    import httpx

    model = get_model(url)
    cases = fuzz_cases(cfg)
    bg = {"sent": 0, "ok": 0, "failed": []}
    stop_at = asyncio.Event()
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        workers = [asyncio.ensure_future(background(client, url, model, stop_at, cfg.seed * 1000 + i,
                                                     cfg.timeout_s, bg))
                   for i in range(cfg.background_clients)]
        outcomes = []
        try:
            for endpoint, fields in cases:
                outcomes.append(await fuzz_one(client, url, model, endpoint, fields, cfg.timeout_s))
                if cfg.interval_s:
                    await asyncio.sleep(cfg.interval_s)
        finally:
            stop_at.set()
            await asyncio.gather(*workers, return_exceptions=True)
        state = await idle_state(client, url, cfg.timeout_s)
        metrics = (await client.get(url + "/metrics")).text
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
    leaked = held_blocks(state)
    return {
        "config": asdict(cfg),
        "elapsed_s": round(time.perf_counter() - start, 2),
        "fuzz": {"sent": len(outcomes), "by_status": by_status,
                 "harmful": [asdict(o) for o in outcomes if o.harm],
                 "refused_without_param": [asdict(o) for o in outcomes
                                           if o.status == 400 and not o.param][:50]},
        "background": bg,
        "blocks_after": leaked,
        "request_failures_metric": _failure_lines(metrics),
        "harm": bool([o for o in outcomes if o.harm] or bg["failed"] or leaked["tables"] or leaked["held_blocks"]),
    }


async def idle_state(client, url: str, timeout_s: float) -> dict:
    """The block map once no request is running or waiting (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = await client.get(url + "/dashboard/state")
        r.raise_for_status()
        state = r.json()
        s = state["stats"]
        if (s["num_running"] == 0 and s["num_waiting"] == 0) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.2)


def held_blocks(state: dict) -> dict:
    """What requests still hold in a /dashboard/state: their block tables and the blocks referenced."""
    return {"tables": state["tables"], "held_blocks": sum(1 for c in state["ref_cnt"] if c)}


def _failure_lines(metrics: str) -> list[str]:
    return [line for line in metrics.splitlines()
            if line.startswith(("pagellm:request_failures", "pagellm:engine_step_failures"))]


def _printable(v: Any) -> Any:
    """A value as the report can hold it (JSON has no NaN, and no lone surrogates in UTF-8)."""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, str):
        return v.encode("utf-8", "backslashreplace").decode() if len(v) <= 60 else f"<{len(v)} chars>"
    if isinstance(v, list):
        return [_printable(x) for x in v[:8]]
    if isinstance(v, dict):
        return {str(_printable(k)): _printable(x) for k, x in list(v.items())[:8]}
    return v


def run_fuzz(url: str, cfg: FuzzConfig) -> dict:
    check_loopback(url)
    return asyncio.run(run_fuzz_async(url.rstrip("/"), cfg))


def add_parser(sub) -> None:
    p = sub.add_parser("fuzz", help="fuzz request fields against a server under load: no request may harm another",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (loopback only)")
    p.add_argument("--launch", action="store_true", help="start `pagellm serve` here with --engine-args")
    p.add_argument("--engine-args", default="--kv-cache-memory 128M --max-model-len 1024",
                   help="engine flags for --launch (a quoted string)")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--background-clients", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.0, help="seconds between two fuzzed requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/fuzz-<date>)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if bool(args.url) == bool(args.launch):
        raise ValueError("give exactly one of --url URL and --launch")
    cfg = FuzzConfig(num_requests=args.num_requests, background_clients=args.background_clients,
                     interval_s=args.interval, seed=args.seed)
    proc = None
    url = args.url
    if args.launch:
        log_path = f"{tempfile.gettempdir()}/fuzz-serve.log"
        proc, url = launch("paged", args.engine_args.split(), log_path)
    try:
        if proc is not None:
            wait_ready(url, proc, 600.0)
        results = {**report.metadata("fuzz", extra_versions=("httpx",)), **run_fuzz(url, cfg)}
    finally:
        if proc is not None:
            stop(proc)
    json_path, _ = report.output_paths("fuzz", args.out)
    report.write_json(json_path, results)
    f = results["fuzz"]
    print(f"fuzzed {f['sent']} requests ({f['by_status']}), {len(f['harmful'])} harmful; background "
          f"{results['background']['ok']}/{results['background']['sent']} ok; blocks after: "
          f"{results['blocks_after']['held_blocks']} held; {results['elapsed_s']} s\nwrote {json_path}")
    return 1 if results["harm"] else 0

