"""llama.cpp's server as the peer of `pagellm bench spec-decode`: the same GGUF file, the same prompt
text and threads, once per speculative type it offers (`--spec-type`: none, or its n-gram modes,
which like prompt lookup need no second model), each request timed by the server itself.

The prompt is the text pagellm's tokenizer rendered with the model's chat template, sent to the
raw completion endpoint (`/completion`), so both systems read the same text: llama-server's own
chat endpoint renders the template itself, with another system prompt, and the two prompts
differed. llama-server tokenizes that text with the GGUF's special tokens (a BOS where the file
says so), so a BOS the template already wrote is left out of the text (`completion_prompt`).

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
# Characters of each run's output kept in the results, so a reader sees whether the model copied.
TEXT_HEAD_CHARS = 200


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
            extra = [] if kind == "none" else ["--spec-type", kind]
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


def completion_prompt(text: str, special_prefix: str) -> str:
    """The text to send llama-server for a prompt pagellm reads as `text`. The server puts the
    tokens the GGUF asks for (a BOS, or nothing) before what it is sent; `special_prefix` is their
    text (pagellm's tokenizer reads the same GGUF settings), and a template that wrote them itself
    would get them twice, so they are cut from the front of `text`."""
    return text[len(special_prefix):] if special_prefix and text.startswith(special_prefix) else text


def request_body(prompt: str, max_tokens: int, schema: dict | None = None) -> dict:
    """The body of one greedy `/completion` request: the raw text, no template applied; with a JSON
    schema, held to it (llama-server's `json_schema`, its grammar from the schema)."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "seed": 0, "stream": False}
    return body if schema is None else {**body, "json_schema": schema}


def tokenize(url: str, prompt: str) -> list[int]:
    """The tokens llama-server reads for `prompt` on /completion (its special tokens added as there)."""
    import httpx

    r = httpx.post(url + "/tokenize", timeout=60, json={"content": prompt, "add_special": True})
    r.raise_for_status()
    return r.json()["tokens"]


def one_run(url: str, prompt: str, max_tokens: int, schema: dict | None = None) -> dict:
    """One greedy completion of `prompt` (completion_prompt's text, held to `schema` if given); the
    server's own timings of it."""
    import httpx

    r = httpx.post(url + "/completion", timeout=600, json=request_body(prompt, max_tokens, schema))
    r.raise_for_status()
    body = r.json()
    t = body.get("timings") or {}
    n, ms = t.get("predicted_n", 0), t.get("predicted_ms", 0.0)
    # tokens_evaluated: the whole prompt, the part served from the server's prompt cache included.
    return {"tokens": n, "decode_s": ms / 1e3, "decode_tokens_per_s": (n - 1) / (ms / 1e3) if ms > 0 and n > 1 else None,
            "prompt_tokens": body.get("tokens_evaluated"), "loadavg": os.getloadavg(),
            "accepted_tokens": t.get("draft_n_accepted", 0), "draft_tokens": t.get("draft_n", 0),
            "text_head": (body.get("content") or "")[:TEXT_HEAD_CHARS]}
