"""llama.cpp's server as the peer of `pagellm bench spec-decode`: the same GGUF file, the same chat
messages and threads, once per speculative type it offers (`--spec-type`: none, or its n-gram
modes, which like prompt lookup need no second model), each request timed by the server itself.

llama-server reports per request the tokens it generated and the time from its first generated
token to its last (`timings.predicted_n`, `predicted_ms`), and what it drafted and kept
(`draft_n`, `draft_n_accepted`), so its decode rate is taken over the same span as pagellm's:
(tokens - 1) / (last token time - first token time).
"""
from __future__ import annotations

import os
import subprocess
import tempfile

from pagellm.bench import serve

# "none" is llama-server without speculation; the others are the values of its --spec-type.
DEFAULT_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod")
# Those a single GGUF file can run (a draft model's type needs a second file).
TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def check_types(types: list[str]) -> None:
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        raise ValueError(f"--peer: unknown llama-server --spec-type {', '.join(unknown)}; choose from {', '.join(TYPES)}")


def start(model: str, types: list[str], threads: int, context: int) -> dict[str, tuple[subprocess.Popen, str]]:
    """One llama-server per type, started together (an idle one takes no CPU), each ready to serve."""
    if not model.endswith(".gguf"):
        raise ValueError(f"llama-server serves GGUF files; --model {model} is not one")
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for kind in types:
            extra = ["--jinja"] + ([] if kind == "none" else ["--spec-type", kind])
            log = os.path.join(tempfile.gettempdir(), f"spec-decode-llama-server-{kind}.log")
            proc, url = serve.launch(serve.LLAMA_SERVER, [], log, {"model": model, "threads": threads, "parallel": 1,
                                                                    "ctx_per_slot": context, "extra": extra})
            servers[kind] = (proc, url)
            serve.wait_ready(url, proc, timeout_s=300)
    except BaseException:
        stop(servers)
        raise
    return servers


def stop(servers: dict[str, tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in servers.values():
        serve.stop(proc)


def one_run(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One greedy chat request; the server's own timings of it."""
    import httpx

    r = httpx.post(url + "/v1/chat/completions", timeout=600,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0})
    r.raise_for_status()
    body = r.json()
    t = body.get("timings") or {}
    n, ms = t.get("predicted_n", 0), t.get("predicted_ms", 0.0)
    return {"tokens": n, "decode_s": ms / 1e3, "decode_tokens_per_s": (n - 1) / (ms / 1e3) if ms > 0 and n > 1 else None,
            "prompt_tokens": t.get("prompt_n"), "loadavg": os.getloadavg(),
            "accepted_tokens": t.get("draft_n_accepted", 0), "draft_tokens": t.get("draft_n", 0),
            "text": body["choices"][0]["message"].get("content") or ""}
